"""``speculum train``: self-distillation data, resumable training, validation, draft models.

Everything runs on a tiny random target with token-id prompts (seconds on a CPU).
"""

from __future__ import annotations

import json
import random

import attrs
import pytest
import torch

from speculum import LLM, SamplingParams
from speculum.cli import main
from speculum.errors import ConfigError, ModelLoadError
from speculum.testing import PrefillHidden, make_llm, token_prompts_file
from speculum.train.data import DistillData
from speculum.train.distill import DistillSpec, ensure_distill


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return token_prompts_file(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", n=40)


def spec(target, prompts, n, layers=(-1, 0)) -> DistillSpec:
    return DistillSpec(model=str(target), prompts=str(prompts), num_prompts=n, max_tokens=24, layers=layers)


def test_distillation_records_the_targets_hidden_states(tiny_llama, prompts, tmp_path):
    d, shards = ensure_distill(spec(tiny_llama, prompts, 12), tmp_path, max_num_seqs=5, device="cpu", shard_size=8)
    assert shards == ["shard_00000.safetensors", "shard_00001.safetensors"]
    data = DistillData.load(d, shards=shards)
    assert len(data) == 12 and data.layers == (-1, 0)
    ref = PrefillHidden(tiny_llama, (-1, 0))
    rows = [json.loads(l) for l in prompts.read_text().splitlines()]
    for i in range(len(data)):
        s, e, P = int(data.offsets[i]), int(data.offsets[i + 1]), int(data.prompt_lens[i])
        tokens = data.tokens[s:e].tolist()
        assert tokens[:P] == rows[int(data.prompt_index[i])]["prompt_token_ids"]
        assert 1 <= e - s - P <= 24  # the answer (max_tokens, or up to an EOS)
        want = ref(tokens[:-1])  # teacher-forced states of every position but the last
        for layer in (-1, 0):
            got = data.hidden[layer][s:e - 1].float()
            torch.testing.assert_close(got, want[layer].float(), atol=0.05, rtol=0.02)  # stored in bf16
            assert not data.hidden[layer][e - 1].any()  # the last token has no state


def test_distillation_cache_is_reused_and_extended(tiny_llama, prompts, tmp_path):
    d1, s1 = ensure_distill(spec(tiny_llama, prompts, 6), tmp_path, device="cpu", shard_size=8)
    before = (d1 / "shard_00000.safetensors").read_bytes()
    d2, s2 = ensure_distill(spec(tiny_llama, prompts, 14), tmp_path, device="cpu", shard_size=8)
    assert d1 == d2 and s2 == ["shard_00000.safetensors", "shard_00001.safetensors"]
    meta = json.loads((d2 / "meta.json").read_text())
    assert meta["sizes"] == {"shard_00000.safetensors": 8, "shard_00001.safetensors": 6}
    assert (d1 / "shard_00000.safetensors").read_bytes() != before  # the cut first shard was completed
    d3, s3 = ensure_distill(spec(tiny_llama, prompts, 8), tmp_path, device="cpu", shard_size=8)
    assert s3 == ["shard_00000.safetensors"] and d3 == d1  # a prefix: nothing generated


def test_data_rows_have_their_own_cache_and_reuse_the_prompts_answers(tiny_llama, prompts, tmp_path):
    """--data rows (e.g. the target's own requests) live in a cache of their own: adding them
    to a run whose training prompts are answered (an earlier run, answers carried from another
    machine) answers only the new rows, and training reads both caches."""
    from speculum.train.distill import ensure_parts, parts, parts_summary
    from speculum.train.loop import load_data
    from speculum.train.mix import DATA_BASE

    base = spec(tiny_llama, prompts, 10)
    ((d_p, s_p),) = ensure_parts(base, tmp_path, device="cpu", shard_size=8)
    before = {n: (d_p / n).read_bytes() for n in s_p}
    mine = token_prompts_file(tmp_path / "mine.jsonl", n=5, seed=7)
    both = attrs.evolve(base, data=(str(mine),))
    assert [p.key() for p in parts(both)][1] == base.key()
    (d_d, s_d), (d_p2, s_p2) = ensure_parts(both, tmp_path, device="cpu", shard_size=8)
    assert d_p2 == d_p and s_p2 == s_p and {n: (d_p / n).read_bytes() for n in s_p} == before  # not redone
    assert d_d != d_p and len(DistillData.load(d_d, shards=s_d)) == 5
    mix = parts_summary([(d_d, s_d), (d_p, s_p)], both)
    assert mix["sequences_per_kind"]["answer"] == 15 and mix["rows"] == 15
    data = load_data(d_p, (-1,), [str(d / n) for d, names in ((d_d, s_d), (d_p, s_p)) for n in names], "cpu")
    assert len(data) == 15  # the rows' group ids: the data file's past DATA_BASE, the prompts' their rows
    assert sorted(set(data.prompt_index.tolist())) == sorted(set(range(40)) & set(data.prompt_index.tolist())) + \
        [DATA_BASE + i for i in range(5)]
    # out of generation time after the first part: the second uses what it has (here: all of it)
    (_, s_d3), (_, s_p3) = ensure_parts(both, tmp_path, device="cpu", shard_size=8, time_limit=1e-9)
    assert s_d3 == s_d and s_p3 == s_p


def test_each_data_file_has_its_own_cache(tiny_llama, prompts, tmp_path):
    """A --data file added to those answered before answers only its own rows: each file is a
    cache of its own (before 2026-12-04 the files shared one keyed by the whole list, and the
    H200's data call answered 7,000 rows to add 3,000). A file given twice is one part."""
    from speculum.train.distill import ensure_parts, parts

    base = spec(tiny_llama, prompts, 0)
    a = token_prompts_file(tmp_path / "a.jsonl", n=5, seed=7)
    b = token_prompts_file(tmp_path / "b.jsonl", n=4, seed=8)
    first = ensure_parts(attrs.evolve(base, data=(str(a),)), tmp_path, device="cpu", shard_size=8)
    stamp = {n: (first[0][0] / n).stat().st_mtime_ns for n in first[0][1]}
    both = attrs.evolve(base, data=(str(b), str(a), str(a)))
    assert [p.data for p in parts(both)] == [(str(b),), (str(a),), ()]
    found = ensure_parts(both, tmp_path, device="cpu", shard_size=8, generate=False)
    assert found[1] == first[0]  # a's answers found under b's addition, in another order
    assert found[0][1] == []  # b: nothing without generating
    found = ensure_parts(both, tmp_path, device="cpu", shard_size=8)
    assert len(DistillData.load(found[0][0], shards=found[0][1])) == 4
    assert {n: (first[0][0] / n).stat().st_mtime_ns for n in first[0][1]} == stamp  # a's not redone


def test_generation_time_is_shared_between_data_rows_and_training_prompts(tmp_path, monkeypatch):
    """With a generation time limit the --data part may spend only its share (by rows) and
    the training prompts get the rest: answered first with the whole limit, 1,000 rows of
    the target's own requests took all 160 s on the H200 and no training prompt was answered.
    The wrong variant (the data part given the whole limit) is what the first assert rules out."""
    from speculum.train import distill

    mine = tmp_path / "mine.jsonl"
    mine.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(100)) + "\n")
    both = DistillSpec(model="m", prompts="p.jsonl", num_prompts=300, data=(str(mine),))
    assert distill.time_shares(distill.parts(both)) == [0.25, 0.75]
    asked = []

    def fake(part, root=None, time_limit=0, generate=True, **kw):
        asked.append((bool(part.data), round(time_limit, 1), generate))
        return tmp_path, []
    monkeypatch.setattr(distill, "ensure_distill", fake)
    distill.ensure_parts(both, tmp_path, time_limit=160)
    assert asked[0] == (True, 40.0, True)  # the data rows: a quarter of the limit
    assert asked[1][0] is False and 119 < asked[1][1] <= 160  # the prompts: the rest
    asked.clear()
    distill.ensure_parts(both, tmp_path)  # no limit: none for either
    assert asked == [(True, 0, True), (False, 0, True)]
    # the training prompts answered in full (a carried cache), 40 of the data rows too: the data
    # part gets the whole limit (by rows left; the wrong variant, by rows, gave the prompts 3/4)
    for part, done in zip(distill.parts(both), (40, 300)):
        d = distill.cache_dir(part, tmp_path)
        d.mkdir(parents=True)
        (d / "meta.json").write_text(json.dumps({"sizes": {"shard_00000.safetensors": done}}))
    assert distill.time_shares(distill.parts(both), tmp_path) == [1.0, 0.0]
    asked.clear()
    distill.ensure_parts(both, tmp_path, time_limit=160)
    assert asked[0] == (True, 160.0, True)


def test_time_a_part_leaves_unused_goes_back_to_a_part_stopped_at_its_share(tmp_path, monkeypatch):
    """The H200 (2026-12-04): the target's own requests stopped at their share (182 s, 1,408 of
    3,000 answered), then the training prompts finished 114 s early, and those seconds were lost.
    Now the part stopped is taken up again with what is left. The wrong variant (one pass) asks
    each part once: the third call below would be missing."""
    from speculum.train import distill

    mine = tmp_path / "mine.jsonl"
    mine.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(100)))
    both = DistillSpec(model="m", prompts="p.jsonl", num_prompts=300, data=(str(mine),))
    asked, calls = [], {}

    def fake(part, root=None, time_limit=0, generate=True, **kw):
        d = tmp_path / ("data" if part.data else "prompts")
        d.mkdir(exist_ok=True)
        shards = ["shard_00000.safetensors", "shard_00001.safetensors"]
        (d / "meta.json").write_text(json.dumps({"selections": {str(part.num_prompts): {"shards": shards}}}))
        n = calls[d.name] = calls.get(d.name, 0) + 1
        asked.append((bool(part.data), round(time_limit), n))
        # the data part stops at its share with one shard of two the first time, finishes the next
        return d, shards[:1] if part.data and n == 1 else shards
    monkeypatch.setattr(distill, "ensure_distill", fake)
    found = distill.ensure_parts(both, tmp_path, time_limit=160)
    assert [a[0] for a in asked] == [True, False, True]  # data, prompts, data again
    assert asked[0][1] == 40 and 150 < asked[2][1] <= 160  # its share, then what the prompts left
    assert [len(names) for _, names in found] == [2, 2]
    asked.clear()
    calls.clear()
    monkeypatch.setattr(distill, "MIN_SECONDS_AGAIN", 1e9)  # too little left: one pass only
    distill.ensure_parts(both, tmp_path, time_limit=160)
    assert [a[0] for a in asked] == [True, False]


def train(args: list[str]) -> int:
    return main(["train", *args])


def test_train_resumes_validates_and_writes_the_public_format(tiny_llama, prompts, tmp_path):
    common = ["mtp", "--model", str(tiny_llama), "--prompts", str(prompts), "--num-prompts", "24",
              "--max-tokens", "24", "--device", "cpu", "--cache-dir", str(tmp_path / "c"), "--out",
              str(tmp_path / "out"), "--batch-size", "4", "--save-every", "5", "--eval-every", "5",
              "--num-positions", "3", "--warmup", "2"]
    assert train(common + ["--steps", "5"]) == 0
    state = torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=False)
    assert state["step"] == 5
    assert train(common + ["--steps", "8", "--resume"]) == 0
    state = torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=False)
    assert state["step"] == 8 and [h["step"] for h in state["history"]] == [5, 8]
    report = json.loads((tmp_path / "out" / "training.json").read_text())
    assert len(report["val_accuracy_per_position"]) == 3
    assert all(0 <= a <= 1 for a in report["val_accuracy_per_position"])
    assert report["data"]["validation_sequences"] >= 1 and report["data"]["val_split"] == "prompt-hash"
    assert report["command"].startswith("speculum train mtp")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["speculum"]["method"] == "mtp"


def test_train_refuses_mt_bench_and_unknown_methods(tiny_llama, tmp_path, capsys):
    bench = tmp_path / "mt_bench.jsonl"
    bench.write_text("")
    assert train(["eagle", "--model", str(tiny_llama), "--prompts", str(bench)]) == 2
    assert "mt_bench is for evaluation only" in capsys.readouterr().err
    from speculum.datasets import eval_set_path
    assert train(["eagle", "--model", str(tiny_llama), "--data", eval_set_path("other_tasks")]) == 2
    assert "other_tasks is for evaluation only" in capsys.readouterr().err
    assert train(["nonsense"]) == 2
    assert "no trainer for method 'nonsense'" in capsys.readouterr().err
    assert train([]) == 0
    out = capsys.readouterr().out
    assert all(m in out for m in ("draft", "eagle", "eagle3", "medusa", "mtp"))


def test_trained_draft_model_is_a_lossless_draft(tiny_llama, prompts, tmp_path):
    out = tmp_path / "draft"
    assert train(["draft", "--model", str(tiny_llama), "--prompts", str(prompts), "--num-prompts", "24",
                  "--max-tokens", "24", "--device", "cpu", "--cache-dir", str(tmp_path / "c"), "--out", str(out),
                  "--steps", "30", "--batch-size", "4", "--num-layers", "1", "--eval-every", "0",
                  "--save-dtype", "float32"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["vocab_size"] == 512
    p = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [30, 31, 30, 31, 30]}]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    base = make_llm(tiny_llama).generate(p, greedy)
    llm = make_llm(tiny_llama, {"model": str(out), "num_speculative_tokens": 3})
    assert llm.speculative_config.method == "draft_model"
    assert [o.token_ids for o in llm.generate(p, greedy)] == [b.token_ids for b in base]
    assert llm.metrics.num_accepted_tokens > 0


def test_a_draft_with_a_wider_mlp_starts_as_the_target_shaped_one(tiny_llama, prompts, tmp_path):
    """--intermediate-size above the target's at the target's width: the layers still start as the
    target's (attention, norms, the MLP's first units), the extra units' output columns at zero,
    so at --lr 0 the wide draft computes what the target-shaped draft computes (to rounding) and
    drafts the same tokens, losslessly. The wrong variant (random extra output columns) does not."""
    from transformers import AutoModelForCausalLM

    from speculum.proposers.head_checkpoint import read_weights
    common = ["--model", str(tiny_llama), "--prompts", str(prompts), "--num-prompts", "12", "--max-tokens", "12",
              "--device", "cpu", "--cache-dir", str(tmp_path / "c"), "--steps", "1", "--lr", "0", "--batch-size", "4",
              "--num-layers", "2", "--eval-every", "0", "--save-dtype", "float32"]
    narrow, wide = tmp_path / "narrow", tmp_path / "wide"
    assert train(["draft", *common, "--out", str(narrow)]) == 0
    assert train(["draft", *common, "--intermediate-size", "320", "--out", str(wide)]) == 0
    n, w = read_weights(narrow), read_weights(wide)
    It = n["model.layers.0.mlp.down_proj.weight"].shape[1]
    assert w["model.layers.0.mlp.down_proj.weight"].shape[1] == 320 > It
    for i in (0, 1):
        pre = f"model.layers.{i}.mlp."
        assert torch.equal(w[pre + "gate_proj.weight"][:It], n[pre + "gate_proj.weight"])
        assert torch.equal(w[pre + "down_proj.weight"][:, :It], n[pre + "down_proj.weight"])
        assert not w[pre + "down_proj.weight"][:, It:].any() and w[pre + "gate_proj.weight"][It:].any()
    assert json.loads((wide / "config.json").read_text())["speculum_init_layers"] == \
        json.loads((narrow / "config.json").read_text())["speculum_init_layers"]
    ids = torch.tensor([[5, 6, 7, 8, 30, 31, 30, 31]])
    logits = {d.name: AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)(ids).logits for d in (narrow, wide)}
    assert torch.allclose(logits["narrow"], logits["wide"], atol=1e-5)
    p = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [30, 31, 30, 31, 30]}]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    base = [o.token_ids for o in make_llm(tiny_llama).generate(p, greedy)]
    runs = {}
    for d in (narrow, wide):
        llm = make_llm(tiny_llama, {"method": "draft_model", "model": str(d), "num_speculative_tokens": 3})
        runs[d.name] = ([o.token_ids for o in llm.generate(p, greedy)], llm.metrics.num_accepted_tokens)
    assert runs["wide"] == runs["narrow"] and runs["wide"][0] == base
    # a trained narrow draft grows the same way (--init-from with a wider --intermediate-size), and a
    # wide one continues as it is without its shape given again (the checkpoint's shape is the default)
    trained = tmp_path / "trained"
    i = common.index("--lr")
    assert train(["draft", *common[:i], *common[i + 2:], "--steps", "4", "--out", str(trained)]) == 0
    grown, again = tmp_path / "grown", tmp_path / "again"
    assert train(["draft", *common, "--init-from", str(trained), "--intermediate-size", "320", "--out", str(grown)]) == 0
    t, g = read_weights(trained), read_weights(grown)
    assert g["model.layers.1.mlp.up_proj.weight"].shape[0] == 320
    assert all(torch.equal(g[k][tuple(slice(0, n) for n in v.shape)], v) for k, v in t.items())
    assert not g["model.layers.1.mlp.down_proj.weight"][:, It:].any()
    grown_logits = AutoModelForCausalLM.from_pretrained(str(grown), dtype=torch.float32)(ids).logits
    trained_logits = AutoModelForCausalLM.from_pretrained(str(trained), dtype=torch.float32)(ids).logits
    assert torch.allclose(grown_logits, trained_logits, atol=1e-5)
    assert train(["draft", *common, "--init-from", str(grown), "--out", str(again)]) == 0
    assert json.loads((again / "config.json").read_text())["intermediate_size"] == 320
    # the wrong variant: the same extra units with random output columns computes something else
    from safetensors.torch import save_file
    bad = dict(w)
    for i in (0, 1):
        k = f"model.layers.{i}.mlp.down_proj.weight"
        bad[k] = bad[k].clone()
        bad[k][:, It:] = torch.randn_like(bad[k][:, It:])
    save_file(bad, str(wide / "model.safetensors"), metadata={"format": "pt"})
    wrong = AutoModelForCausalLM.from_pretrained(str(wide), dtype=torch.float32)(ids).logits
    assert not torch.allclose(logits["narrow"], wrong, atol=1e-3)


def test_a_trained_draft_grows_deeper_and_drafts_as_before(tiny_llama, prompts, tmp_path):
    """``--init-from`` a 2-layer draft with ``--num-layers 3``: its layers unchanged, then a copy of
    its last layer whose attention and MLP output projections start at zero, so at ``--lr 0`` the
    grown draft drafts exactly the tokens the 2-layer one drafted (lossless, the same acceptance);
    the wrong variant (those projections random) drafts others. Continued without ``--num-layers``
    it stays at 3 (the checkpoint's shape is the default)."""
    from speculum.testing import assert_grown_head_drafts_as_before
    common = ["--model", str(tiny_llama), "--prompts", str(prompts), "--num-prompts", "12", "--max-tokens", "12",
              "--device", "cpu", "--cache-dir", str(tmp_path / "c"), "--batch-size", "4", "--eval-every", "0",
              "--save-dtype", "float32"]
    two, three, again = tmp_path / "two", tmp_path / "three", tmp_path / "again"
    assert train(["draft", *common, "--steps", "4", "--num-layers", "2", "--out", str(two)]) == 0
    assert train(["draft", *common, "--steps", "1", "--lr", "0", "--init-from", str(two), "--num-layers", "3",
                  "--out", str(three)]) == 0
    assert json.loads((three / "config.json").read_text())["num_hidden_layers"] == 3
    p = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [30, 31, 30, 31, 30]}]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = [o.token_ids for o in make_llm(tiny_llama).generate(p, greedy)]
    spec = {"method": "draft_model", "num_speculative_tokens": 3}
    llms = assert_grown_head_drafts_as_before(
        lambda sp: make_llm(tiny_llama, sp), spec, two, three,
        ["model.layers.2.self_attn.o_proj.weight", "model.layers.2.mlp.down_proj.weight"], p, greedy, plain, tmp_path)
    assert llms[1].metrics.num_accepted_tokens == llms[0].metrics.num_accepted_tokens > 0
    assert train(["draft", *common, "--steps", "1", "--init-from", str(three), "--out", str(again)]) == 0
    assert json.loads((again / "config.json").read_text())["num_hidden_layers"] == 3


def test_a_shipped_draft_is_used_when_model_is_unset_and_only_for_its_target(tiny_llama, prompts, tmp_path,
                                                                            monkeypatch):
    """A draft in the draft-model plugin's ``drafts/`` folder (as one would ship for the default
    model: saved without the target's embedding) is what ``{"method": "draft_model"}`` without
    ``model`` drafts with, for the target it was made for, losslessly; for another target the
    error says which targets the plugin has drafts for."""
    proposer = pytest.importorskip("speculum_draft_model.proposer")
    from speculum.testing import tiny_model_dir
    monkeypatch.setenv("SPECULUM_CACHE", str(tmp_path / "cache"))
    shipped = tmp_path / "drafts"
    assert train(["draft", "--model", str(tiny_llama), "--prompts", str(prompts), "--num-prompts", "16",
                  "--max-tokens", "16", "--device", "cpu", "--cache-dir", str(tmp_path / "c"), "--steps", "8",
                  "--batch-size", "4", "--num-layers", "1", "--eval-every", "0", "--save-dtype", "float32",
                  "--embeddings-from-target", "--out", str(shipped / "draft-tiny")]) == 0
    monkeypatch.setattr(proposer, "SHIPPED", shipped)
    p = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [30, 31, 30, 31, 30]}]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    base = make_llm(tiny_llama).generate(p, greedy)
    llm = make_llm(tiny_llama, {"method": "draft_model", "num_speculative_tokens": 3})
    assert [o.token_ids for o in llm.generate(p, greedy)] == [b.token_ids for b in base]
    assert llm.metrics.num_accepted_tokens > 0
    other = tiny_model_dir(tmp_path / "other", "llama", seed=5)
    with pytest.raises(ConfigError, match="ships drafts for tiny"):
        make_llm(other, {"method": "draft_model", "num_speculative_tokens": 3})


def test_a_slim_draft_is_completed_for_the_target_whose_fingerprint_it_recorded(tmp_path, monkeypatch):
    """The check uses the fingerprint the trainer records (``target_fingerprint``: the first 1,024
    rows of the embedding). With a 2,048-row embedding a check over all rows (the first version)
    refuses the draft's own target; a changed embedding is refused either way."""
    from safetensors.torch import load_file, save_file

    from speculum.model_source import complete_draft
    from speculum.proposers.head_checkpoint import target_fingerprint
    monkeypatch.setenv("SPECULUM_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    embed = torch.randn(2048, 8)
    embed[1024:] *= 3  # rows past the fingerprint's differ in scale, as a real vocabulary's do
    target, draft = tmp_path / "target", tmp_path / "draft"
    target.mkdir()
    draft.mkdir()
    save_file({"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(8)},
              str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "vocab_size": 2048, "hidden_size": 8}))
    meta = {"embeddings_from_target": True, "target": target_fingerprint(embed, "t", 4)}
    (draft / "config.json").write_text(json.dumps({"vocab_size": 2048, "hidden_size": 8, "tie_word_embeddings": True,
                                                   "speculum": meta}))
    save_file({"model.norm.weight": torch.ones(8)}, str(draft / "model.safetensors"))
    full = complete_draft(draft, target)
    assert torch.equal(load_file(str(full / "model.safetensors"))["model.embed_tokens.weight"], embed)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text((target / "config.json").read_text())
    save_file({"model.embed_tokens.weight": embed * 1.1}, str(other / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="is another model"):
        complete_draft(draft, other)


def test_record_layers_skip_methods_that_cannot_train_on_the_target():
    from speculum.train.base import Trainer
    from speculum.train.loop import record_layers

    class Picky(Trainer):
        def data_layers(self, args, n):
            raise ConfigError("too shallow")

    class Plain(Trainer):
        def data_layers(self, args, n):
            return (-1, 3)

    assert record_layers([Picky(), Plain()], None, 2) == (-1, 3)


def test_extra_sampled_answers_for_instruction_prompts_split_by_prompt(tiny_llama, tmp_path):
    rows = [{"source": "t0/task" if i % 2 else "user_oriented", "prompt_token_ids": [5 + i, 6, 7 + i]}
            for i in range(10)]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = DistillSpec(model=str(tiny_llama), prompts=str(prompts), num_prompts=10, max_tokens=16, layers=(-1,),
                    extra_answers=2, extra_temperature=1.0)
    assert s.key() != spec(tiny_llama, prompts, 10, layers=(-1,)).key()
    d, shards = ensure_distill(s, tmp_path, device="cpu", shard_size=7)
    data = DistillData.load(d, shards=shards)
    index = data.prompt_index.tolist()
    # 5 instruction prompts x 3 answers (greedy + 2 sampled) + 5 T0 prompts x 1
    assert len(data) == 20 and sorted(set(index)) == list(range(10))
    for row in range(10):
        seqs = [i for i, r in enumerate(index) if r == row]
        assert len(seqs) == (3 if row % 2 == 0 else 1)
        answers = {tuple(data.tokens[data.offsets[i] + data.prompt_lens[i]: data.offsets[i + 1]].tolist())
                   for i in seqs}
        if row % 2 == 0:
            assert len(answers) > 1  # sampled answers differ from the greedy one
    train, val = data.split(0.3, seed=0)
    assert sorted(train + val) == list(range(20))
    assert not {index[i] for i in train} & {index[i] for i in val}  # a prompt's answers stay on one side


def test_defaults_keep_the_cache_key_of_earlier_versions(tiny_llama, prompts):
    """Caches made before ``extra_answers`` existed are found again: the key formula of
    that version (every field but num_prompts) still gives the same key."""
    import hashlib
    from pathlib import Path
    s = spec(tiny_llama, prompts, 4)
    old = {"model": s.model, "prompts": [Path(s.prompts).name, Path(s.prompts).stat().st_size],
           "max_prompt_tokens": s.max_prompt_tokens, "max_tokens": s.max_tokens, "temperature": s.temperature,
           "seed": s.seed, "layers": list(s.layers), "chat": s.chat}
    assert s.key() == hashlib.sha1(json.dumps(old, sort_keys=True).encode()).hexdigest()[:12]


def test_time_limit_and_eval_prompts(tiny_llama, prompts, tmp_path):
    """--time-limit stops early and still exports; --eval-prompts reports accuracy on another
    prompt set, equal to evaluating the exported head on that set's cached answers."""
    pytest.importorskip("speculum_mtp")
    from speculum.backends.torch.heads import TargetParts
    from speculum.train.cli import common_arguments, trainers
    from speculum.train.loop import evaluate
    other = token_prompts_file(tmp_path / "other.jsonl", n=10, seed=7)
    argv = ["mtp", "--model", str(tiny_llama), "--prompts", str(prompts), "--num-prompts", "16",
            "--max-tokens", "16", "--device", "cpu", "--cache-dir", str(tmp_path / "c"), "--out",
            str(tmp_path / "out"), "--batch-size", "4", "--eval-every", "0", "--num-positions", "2",
            "--warmup", "2", "--steps", "100000", "--time-limit", "2", "--save-dtype", "float32",
            "--eval-prompts", str(other), "--eval-num-prompts", "6"]
    assert train(argv) == 0
    report = json.loads((tmp_path / "out" / "training.json").read_text())
    assert 1 <= report["steps"] < 100000 and report["eval_sequences"] == 6
    ev = report["eval_accuracy_per_position"]
    assert len(ev) == 2 and report["eval_expected_acceptance_length"] >= 1.0
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["speculum"]["training"]["eval_accuracy_per_position"] == ev
    # the same figure from the exported module on the cached answers of the eval prompts
    from speculum_mtp.formats import load_mtp
    target = TargetParts.from_checkpoint(tiny_llama, torch.float32, "cpu")
    trainer = trainers()["mtp"].create()
    import argparse
    p = argparse.ArgumentParser()
    common_arguments(p)
    trainer.add_arguments(p)
    args = p.parse_args(["--num-positions", "2"])
    edir = [d for d in (tmp_path / "c").iterdir() if d.is_dir()]
    data = [DistillData.load(d, layers=(-1,)) for d in edir]
    data = [d for d in data if len(d) == 6][0]
    head = load_mtp(tmp_path / "out", target, None, 0).float()
    score = evaluate(trainer, head, data, list(range(6)), target, args, "cpu")
    assert score.accuracy() == ev and score.acceptance_length() == report["eval_expected_acceptance_length"]
    # and the figure `bench offline` measures: first-turn answers, their first 256 tokens
    first = report["eval_first_turns"]
    ids = [i for i, k in enumerate(data.kind.tolist()) if k == 0]
    assert first["sequences"] == len(ids) > 0 and first["answer_tokens"] == 256
    cut = evaluate(trainer, head, data, ids, target, args, "cpu", answer_tokens=256)
    assert cut.accuracy() == first["accuracy_per_position"]
    assert cfg["speculum"]["training"]["eval_first_turns"] == first


def test_batches_gather_padded_rows_with_masks():
    """DistillData.batch against a row-by-row reference: prompt cut, max_len cut, padding,
    the last token's missing state, answer mask; same result from data moved with .to()."""
    g = torch.Generator().manual_seed(0)
    lens, plens = [7, 3, 12, 5], [4, 2, 3, 5]
    offsets = torch.tensor([0] + lens).cumsum(0)
    N = int(offsets[-1])
    data = DistillData(tokens=torch.randint(1, 100, (N,), generator=g), offsets=offsets,
                       prompt_lens=torch.tensor(plens), prompt_index=torch.arange(4),
                       hidden={-1: torch.randn(N, 6, generator=g).bfloat16(), 2: torch.randn(N, 6, generator=g).bfloat16()})
    for ids, max_len, ctx, keep in (([0, 1, 2, 3], 100, 0, 0), ([2, 0], 8, 0, 0), ([3, 2, 1], 100, 1, 0),
                                    ([0, 1, 2, 3], 100, 0, 2), ([2, 1], 4, 1, 3)):
        b = data.batch(ids, max_len, "cpu", ctx, answer_tokens=keep)
        rows = []
        for i in ids:
            s, e, P = int(offsets[i]), int(offsets[i + 1]), plens[i]
            if keep:  # only the answer's first `keep` tokens
                e = min(e, s + P + keep)
            rows.append((max(s, e - max_len, s + P - ctx if ctx else s), e, s + P))
        T = max(e - s for s, e, _ in rows)
        assert b.tokens.shape == (len(ids), T)
        for r, (s, e, a) in enumerate(rows):
            n = e - s
            assert b.tokens[r, :n].tolist() == data.tokens[s:e].tolist() and not b.tokens[r, n:].any()
            assert b.valid[r].tolist() == [t < n - 1 for t in range(T)]
            assert b.answer_next[r].tolist() == [t < n - 1 and s + t + 1 >= a for t in range(T)]
            for l in (-1, 2):
                assert torch.equal(b.hidden[l][r, :n], data.hidden[l][s:e].float()) and not b.hidden[l][r, n:].any()
        b2 = data.to("cpu").batch(ids, max_len, "cpu", ctx, answer_tokens=keep)
        assert torch.equal(b2.tokens, b.tokens) and torch.equal(b2.hidden[-1], b.hidden[-1])


@pytest.mark.parametrize("whole_vocab", [False, True], ids=["loss-vocab", "whole-vocab"])
@pytest.mark.parametrize("method", ["eagle", "medusa", "mtp", "draft"])
def test_every_method_trains_under_bf16_autocast(tiny_llama, prompts, tmp_path, method, whole_vocab):
    """--amp bf16 (what the GPU runs use): every method's loss runs under autocast; the
    report and validation (fp32) are written. With --loss-vocab 0 (how train_heads.sh trains
    eagle, mtp and the draft since the twenty-eighth session) the loss covers every target
    token, so no loss vocabulary is built or reported."""
    if method != "draft":
        pytest.importorskip(f"speculum_{method.rstrip('3')}")
    out = tmp_path / method
    assert train([method, "--model", str(tiny_llama), "--prompts", str(prompts), "--num-prompts", "12",
                  "--max-tokens", "12", "--device", "cpu", "--cache-dir", str(tmp_path / "c"), "--out", str(out),
                  "--steps", "3", "--batch-size", "4", "--eval-every", "0", "--amp", "bf16",
                  "--save-dtype", "float32", *(["--loss-vocab", "0"] if whole_vocab else [])]) == 0
    report = json.loads((out / "training.json").read_text())
    assert report["amp"] == "bf16" and report["steps"] == 3 and report["val_accuracy_per_position"]
    assert (report["loss_vocab_coverage"] is None) == whole_vocab


def test_generation_time_limit_and_cached_data_only(tiny_llama, prompts, tmp_path):
    """Out of generation time, only finished shards are returned; ``generate=False`` (what
    --cached-data-only trainers use after a --prepare-only run) returns the finished ones
    and never starts an engine."""
    s = spec(tiny_llama, prompts, 12)
    d, names = ensure_distill(s, tmp_path, device="cpu", shard_size=8, time_limit=1e-9)
    assert names == [] and not list(d.glob("*.safetensors"))
    assert ensure_distill(s, tmp_path, device="cpu", shard_size=8, generate=False)[1] == []
    full = ensure_distill(s, tmp_path, device="cpu", shard_size=8)[1]
    assert full == ["shard_00000.safetensors", "shard_00001.safetensors"]
    meta = (d / "meta.json").read_bytes()
    assert ensure_distill(s, tmp_path, device="cpu", shard_size=8, generate=False)[1] == full
    assert ensure_distill(s, tmp_path, device="cpu", shard_size=8)[1] == full
    # a cache hit writes nothing: trainers started together read meta.json at the same time
    assert (d / "meta.json").read_bytes() == meta and not list(d.glob(".*.tmp"))


@pytest.mark.parametrize("method", ["mtp", "draft"])
def test_validation_acceptance_length_is_what_the_engine_measures(tmp_path, method):
    """The expected acceptance length validation reports (a replay of greedy chain drafting
    over the target's greedy answers) matches the engine's mean acceptance length on the
    same prompts, greedy, fp32, k = 3: up to the odd argmax that the verify step's
    numerics flip (hidden states of a (k+1)-token forward, not the recorded 1-token ones)."""
    import argparse

    from speculum.backends.torch.heads import TargetParts
    from speculum.testing import tiny_model_dir, train_tiny
    from speculum.train.cli import common_arguments, trainers
    from speculum.train.loop import evaluate
    if method != "draft":
        pytest.importorskip(f"speculum_{method}")
    tiny_llama = tiny_model_dir(tmp_path / "target", "llama", seed=0, num_layers=4)  # heads learn it well enough
    head = train_tiny(method, tiny_llama, tmp_path / "tr", extra=("--save-dtype", "float32"))
    K, trainer = 3, trainers()[method].create()
    p = argparse.ArgumentParser()
    common_arguments(p)
    trainer.add_arguments(p)
    args = p.parse_args(["--num-positions", str(K)])
    evals = token_prompts_file(tmp_path / "eval.jsonl", n=16, seed=7)
    d, shards = ensure_distill(DistillSpec(model=str(tiny_llama), prompts=str(evals), num_prompts=16, max_tokens=24),
                               tmp_path / "c", device="cpu", progress=False)
    data = DistillData.load(d, shards=shards)
    parts = TargetParts.from_checkpoint(tiny_llama)
    if method == "mtp":
        from speculum_mtp.formats import load_mtp
        module = load_mtp(head, parts, None, 0)
    else:
        from transformers import AutoModelForCausalLM
        module = AutoModelForCausalLM.from_pretrained(str(head))
    score = evaluate(trainer, module.float(), data, list(range(len(data))), parts, args, "cpu")
    prompts = [{"prompt_token_ids": data.tokens[data.offsets[i]: data.offsets[i] + data.prompt_lens[i]].tolist()}
               for i in range(len(data))]
    llm = LLM(str(tiny_llama), {"model": str(head), "num_speculative_tokens": K}, device="cpu", dtype="float32",
              kv_cache_memory=32 << 20)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    assert [o.prompt_token_ids + o.token_ids for o in outs] == \
        [data.tokens[data.offsets[i]: data.offsets[i + 1]].tolist() for i in range(len(data))]
    m = llm.metrics
    assert score.tokens == m.num_emitted_tokens and abs(score.steps - m.num_steps) <= 0.02 * m.num_steps
    assert 1.1 < score.acceptance_length() and abs(score.acceptance_length() - m.mean_acceptance_length) < 0.03


def test_exported_answers_get_their_states_back_by_prefill(tiny_llama, prompts, tmp_path):
    """`python -m speculum.train.distill export`: the answers only (no states) travel; the
    cache they land in recomputes the states, the same as the original's, and generates
    nothing (the same shards are found finished)."""
    from safetensors import safe_open

    from speculum.train.distill import main as distill_main
    sp = spec(tiny_llama, prompts, 12)
    d, shards = ensure_distill(sp, tmp_path / "a", max_num_seqs=5, device="cpu", shard_size=8)
    assert distill_main(["export", str(d), str(tmp_path / "b")]) == 0
    copied = tmp_path / "b" / d.name
    modes = {p.name: p.stat().st_mode & 0o777 for c in (d, copied) for p in c.iterdir()}
    assert len(set(modes.values())) == 1, modes  # shards as meta.json: one mode
    with safe_open(str(copied / shards[0]), "pt") as f:
        assert not any(k.startswith("hidden.") for k in f.keys())
    assert sum(p.stat().st_size for p in copied.iterdir()) < sum(p.stat().st_size for p in d.iterdir()) / 2
    d2, shards2 = ensure_distill(sp, tmp_path / "b", max_num_seqs=5, device="cpu", shard_size=8, generate=False)
    assert d2 == copied and shards2 == shards
    a, b = DistillData.load(d, shards=shards), DistillData.load(d2, shards=shards2)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.offsets, b.offsets)
    for layer in (-1, 0):
        torch.testing.assert_close(b.hidden[layer].float(), a.hidden[layer].float(), atol=0.05, rtol=0.02)


def test_imported_answers_are_found_by_training_on_another_machine(tiny_llama, prompts, tmp_path):
    """`... distill import SRC --model M`: answers exported on one machine are keyed again
    for the target as named on this one (there the converted GGUF's folder had another
    name), so training finds them finished and generates nothing."""
    import shutil

    from speculum.train.distill import main as distill_main
    sp = spec(tiny_llama, prompts, 12)
    d, shards = ensure_distill(sp, tmp_path / "a", max_num_seqs=5, device="cpu", shard_size=8)
    assert distill_main(["export", str(d), str(tmp_path / "b")]) == 0
    there = shutil.copytree(tiny_llama, tmp_path / "elsewhere" / "tiny-llama-other-key")
    sp2 = attrs.evolve(sp, model=str(there))
    assert distill_main(["import", str(tmp_path / "b" / d.name), "--model", str(there),
                         "--cache-root", str(tmp_path / "c")]) == 0
    d2, shards2 = ensure_distill(sp2, tmp_path / "c", max_num_seqs=5, device="cpu", shard_size=8, generate=False)
    assert d2.name != d.name and shards2 == shards
    a, b = DistillData.load(d, shards=shards), DistillData.load(d2, shards=shards2)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.offsets, b.offsets)


def test_a_data_call_leaves_carried_answers_without_states(tiny_llama, prompts, tmp_path, capsys):
    """`--prepare-only --answers-only` (train_heads.sh DATA_ONLY=1): answers carried in without
    hidden states stay without them (the H200's data call spent 92 s of its 507 on states it
    threw away); the training run that follows computes them. --answers-only alone is refused."""
    from safetensors import safe_open

    from speculum.train.distill import main as distill_main
    sp = spec(tiny_llama, prompts, 12)
    d, shards = ensure_distill(sp, tmp_path / "a", max_num_seqs=5, device="cpu", shard_size=8)
    assert distill_main(["export", str(d), str(tmp_path / "b")]) == 0

    def has_states(folder):
        with safe_open(str(folder / shards[0]), "pt") as f:
            return any(k.startswith("hidden.") for k in f.keys())
    copied = tmp_path / "b" / d.name
    assert ensure_distill(sp, tmp_path / "b", device="cpu", shard_size=8, states=False)[1] == shards
    assert not has_states(copied)
    assert ensure_distill(sp, tmp_path / "b", device="cpu", shard_size=8)[1] == shards and has_states(copied)
    assert train(["eagle3", "--model", str(tiny_llama), "--prompts", str(prompts), "--num-prompts", "8",
                  "--device", "cpu", "--answers-only"]) == 2
    assert "use it with --prepare-only" in capsys.readouterr().err


def test_answers_recorded_for_more_layers_serve_a_run_that_records_fewer(tiny_llama, prompts, tmp_path, capsys):
    """`speculum train --record-for mtp`: the data holds the states of mtp's layers only (a 64 GB
    disk held no more of EAGLE-3's four a token); answers carried in from a cache keyed for
    more layers are found (not answered again), and get only the states this run records."""
    from safetensors import safe_open

    from speculum.train.distill import find_cache
    from speculum.train.distill import main as distill_main
    sp = spec(tiny_llama, prompts, 12)  # layers (-1, 0)
    d, shards = ensure_distill(sp, tmp_path / "a", max_num_seqs=5, device="cpu", shard_size=8)
    assert distill_main(["export", str(d), str(tmp_path / "b")]) == 0
    fewer = attrs.evolve(sp, layers=(-1,))
    assert find_cache(fewer, tmp_path / "b") == tmp_path / "b" / d.name  # keyed for other layers, found
    d2, shards2 = ensure_distill(fewer, tmp_path / "b", device="cpu", shard_size=8, generate=False)
    assert d2 == tmp_path / "b" / d.name and shards2 == shards
    with safe_open(str(d2 / shards[0]), "pt") as f:
        assert {k for k in f.keys() if k.startswith("hidden.")} == {"hidden.-1"}
    a, b = DistillData.load(d, shards=shards), DistillData.load(d2, layers=(-1,), shards=shards2)
    assert torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(b.hidden[-1].float(), a.hidden[-1].float(), atol=0.05, rtol=0.02)
    # a cache of its own wins; other data is not taken for it
    assert find_cache(attrs.evolve(fewer, max_tokens=23), tmp_path / "b").name != d.name
    assert train(["mtp", "--model", str(tiny_llama), "--prompts", str(prompts), "--num-prompts", "8",
                  "--device", "cpu", "--record-for", "mtp,nosuch"]) == 2
    assert "--record-for: no trainer for nosuch" in capsys.readouterr().err


def test_states_that_would_not_fit_the_disk_are_refused_before_any_is_written(tiny_llama, prompts, tmp_path,
                                                                               monkeypatch):
    """Answers carried in without states: when the disk has less room than their states
    need (the first shard's bytes a token times every shard's tokens), the prefill stops with
    a clear error before writing one, and the answers stay as they were (2026-12-07: a full
    disk failed the call and lost the answers it had made)."""
    import shutil
    from collections import namedtuple

    from speculum.train.distill import main as distill_main
    sp = spec(tiny_llama, prompts, 12)
    d, shards = ensure_distill(sp, tmp_path / "a", max_num_seqs=5, device="cpu", shard_size=8)
    states = sum(p.stat().st_size for p in d.iterdir())
    assert distill_main(["export", str(d), str(tmp_path / "b")]) == 0
    copied = tmp_path / "b" / d.name
    before = {p.name: p.read_bytes() for p in copied.iterdir()}
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 ** 12, 10 ** 12 - states // 4, states // 4))
    with pytest.raises(ConfigError, match=r"need .* GB.*--record-for"):
        ensure_distill(sp, tmp_path / "b", device="cpu", shard_size=8)
    assert {p.name: p.read_bytes() for p in copied.iterdir()} == before
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 ** 12, 0, 2 * states))
    assert ensure_distill(sp, tmp_path / "b", device="cpu", shard_size=8)[1] == shards


def test_a_disk_that_fills_during_generation_keeps_every_answer(tiny_llama, prompts, tmp_path, monkeypatch):
    """The disk fills while generation writes its shards: the shard being written and those
    after it are kept without their hidden states, every answer is in the cache (exportable)
    and the call ends with check_disk's clear error instead of "No space left on device";
    with room again, the same call fills the states by prefill and returns every shard, the
    answers those of a run that never ran short. The wrong variant (before: the OSError
    propagated) loses the shard being written and every one after it: the meta check fails."""
    import errno
    import shutil
    from collections import namedtuple

    import speculum.train.distill as distill
    from speculum.train.distill import find_cache
    sp = spec(tiny_llama, prompts, 24)
    ref, ref_shards = ensure_distill(sp, tmp_path / "ref", max_num_seqs=5, device="cpu", shard_size=8)
    assert len(ref_shards) == 3
    save, written = distill._save_tensors, []

    def full_after_one(path, data):  # the first shard's states fit, then the disk is full
        if any(k.startswith("hidden.") for k in data) and written:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(path.name)
        save(path, data)

    monkeypatch.setattr(distill, "_save_tensors", full_after_one)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 ** 12, 10 ** 12 - 1000, 1000))
    with pytest.raises(ConfigError, match=r"need .* GB.*--record-for"):
        ensure_distill(sp, tmp_path / "a", max_num_seqs=5, device="cpu", shard_size=8)
    d = find_cache(sp, tmp_path / "a")
    meta = json.loads((d / "meta.json").read_text())
    assert sorted(meta["shards"]) == ref_shards  # no answer lost
    assert not list(d.glob(".*.tmp"))  # no part left behind on the full disk
    monkeypatch.undo()  # room again, and the real writer
    d2, shards = ensure_distill(sp, tmp_path / "a", max_num_seqs=5, device="cpu", shard_size=8)
    a, b = DistillData.load(ref, shards=ref_shards), DistillData.load(d2, shards=shards)
    assert shards == ref_shards and torch.equal(a.tokens, b.tokens)
    for layer in a.hidden:
        torch.testing.assert_close(b.hidden[layer].float(), a.hidden[layer].float(), atol=0.05, rtol=0.02)


def test_imported_answers_keep_their_key_when_a_data_file_lies_elsewhere(tiny_llama, prompts, tmp_path):
    """A data call writes the target's own requests to /tmp/tr/... and answers them; the
    training call imports the answers before that file exists there and names the same
    requests by another path. The import keys them by the name and size recorded where they
    were made, so training finds them. Before (H200, 2026-12-04) the missing file entered the
    key by its path, the training call saw no answer to those rows, and trained on the rest
    (the wrong variant: no recorded ids, the shards are not found)."""
    from speculum.train.distill import main as distill_main
    (tmp_path / "made").mkdir()
    mine = token_prompts_file(tmp_path / "made" / "self_prompts.jsonl", n=6, seed=7)
    sp = attrs.evolve(spec(tiny_llama, prompts, 0), data=(str(mine),))
    d, shards = ensure_distill(sp, tmp_path / "a", max_num_seqs=5, device="cpu", shard_size=8)
    assert json.loads((d / "meta.json").read_text())["files"][str(mine)] == ["self_prompts.jsonl", mine.stat().st_size]
    assert distill_main(["export", str(d), str(tmp_path / "b")]) == 0
    elsewhere = tmp_path / "kept" / "self_prompts.jsonl"
    elsewhere.parent.mkdir()
    mine.rename(elsewhere)  # gone from where it was made; the same file under another path
    assert distill_main(["import", str(tmp_path / "b" / d.name), "--model", str(tiny_llama),
                         "--cache-root", str(tmp_path / "c")]) == 0
    sp2 = attrs.evolve(sp, data=(str(elsewhere),))
    d2, shards2 = ensure_distill(sp2, tmp_path / "c", max_num_seqs=5, device="cpu", shard_size=8, generate=False)
    assert shards2 == shards and len(DistillData.load(d2, shards=shards2)) == 6
    # a folder a failed run left without meta.json: export skips it (train_heads.sh exports every folder)
    (tmp_path / "a" / "empty").mkdir()
    assert distill_main(["export", str(tmp_path / "a" / "empty"), str(tmp_path / "b")]) == 0


def test_lineage_skips_a_continuation_that_kept_its_start(tmp_path):
    """A head continued with --keep-best that exported step 0 has its parent's weights: a head
    grown from it records the parent's history, not a run that changed nothing (2026-12-04:
    a continuation on the training prompts alone kept step 0; the head shipped grew from it)."""
    from speculum.train.loop import lineage

    def head(name, training):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"speculum": {"training": training}}))
        return d
    first = {"command": "train a", "steps": 10}
    kept0 = head("kept0", {"command": "train b", "steps": 5, "kept": {"step": 0}, "grown_from": [first]})
    moved = head("moved", {"command": "train c", "steps": 5, "kept": {"step": 4}, "grown_from": [first]})
    assert lineage(kept0) == [first]
    assert lineage(moved) == [{"command": "train c", "steps": 5}, first]
    assert lineage(head("scratch", {"command": "train d", "kept": {"step": 0}})) == [{"command": "train d"}]
    assert lineage(None) == [] and lineage(tmp_path / "missing") == []


def test_init_from_is_refused_where_a_method_cannot_load_its_checkpoints():
    """A trainer without a checkpoint loader (a plugin's, say) refuses --init-from with what to do."""
    from speculum.train.base import Trainer
    with pytest.raises(ConfigError, match=r"cannot start from a checkpoint \(--init-from\)"):
        Trainer().load("x", None, None)


def test_a_draft_saved_without_the_targets_embedding_loads_continues_and_is_lossless(tiny_llama, prompts, tmp_path,
                                                                                     monkeypatch, capsys):
    """`--embeddings-from-target`: the checkpoint leaves out the frozen embedding (the target's);
    the draft_model proposer and --init-from put it back from the target (once, into the cache),
    and the draft then drafts exactly as the same draft saved whole. A target that is another
    model is refused with what to do."""
    from safetensors.torch import load_file

    from speculum.model_source import complete_draft
    monkeypatch.setenv("SPECULUM_CACHE", str(tmp_path / "cache"))
    common = ["--model", str(tiny_llama), "--prompts", str(prompts), "--num-prompts", "16", "--max-tokens", "16",
              "--device", "cpu", "--cache-dir", str(tmp_path / "c"), "--steps", "8", "--batch-size", "4",
              "--num-layers", "1", "--eval-every", "0", "--save-dtype", "float32"]
    whole, slim = tmp_path / "whole", tmp_path / "slim"
    assert train(["draft", *common, "--out", str(whole)]) == 0
    assert train(["draft", *common, "--out", str(slim), "--embeddings-from-target"]) == 0
    w, sl = load_file(str(whole / "model.safetensors")), load_file(str(slim / "model.safetensors"))
    assert "model.embed_tokens.weight" in w and "model.embed_tokens.weight" not in sl
    assert sorted(sl) == sorted(k for k in w if k not in ("model.embed_tokens.weight", "lm_head.weight"))
    assert all(torch.equal(sl[k], w[k]) for k in sl)  # the same training, seeded
    full = complete_draft(slim, tiny_llama)
    completed = load_file(str(full / "model.safetensors"))
    assert full != slim and sorted(completed) == sorted(w) and all(torch.equal(completed[k], w[k]) for k in w)
    assert complete_draft(whole, tiny_llama) == whole  # a whole checkpoint as it is
    p = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [30, 31, 30, 31, 30]}]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    base = make_llm(tiny_llama).generate(p, greedy)
    runs = {}
    for name, d in (("whole", whole), ("slim", slim)):
        llm = make_llm(tiny_llama, {"method": "draft_model", "model": str(d), "num_speculative_tokens": 3})
        runs[name] = ([o.token_ids for o in llm.generate(p, greedy)], llm.metrics.num_accepted_tokens)
    assert runs["slim"] == runs["whole"] and runs["slim"][0] == [b.token_ids for b in base]
    # continued from the slim checkpoint (--init-from): its weights are the start
    assert train(["draft", *common, "--steps", "1", "--lr", "0", "--out", str(tmp_path / "more"),
                  "--init-from", str(slim), "--embeddings-from-target"]) == 0
    more = load_file(str(tmp_path / "more" / "model.safetensors"))
    assert all(torch.equal(more[k], sl[k]) for k in sl)
    # another target: refused
    other = tmp_path / "other"
    other.mkdir()
    for f in tiny_llama.iterdir():
        if f.suffix != ".safetensors":
            (other / f.name).write_bytes(f.read_bytes())
    st = load_file(str(tiny_llama / "model.safetensors"))
    st["model.embed_tokens.weight"] = st["model.embed_tokens.weight"] * 2
    from safetensors.torch import save_file
    save_file(st, str(other / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="is another model"):
        complete_draft(slim, other)


def _prompt_data(parts: list[list[tuple[int, list[int]]]]) -> DistillData:
    """DistillData of hand-made sequences: ``parts[p]`` lists (row, prompt tokens) of one
    cache directory; each sequence gets a two-token answer."""
    seqs = [(p, row, prompt) for p, rows in enumerate(parts) for row, prompt in rows]
    flat = [t for _, _, prompt in seqs for t in prompt + [1, 2]]
    offsets = torch.tensor([0] + [len(prompt) + 2 for _, _, prompt in seqs]).cumsum(0)
    return DistillData(tokens=torch.tensor(flat), offsets=offsets,
                       prompt_lens=torch.tensor([len(prompt) for _, _, prompt in seqs]),
                       prompt_index=torch.tensor([row for _, row, _ in seqs]), hidden={},
                       part=torch.tensor([p for p, _, _ in seqs]))


def _sides(data: DistillData, val_fraction: float, split=DistillData.split) -> dict[tuple, str]:
    """Each prompt's side under ``split``, keyed by its part and content."""
    train, val = split(data, val_fraction)
    out = {}
    for side, ids in (("train", train), ("val", val)):
        for i in ids:
            s, P = int(data.offsets[i]), int(data.prompt_lens[i])
            out[(int(data.part[i]), tuple(data.tokens[s: s + P].tolist()))] = side
    return out


def test_split_keeps_every_prompt_on_its_side_when_the_data_grows():
    """A prompt's side depends on its content only: answering more rows of a file, or adding
    another file, moves no prompt between training and validation. Before (a shuffle of the
    prompts in the order the shards listed them), the thirty-eighth session's 1,592 newly
    answered rows moved most validation prompts to training: a continued head's validation
    held answers it had trained on and --keep-best exported step 0. The shuffle (written out
    below) moves prompts when the rows come in another order."""
    rng = random.Random(0)
    prompt = lambda: [rng.randrange(3, 50_000) for _ in range(rng.randrange(3, 9))]  # noqa: E731
    file_a = [(r, prompt()) for r in range(400)]
    file_b = [(r, prompt()) for r in range(300)]
    before = _sides(_prompt_data([file_b[:120], file_a]), 0.1)
    # more rows of file b answered; its shards list their rows in another order (by length)
    grown = _prompt_data([sorted(file_b, key=lambda r: (len(r[1]), r[0])), file_a])
    added = _prompt_data([file_b, file_a, [(r, prompt()) for r in range(200)]])  # another file
    for data in (grown, added):
        after = _sides(data, 0.1)
        assert all(after[k] == side for k, side in before.items())
        n_val = sum(side == "val" for side in after.values())
        assert 0.05 * len(after) < n_val < 0.15 * len(after)  # about val_fraction of the prompts

    def shuffled(data, val_fraction, seed=0):  # the split before 2026-12-06
        groups = {}
        for i, row in enumerate(data.prompt_index.tolist()):
            groups.setdefault(row, []).append(i)
        keys = list(groups)
        random.Random(seed + 1).shuffle(keys)
        n_val = round(len(keys) * val_fraction)
        return [i for k in keys[n_val:] for i in groups[k]], [i for k in keys[:n_val] for i in groups[k]]

    first = _sides(_prompt_data([file_b[:120], file_a]), 0.1, shuffled)
    after = _sides(grown, 0.1, shuffled)
    assert sum(after[k] != side for k, side in first.items()) > 20


def test_split_groups_a_prompts_answers_and_separates_files():
    """The answers of one row (greedy, sampled, long-form and second-turn prompts that extend
    it) stay on one side, decided by the row's shortest prompt; the same row number in two
    files is two prompts; the same request in two files lands on one side; at least one
    prompt on each side; the seed moves the split."""
    rng = random.Random(1)
    rows = [[rng.randrange(3, 50_000) for _ in range(5)] for _ in range(200)]
    # file 0: each row's plain prompt, a sampled answer to it, and a longer (second-turn) prompt
    file0 = [(r, p) for r, p in enumerate(rows)] + [(r, p) for r, p in enumerate(rows)] + \
            [(r, p + [7, 8, 9]) for r, p in enumerate(rows)]
    # file 1: other requests at the same row numbers, then file 0's first 50 requests again
    others = [[rng.randrange(3, 50_000) for _ in range(6)] for _ in range(200)]
    file1 = [(r, p) for r, p in enumerate(others)] + [(200 + r, rows[r]) for r in range(50)]
    data = _prompt_data([file0, file1])
    train, val = data.split(0.2, seed=0)
    assert sorted(train + val) == list(range(len(data))) and train and val
    side = {i: "val" for i in val} | {i: "train" for i in train}
    n0 = len(rows)
    for r in range(n0):  # the three sequences of row r of file 0
        assert side[r] == side[n0 + r] == side[2 * n0 + r]
    f1 = 3 * n0
    assert any(side[r] != side[f1 + r] for r in range(n0))  # row r of file 1 is another prompt
    for r in range(50):  # the same request in both files
        assert side[r] == side[f1 + n0 + r]
    assert data.split(0.2, seed=1) != (train, val)
    tiny = _prompt_data([[(0, [5, 6]), (1, [7, 8])]])
    for frac in (1e-9, 0.999999):
        t, v = tiny.split(frac)
        assert len(t) == 1 and len(v) == 1
    assert tiny.split(0.0) == ([0, 1], [])


def test_continuing_a_head_of_another_split_warns(tmp_path, caplog):
    """A head whose training report names no split (every head trained before 2026-12-06)
    or another one, or whose lineage (``grown_from``) holds such a run, gets a warning that
    validation flatters it (and what --keep-best does about it); a head of this split
    throughout, or a folder without a report, gets none."""
    from speculum.train.data import VAL_SPLIT
    from speculum.train.loop import warn_if_other_split
    cases = {"old": {"speculum": {"training": {"data": {"prompts": "p.jsonl"}}}},
             "other": {"speculum": {"training": {"data": {"val_split": "shuffled"}}}},
             "same": {"speculum": {"training": {"data": {"val_split": VAL_SPLIT}}}},
             "grown": {"speculum": {"training": {"data": {"val_split": VAL_SPLIT},
                                                 "grown_from": [{"command": "train b", "val_split": VAL_SPLIT},
                                                                {"command": "train a"}]}}},
             "grown_here": {"speculum": {"training": {"data": {"val_split": VAL_SPLIT},
                                                      "grown_from": [{"command": "train a", "val_split": VAL_SPLIT}]}}},
             "untrained": {"hidden_size": 8}}
    for name, cfg in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "empty").mkdir()
    with caplog.at_level("WARNING", logger="speculum.train.loop"):
        assert warn_if_other_split(tmp_path / "old", keep_best=True)
        assert "--keep-best chooses among the steps after it" in caplog.text and VAL_SPLIT in caplog.text
        caplog.clear()
        assert warn_if_other_split(tmp_path / "other", keep_best=False)
        assert "flatters" in caplog.text and "--keep-best" not in caplog.text
        caplog.clear()
        assert warn_if_other_split(tmp_path / "grown", keep_best=True)  # its lineage holds an older split
        caplog.clear()
        for name in ("same", "grown_here", "untrained", "empty"):
            assert not warn_if_other_split(tmp_path / name, keep_best=True)
        assert not caplog.text


def test_keep_best_leaves_out_a_start_trained_on_another_split(tiny_llama, prompts, tmp_path):
    """--keep-best lets step 0 compete only when the head continued from was trained on this
    split (its report says so): otherwise its validation is flattered and the best later step
    is kept, even where step 0 scores highest."""
    from speculum.train.loop import BestWeights
    module = torch.nn.Linear(2, 2)
    for competes, kept in ((True, 0), (False, 5)):
        best = BestWeights(True, start_competes=competes)
        for step, score in ((0, 3.0), (5, 2.5), (10, 2.0)):
            best.offer(step, score, module)
        assert best.restore(module, 10) == {"step": kept, "val_acceptance_length": {0: 3.0, 5: 2.5}[kept]}
    common = ["mtp", "--model", str(tiny_llama), "--prompts", str(prompts), "--num-prompts", "24", "--max-tokens", "24",
              "--device", "cpu", "--cache-dir", str(tmp_path / "c"), "--batch-size", "4", "--eval-every", "3",
              "--num-positions", "2", "--warmup", "1", "--steps", "6"]
    assert train(common + ["--out", str(tmp_path / "a")]) == 0
    assert train(common + ["--out", str(tmp_path / "b"), "--init-from", str(tmp_path / "a"), "--keep-best"]) == 0
    assert json.loads((tmp_path / "b" / "training.json").read_text())["kept"]["start_competed"] is True
    grown_from = json.loads((tmp_path / "b" / "config.json").read_text())["speculum"]["training"]["grown_from"]
    assert grown_from[0]["val_split"] == "prompt-hash"  # the lineage records each run's split
    cfg_path = tmp_path / "a" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["speculum"]["training"]["data"]["val_split"]  # as every head trained before 2026-12-06
    cfg_path.write_text(json.dumps(cfg))
    assert train(common + ["--out", str(tmp_path / "d"), "--init-from", str(tmp_path / "a"), "--keep-best"]) == 0
    report = json.loads((tmp_path / "d" / "training.json").read_text())
    assert report["kept"]["start_competed"] is False and report["kept"]["step"] > 0
    assert report["history"][0]["step"] == 0  # step 0 is still validated, for the curve
