"""``speculum train --states online``: the target's hidden states made batch by batch while
training, in place of recorded ones. Tiny random target, token-id prompts, CPU (fp32)."""

from __future__ import annotations

import json

import attrs
import pytest
import torch

from speculum.cli import main
from speculum.testing import token_prompts_file
from speculum.train.data import DistillData
from speculum.train.distill import DistillSpec, ensure_distill
from speculum.train.generate import engine
from speculum.train.online import OnlineStates

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAYERS = (-1, 0)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return token_prompts_file(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", n=40)


def recorded(tiny_llama, prompts, root):
    sp = DistillSpec(model=str(tiny_llama), prompts=str(prompts), num_prompts=12, max_tokens=24, layers=LAYERS)
    d, shards = ensure_distill(sp, root, max_num_seqs=5, device="cpu", shard_size=8)
    return sp, d, shards


def compare(a, b, atol: float) -> float:
    """The largest difference of two batches' states (their tokens and masks must be equal)."""
    for f in ("tokens", "valid", "answer_next", "greedy"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert set(a.hidden) == set(b.hidden) == set(LAYERS)
    worst = max(float((a.hidden[l] - b.hidden[l]).abs().max()) for l in LAYERS)
    assert worst <= atol, worst
    return worst


# (max_len, prompt_context, answer_tokens): whole sequences; the start cut by --max-len (the
# prefill must still begin at the first token); the prompt cut by --prompt-context; the answer
# cut as validation's first-turn replay cuts it (the last position kept then has a state)
CUTS = [(384, 0, 0), (12, 0, 0), (384, 3, 0), (384, 0, 5), (10, 2, 4)]


@pytest.mark.parametrize("max_len,prompt_context,answer_tokens", CUTS)
def test_online_batches_equal_the_recorded_ones(tiny_llama, prompts, tmp_path, max_len, prompt_context,
                                                answer_tokens):
    """The states an online batch gets are the recorded ones (both stored in bf16; computed in
    fp32 by the same engine, in other groups of sequences), position for position, padding and
    each sequence's last token zero, for every cut a batch makes."""
    sp, d, shards = recorded(tiny_llama, prompts, tmp_path)
    disk = DistillData.load(d, shards=shards)
    # another engine (batch of 3, not generation's 5): the states must not depend on the grouping
    source = OnlineStates(engine(sp, "cpu", "auto", 3, 2048), LAYERS)
    online = attrs.evolve(DistillData.load(d, layers=(), shards=shards), states=source)
    assert online.hidden == {} and online.layers == LAYERS
    ids = list(range(len(disk)))
    for chunk in (ids[:7], ids[7:]):
        a = disk.batch(chunk, max_len, prompt_context=prompt_context, answer_tokens=answer_tokens)
        b = online.batch(chunk, max_len, prompt_context=prompt_context, answer_tokens=answer_tokens)
        compare(a, b, atol=1e-2)
        assert not b.hidden[-1][~a.valid & ~(a.tokens != 0)].any()  # padding stays zero


def test_a_prefill_of_the_kept_window_only_would_be_caught(tiny_llama, prompts, tmp_path):
    """Power of the comparison above: states computed from the first token kept (not the
    sequence's first token) differ from the recorded ones by far more than its tolerance."""
    sp, d, shards = recorded(tiny_llama, prompts, tmp_path)
    disk = DistillData.load(d, shards=shards)
    source = OnlineStates(engine(sp, "cpu", "auto", 3, 2048), LAYERS)
    i = max(range(len(disk)), key=lambda j: int(disk.offsets[j + 1] - disk.offsets[j]))
    s, e = int(disk.offsets[i]), int(disk.offsets[i + 1])
    cut = 6  # the window a --max-len of e - s - cut keeps
    window = source([disk.tokens[s + cut: e].tolist()])[0]
    gap = max(float((window[l][:-1].float() - disk.hidden[l][s + cut: e - 1].float()).abs().max()) for l in LAYERS)
    assert gap > 0.1, gap


def test_training_online_writes_no_states_and_learns_what_training_on_disk_learns(tiny_llama, prompts, tmp_path):
    """`speculum train mtp --states online`: the answers are cached without states (a cache
    of recorded answers is reused, not answered again), and the trained module, its
    validation and its report match a run on the recorded states."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    other = token_prompts_file(tmp_path / "other.jsonl", n=10, seed=7)  # --eval-prompts: their answers online too

    def run(out, *extra):
        assert main(["train", "mtp", "--model", str(tiny_llama), "--prompts", str(prompts), "--num-prompts", "12",
                     "--max-tokens", "16", "--device", "cpu", "--cache-dir", str(tmp_path / out / "c"), "--out",
                     str(tmp_path / out / "m"), "--steps", "6", "--batch-size", "4", "--eval-every", "3",
                     "--warmup", "1", "--eval-prompts", str(other), "--eval-num-prompts", "6", *extra]) == 0
        return (load_file(str(tmp_path / out / "m" / "model.safetensors")),
                json.loads((tmp_path / out / "m" / "training.json").read_text()))

    w_disk, r_disk = run("disk")
    w_online, r_online = run("online", "--states", "online")
    cache = next((tmp_path / "online" / "c").glob("*/meta.json")).parent
    for shard in cache.glob("shard_*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            assert not any(k.startswith("hidden.") for k in f.keys())
    assert "--states online" in r_online["command"]
    assert r_online["data"]["tokens"] == r_disk["data"]["tokens"]
    assert set(w_online) == set(w_disk)
    for k in w_disk:
        torch.testing.assert_close(w_online[k], w_disk[k], atol=1e-3, rtol=1e-3)
    for key in ("val_accuracy_per_position", "eval_accuracy_per_position"):
        assert len(r_online[key]) == len(r_disk[key])
        for a, b in zip(r_online[key], r_disk[key]):
            assert abs(a - b) <= 0.02, key
    assert r_online["eval_sequences"] == r_disk["eval_sequences"] == 6
    # answers recorded with states serve an online run as they are: nothing answered again
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "disk" / "c").rglob("shard_*")}
    assert main(["train", "mtp", "--model", str(tiny_llama), "--prompts", str(prompts), "--num-prompts", "12",
                 "--max-tokens", "16", "--device", "cpu", "--cache-dir", str(tmp_path / "disk" / "c"), "--out",
                 str(tmp_path / "again"), "--steps", "2", "--batch-size", "4", "--eval-every", "0",
                 "--eval-prompts", str(other), "--eval-num-prompts", "6", "--states", "online",
                 "--cached-data-only"]) == 0
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "disk" / "c").rglob("shard_*")} == before


def test_record_for_is_refused_with_online_states(tiny_llama, prompts, capsys):
    assert main(["train", "mtp", "--model", str(tiny_llama), "--prompts", str(prompts), "--device", "cpu",
                 "--states", "online", "--record-for", "mtp"]) == 2
    assert "--states online writes none" in capsys.readouterr().err


def test_the_states_engine_leaves_the_runs_threads(tiny_llama, prompts, tmp_path, monkeypatch):
    """`--threads 1` holds while the online states' engine starts: an engine applies its own
    default (here forced to 2, what this machine's idle CPUs would give) when it starts."""
    import speculum.threads as threads
    from speculum.train.online import online_states
    monkeypatch.setattr(threads, "choose_threads", lambda n=None: threads.ThreadChoice(n or 2, 2, 0.0, "default"))
    monkeypatch.setattr(threads, "_applied", None)
    sp, _, _ = recorded(tiny_llama, prompts, tmp_path)
    torch.set_num_threads(1)
    online_states(sp, LAYERS, "cpu", None, "auto", 4, 2048)
    assert torch.get_num_threads() == 1


def test_the_states_engine_prefills_whole_sequences_to_the_same_states(tiny_llama, prompts, tmp_path):
    """The online engine prefills whole sequences (one chunk of `max_model_len`: a batch in a
    few forwards) and gets the states a prefill in chunks of 5 tokens gets (the chunks after the
    first read the earlier ones through the cache), as the recorded ones."""
    from speculum.train.online import online_states
    sp, d, shards = recorded(tiny_llama, prompts, tmp_path)
    src = online_states(sp, LAYERS, "cpu", None, "auto", 4, 2048)
    assert src.llm.target.prefill_chunk == 2048
    chunked = OnlineStates(engine(sp, "cpu", "auto", 4, 2048, prefill_chunk=5), LAYERS)
    disk = DistillData.load(d, shards=shards)
    seqs = [disk.tokens[int(disk.offsets[i]): int(disk.offsets[i + 1])].tolist() for i in range(len(disk))]
    assert max(map(len, seqs)) > 20  # several chunks of 5
    for a, b in zip(src(seqs), chunked(seqs)):
        for l in LAYERS:
            torch.testing.assert_close(a[l].float(), b[l].float(), atol=1e-2, rtol=0)


def test_bench_states_times_recorded_and_online_batches(tiny_llama, prompts, tmp_path, capsys):
    """`speculum bench states CACHE`: ms per training batch from the recorded states and made
    online at each prefill chunk, in a table and JSON; the online states of the first batch
    are the recorded ones."""
    _, d, _ = recorded(tiny_llama, prompts, tmp_path)
    out = tmp_path / "states.json"
    assert main(["bench", "states", str(d), "--model", str(tiny_llama), "--layers=-1,0", "--batch-size", "2",
                 "--batches", "2", "--chunks", "5,2048", "--device", "cpu", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["source"], r["prefill_chunk"]) for r in report["rows"]] == [("recorded", None), ("online", 5),
                                                                           ("online", 2048)]
    assert all(len(r["seconds"]) == 2 and r["ms_median"] > 0 for r in report["rows"])
    assert all(r["max_abs_diff_to_recorded"] <= 1e-2 for r in report["rows"][1:])
    assert "x recorded" in capsys.readouterr().out
    assert main(["bench", "states", str(tmp_path), "--model", str(tiny_llama), "--device", "cpu"]) == 2
    assert "not a distillation cache" in capsys.readouterr().err
