"""What a new user meets first: the data ships with the package, threads that never
oversubscribe, errors that name the API the user called, typed plugin options, and the
output objects vLLM users expect (issue 8)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

import speculum
from speculum import LLM, SamplingParams, hookimpl
from speculum import threads as th
from speculum.datasets import MT_BENCH, TRAIN_PROMPTS, data_path, mt_bench, train_prompts_path
from speculum.errors import ConfigError, ModelLoadError
from speculum.testing import spinning_process, train_tiny

REPO = Path(__file__).resolve().parents[1]
#: the import package as setuptools lays it out (pyproject's package-dir)
LAYOUT = {"speculum": "core", "speculum/proposers": "proposers", "speculum/verifiers": "verifiers",
          "speculum/backends": "backends"}


# ------------------------------------------------------------------------- shipped data
def test_data_ships_inside_the_package():
    rows = mt_bench()
    assert len(rows) == 80 and len({r["category"] for r in rows}) == 8
    assert data_path(MT_BENCH).parent == Path(speculum.__file__).parent / "data"
    assert sum(1 for _ in train_prompts_path().open()) == 4728
    assert (data_path(MT_BENCH).parent / "README.md").read_text().count("Apache-2.0") >= 2
    mt = {r["turns"][0] for r in rows}
    import json
    assert not mt & {json.loads(l)["prompt"] for l in data_path(TRAIN_PROMPTS).open()}, "MT-bench in training data"


def test_other_task_types_ship_for_evaluation_and_stay_out_of_training():
    """other_tasks.jsonl: 8 prompts for each of five task types MT-bench lacks, in MT-bench's
    layout; none of them is close to a training prompt (the overlap check training applies to
    evaluation sets finds none) nor to an MT-bench question."""
    from speculum.datasets import eval_set_path
    from speculum.train.mix import drop_overlaps, eval_texts, read_rows
    from collections import Counter
    rows = mt_bench(path=eval_set_path("other_tasks"))
    assert Counter(r["category"] for r in rows) == {"translation": 8, "summarization": 8, "qa": 8, "math_reasoning": 8, "rag": 8}
    assert len({r["question_id"] for r in rows}) == 40 and mt_bench(path="other_tasks") == rows  # by name too
    texts = eval_texts([eval_set_path("other_tasks")])
    kept, dropped = drop_overlaps(read_rows(str(train_prompts_path())), texts)
    assert dropped == 0 and len(kept) == 4728
    _, dropped = drop_overlaps(read_rows(eval_set_path("mt_bench")), texts)
    assert dropped == 0
    assert drop_overlaps(read_rows(eval_set_path("other_tasks")), texts)[1] == 40  # the check does see them


def _package_copy(dest: Path) -> Path:
    """A copy of the import package laid out as installed, with no shared/ anywhere above."""
    for pkg, src in LAYOUT.items():
        shutil.copytree(REPO / src, dest / pkg, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return dest


@pytest.mark.real_model
def test_main_command_runs_from_a_copy_without_shared(tmp_path):
    """The README's main command's code path, from a copy of the package in a folder with
    no shared/ above it and no SPECULUM_SHARED: the MT-bench prompts come from the package."""
    root = tmp_path / "empty" / "clone"
    pkg = _package_copy(root / "site")
    assert not any((p / "shared").exists() for p in [root, *root.parents])
    env = {k: v for k, v in os.environ.items() if k != "SPECULUM_SHARED"}
    env["PYTHONPATH"] = str(pkg)
    code = ("import speculum, sys; assert speculum.__file__.startswith(sys.argv[1]), speculum.__file__; "
            "from speculum.cli import main; sys.exit(main(['generate', '--compare', '--num-prompts', '2', "
            "'--max-tokens', '6', '--show', '1', '--json', 'out/compare.json', '--speculative-config', "
            "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3}']))")
    r = subprocess.run([sys.executable, "-c", code, str(pkg)], cwd=root, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "writing" in r.stdout and "roleplay" in r.stdout  # one question from each of two categories
    assert "identical: 2/2" in r.stdout, r.stdout
    report = json.loads((root / "out" / "compare.json").read_text())
    spec = report["results"][1]
    assert spec["config"]["method"] == "ngram" and spec["total"]["identical"] is True
    assert sum(spec["steps_per_k"]) > 0 and set(spec["categories"]) == {"writing", "roleplay"}
    assert spec["steps_run_ahead"] == spec["steps_dropped_ahead"] == 0  # a CPU engine does not overlap
    assert spec["drafted_from_verdict"] == spec["forwards_from_verdict"] == 0


# ------------------------------------------------------------------------------ threads
def test_thread_rule_leaves_busy_cores_alone(monkeypatch):
    monkeypatch.delenv("SPECULUM_THREADS", raising=False)
    monkeypatch.setattr(th, "usable_cpus", lambda: 2)
    monkeypatch.setattr(th, "busy_cpus", lambda: 0.05)
    assert th.choose_threads().threads == 2
    monkeypatch.setattr(th, "busy_cpus", lambda: 0.9)  # another process spins on one core
    assert th.choose_threads().threads == 1
    monkeypatch.setattr(th, "busy_cpus", lambda: 3.0)
    assert th.choose_threads().threads == 1
    monkeypatch.setattr(th, "busy_cpus", lambda: None)  # not measurable: all usable CPUs
    assert th.choose_threads().threads == 2
    assert th.choose_threads(3).threads == 3 and th.choose_threads(3).source == "asked"
    monkeypatch.setenv("SPECULUM_THREADS", "1")
    assert th.choose_threads().threads == 1


def test_busy_cpus_counts_other_processes_only(monkeypatch):
    """From two /proc/stat readings: busy jiffies of the machine minus this process's own."""
    machine = iter([(1000, 4000), (1000 + 300, 4000 + 400)])  # 300 of 400 jiffies busy, over 2 CPUs
    own = iter([50, 50 + 100])  # 100 of the busy ones were ours
    monkeypatch.setattr(th, "_cpu_jiffies", lambda: next(machine))
    monkeypatch.setattr(th, "_own_jiffies", lambda: next(own))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert th.busy_cpus(0) == pytest.approx((300 - 100) / 400 * 2)


def test_busy_cpus_sees_a_spinning_process():
    if not Path("/proc/stat").exists():
        pytest.skip("needs /proc/stat")
    quiet = th.busy_cpus(0.3)
    if quiet is None or quiet > (os.cpu_count() or 1) - 1.2:
        pytest.skip(f"the machine is busy ({quiet} cores): a spinning process cannot show")
    with spinning_process():
        loaded = th.busy_cpus(0.5)
    assert loaded is not None and loaded > quiet + 0.5, (quiet, loaded)


def test_llm_sets_and_reports_threads(tiny_llama):
    before = torch.get_num_threads()
    try:
        llm = LLM(str(tiny_llama), dtype="float32", device="cpu", threads=1)
        assert torch.get_num_threads() == 1 and llm.threads.threads == 1
        with pytest.raises(ConfigError, match="threads must be an integer >= 1"):
            LLM(str(tiny_llama), dtype="float32", device="cpu", threads=0)
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------------- errors
def test_python_json_error_names_the_argument_not_the_flag(tiny_llama):
    with pytest.raises(ConfigError) as exc:
        LLM(str(tiny_llama), '{"method": "ngram", num_speculative_tokens: 4}', dtype="float32", device="cpu")
    assert "speculative_config is not valid JSON" in str(exc.value) and "--" not in str(exc.value).split("(")[0]
    from speculum.config import SpeculativeConfig
    with pytest.raises(ConfigError, match="--speculative-config is not valid JSON"):
        SpeculativeConfig.from_cli("{nope")


@pytest.mark.parametrize("method, says", [
    ("draft_model", "train one with `speculum train draft"),
    ("eagle", "train one with `speculum train eagle"),
    ("eagle3", "leave 'model' unset to use the eagle3 head shipped for SmolLM2-135M-Instruct"),
    ("medusa", "train one with `speculum train medusa"),
    ("mtp", "train one with `speculum train mtp"),
])
def test_missing_draft_path_says_what_to_do_for_the_method(tiny_llama, method, says):
    with pytest.raises(ModelLoadError) as exc:
        LLM(str(tiny_llama), {"method": method, "num_speculative_tokens": 2, "model": "/nope/draft"},
            dtype="float32", device="cpu")
    msg = str(exc.value)
    assert says in msg and "/nope/draft" in msg, msg
    assert "leave it unset for the default" not in msg  # that is the target's advice


def test_folder_without_config_says_what_to_do(tmp_path, tiny_llama):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError) as exc:
        LLM(str(tmp_path), dtype="float32", device="cpu")
    assert "without config.json" in str(exc.value) and "save_pretrained" in str(exc.value)
    assert "weights.bin" in str(exc.value)


def test_a_gguf_copied_elsewhere_converts_to_the_same_folder(tmp_path):
    """The converted folder (and every cache keyed by it) follows the GGUF's content, not
    its path or modification time: the same file joined again on another machine maps to
    the same folder; another file of the same name and size does not."""
    import os

    from speculum.model_source import gguf_key
    body = os.urandom(3 << 20)
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(body)
    os.utime(b, (1, 1))
    assert gguf_key(a) == gguf_key(b)
    b.write_bytes(body[:-1] + bytes([body[-1] ^ 1]))
    assert gguf_key(a) != gguf_key(b)


# --------------------------------------------------------------------- typed plugin options
@attrs.frozen
class Options:
    repeat: int = 1


class RepeatLast:
    def __init__(self, ctx):
        self.opts = ctx.options

    def propose(self, batch):
        from speculum import Draft
        k = batch.num_speculative_tokens
        return Draft(token_ids=torch.tensor([[s.token_ids[-1]] * k for s in batch.seqs]))

    def observe(self, feedback):
        pass


class RepeatPlugin:
    @hookimpl
    def speculum_register_proposers(self, register):
        register("repeat_last", RepeatLast, backends=("torch",), options=Options)


def test_readme_plugin_options_are_checked_by_type(tiny_llama):
    with pytest.raises(ConfigError) as exc:
        LLM(str(tiny_llama), {"method": "repeat_last", "num_speculative_tokens": 3, "options": {"repeat": "x"}},
            dtype="float32", device="cpu", plugins=[RepeatPlugin()])
    assert "repeat" in str(exc.value) and "expected int" in str(exc.value) and "'x'" in str(exc.value)
    llm = LLM(str(tiny_llama), {"method": "repeat_last", "num_speculative_tokens": 3, "options": {"repeat": 2}},
              dtype="float32", device="cpu", plugins=[RepeatPlugin()])
    assert llm.proposer.opts == Options(repeat=2)


# ------------------------------------------------------------------------- vLLM parity
@pytest.mark.real_model
def test_output_objects_as_vllm_has_them():
    llm = LLM(dtype="float32", device="cpu", max_num_seqs=3)
    chat = [{"role": "user", "content": "Say hi."}]
    outs = llm.generate(["The capital of France is", chat, {"prompt_token_ids": [1, 504, 3458, 314]}],
                        SamplingParams(temperature=0, max_tokens=3))
    assert [o.outputs[0].index for o in outs] == [0, 0, 0]
    assert outs[0].prompt == "The capital of France is"
    tok = llm.get_tokenizer()
    assert outs[1].prompt == tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert outs[1].prompt_token_ids == list(tok.apply_chat_template(chat, add_generation_prompt=True,
                                                                     tokenize=True, return_dict=False))
    assert outs[2].prompt == tok.decode([1, 504, 3458, 314])
    names = {m.name: m for m in llm.get_metrics()}
    assert names["speculum:generation_tokens"].value == 9
    assert "speculum:spec_decode_draft_acceptance_rate" not in names  # nothing drafted: no rate
    assert names["speculum:spec_decode_num_drafts"].value == 0


def test_train_writes_every_file_with_one_mode(tmp_path, tiny_llama):
    out = train_tiny("draft", tiny_llama, tmp_path, steps=4, num_prompts=8, max_tokens=6,
                     extra=("--num-layers", "1"))
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir() if f.is_file()}
    assert "model.safetensors" in modes and len(set(modes.values())) == 1, modes


def test_each_engine_is_warmed_on_the_longest_prompt_for_the_tokens_asked():
    """`bench offline` warms every engine before timing it: the longest prompt, then the
    shortest, for --warmup-tokens (default --max-tokens), so what is built per context
    length is built before the clock runs, then the other prompts' prefills; 0 skips the
    warm-up."""
    import attrs as _attrs

    from speculum.bench import methods

    class Fake:
        speculative_config = None

        def __init__(self):
            self.calls = []

        def generate(self, prompts, params):
            self.calls.append((prompts, params.max_tokens))
    groups = {"a": ["short", "a much longer prompt"], "b": ["mid prompt"]}
    params = SamplingParams(temperature=0, max_tokens=64)
    llm, _ = methods._start(lambda cfg: Fake(), None, groups, params, 256)
    # then the other prompts' prefills, one token each
    assert llm.calls == [(["a much longer prompt"], 64), (["short"], 64), (["mid prompt"], 1)]
    llm, _ = methods._start(lambda cfg: Fake(), None, groups, _attrs.evolve(params, max_tokens=300), 256)
    assert llm.calls == [(["a much longer prompt"], 256), (["short"], 256), (["mid prompt"], 1)]
    llm, _ = methods._start(lambda cfg: Fake(), None, groups, params, 0)
    assert llm.calls == []


def test_interleaved_comparison_runs_each_category_through_every_config_in_turn(tiny_llama):
    """The main command interleaves (a shared CPU's slow minute then hits every config);
    the figures are assembled per config exactly as one engine at a time would."""
    from speculum import LLM, SamplingParams
    from speculum.bench import methods

    groups = {"a": [{"prompt_token_ids": [5, 6, 7, 5, 6, 7]}], "b": [{"prompt_token_ids": [9, 8, 7, 9, 8]}]}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    order = []

    def make(cfg):
        llm = LLM(str(tiny_llama), cfg, device="cpu", dtype="float32")
        inner = llm.generate

        def generate(prompts, p):
            order.append((None if cfg is None else cfg["method"], prompts[0]["prompt_token_ids"][0]))
            return inner(prompts, p)
        llm.generate = generate
        return llm

    cfg = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    inter = methods.compare([cfg], groups, params, make, interleave=True)
    timed = order[2:]  # after the two warm-ups
    assert timed == [(None, 5), ("ngram", 5), (None, 9), ("ngram", 9)]
    seq = methods.compare([cfg], groups, params, make)
    for a, b in zip(inter, seq):
        assert a.name == b.name and a.total.outputs == b.total.outputs and a.total.tokens == b.total.tokens
        assert list(a.groups) == ["a", "b"]
    assert inter[1].identical(inter[0]) == (2, 2)


def test_a_differing_output_is_explained_by_the_engines_dtype():
    """`generate --compare`: fp32 on a CPU must be identical (a bug to report); in bf16 a
    difference is a near-tie (seen: --dtype bfloat16 on a CPU printed 'fp32 ... report')."""
    from speculum.cli import _why_different, must_be_identical
    assert "please report" in _why_different([("torch.float32", "cpu")] * 3)
    assert "batch-invariant mode must be identical" in _why_different([("torch.bfloat16", "cuda")], invariant=True)
    exact = [{"method": "eagle3", "acceptance_method": "exact_match"}]
    assert must_be_identical(0.0, False, [{"method": "ngram"}])
    assert must_be_identical(0.8, True, exact)  # seeded sampling in the mode: the same tokens
    assert not must_be_identical(0.8, False, exact) and not must_be_identical(0.8, True, [{"method": "eagle3"}])
    bf16 = _why_different([("torch.bfloat16", "cpu")] * 3)
    assert "please report" not in bf16 and "near-ties" in bf16 and "--dtype float32" in bf16


def test_the_main_command_compares_ngram_the_head_and_both(monkeypatch, capsys):
    """`generate --compare` with no config: n-gram, the shipped EAGLE-3 head and the two
    together (lookup where it matches, the head elsewhere), k = 2 on a CPU; a composite is
    skipped, saying which plugin is missing, when one of its parts is not installed."""
    import speculum.plugins as plugins
    from speculum.cli import _installed, default_compare
    cfgs = default_compare("cpu")
    assert [c["method"] for c in cfgs] == ["ngram", "eagle3", "ngram+eagle3"]
    assert all(c["num_speculative_tokens"] == 2 for c in cfgs)
    assert _installed(cfgs) == cfgs  # every plugin of the project is installed here

    class _Reg:
        methods = {"ngram": object()}
    monkeypatch.setattr(plugins, "build_registry", lambda: _Reg())
    assert [c["method"] for c in _installed(cfgs)] == ["ngram"]
    err = capsys.readouterr().err
    assert "skipping eagle3: the plugin of eagle3 is not installed" in err
    assert "skipping ngram+eagle3: the plugin of eagle3 is not installed" in err


def test_a_pooled_comparison_fills_the_batch_and_keeps_each_category(tiny_llama):
    """`bench offline --batch-size 16` used to send each category as its own generate call,
    so no more sequences ran together than a category had questions (5 or 10 on MT-bench).
    Pooled, every question goes in one call: the loop steps hold up to the batch size,
    each category keeps its own outputs and MAL (the same as category by category), and only
    the total is timed."""
    from speculum import LLM
    from speculum.bench import methods

    groups = {c: [{"prompt_token_ids": [5 + i, 6, 7, 5 + i, 6, 7]} for i in range(3)] for c in ("a", "b", "c")}
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    widest = []

    def make(cfg):
        llm = LLM(str(tiny_llama), cfg, device="cpu", dtype="float32", max_num_seqs=8)
        inner = llm.loop.step

        def step(seqs, *a, **kw):
            widest.append(len(seqs))
            return inner(seqs, *a, **kw)
        llm.loop.step = step
        return llm

    cfg = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    widest.clear()
    apart = methods.compare([cfg], groups, params, make, warmup_tokens=0)
    assert max(widest) == 3  # a category's 3 questions: a batch of 8 never filled
    widest.clear()
    pooled = methods.compare([cfg], groups, params, make, warmup_tokens=0, pooled=True)
    assert max(widest) == 8  # the 9 questions together: the batch is full
    for a, b in zip(apart, pooled):
        assert list(b.groups) == ["a", "b", "c"]
        for c in groups:
            assert b.groups[c].outputs == a.groups[c].outputs
            assert b.groups[c].metrics.as_dict() == a.groups[c].metrics.as_dict()
            assert b.groups[c].seconds is None and b.groups[c].tokens_per_s is None
        assert b.total.tokens == a.total.tokens == 90 and b.total.seconds > 0
    assert pooled[1].speedup(pooled[0]) > 0 and pooled[1].speedup(pooled[0], "a") is None
    lines = methods.table(pooled).splitlines()
    assert lines[2].split()[:2] == ["a", "-"] and lines[-1].split()[0] == "total"
    d = pooled[1].as_dict(pooled[0])
    assert d["categories"]["a"]["tokens_per_s"] is None and d["total"]["tokens_per_s"] > 0
    pooled[1].name = "eagle3(k=4,eagle3-smollm2-135m-instruct,draft_tail=False)"  # a long name, whole
    for r in pooled:  # and a long category name: the columns still line up
        r.groups = {("math_reasoning" if c == "a" else c): g for c, g in r.groups.items()}
    lines = methods.table(pooled).splitlines()
    assert pooled[1].name in lines[0]
    assert len({tuple(i for i, ch in enumerate(line) if ch == "|") for line in lines if "|" in line}) == 1
    with pytest.raises(ValueError, match="rounds > 1"):
        methods.compare([cfg], groups, params, make, pooled=True, rounds=3)


def test_pooled_runs_in_turns_report_each_configs_median_round(tiny_llama):
    """`bench offline --batch-size 16 --interleave`: every engine is loaded at once and runs the
    whole pooled batch in turn, ``rounds`` times (a run of a few seconds per config, one config
    after the other, carried 15-30% on the H200). Each config reports its median round: that
    round's seconds, the same outputs and MAL as a pooled run alone, and the counters of that
    round only (not of all three); every round's seconds are in the JSON."""
    from speculum import LLM
    from speculum.bench import methods

    groups = {c: [{"prompt_token_ids": [5 + i, 6, 7, 5 + i, 6, 7]} for i in range(3)] for c in ("a", "b")}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    order = []

    def make(cfg):
        llm = LLM(str(tiny_llama), cfg, device="cpu", dtype="float32", max_num_seqs=8)
        inner = llm.generate

        def generate(prompts, *a, **kw):
            order.append(cfg is None)
            return inner(prompts, *a, **kw)
        llm.generate = generate
        return llm

    cfg = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    alone = methods.compare([cfg], groups, params, make, warmup_tokens=0, pooled=True)
    order.clear()
    turns = methods.compare([cfg], groups, params, make, warmup_tokens=0, pooled=True, interleave=True, rounds=3)
    assert order == [True, False] * 3  # the baseline and the config in turn, three rounds
    for a, b in zip(alone, turns):
        rounds = b.extra["round_seconds"]
        assert len(rounds) == 3 and b.total.seconds == sorted(rounds)[1]
        assert b.total.outputs == a.total.outputs and b.total.tokens == a.total.tokens
        assert b.total.metrics.as_dict() == a.total.metrics.as_dict()
        assert b.steps_per_k == a.steps_per_k  # one round's steps, not three rounds'
    assert turns[1].as_dict(turns[0])["total"]["identical"] is True


def test_the_warm_up_fills_the_batch_with_the_longest_prompts(tiny_llama):
    """CUDA graphs are captured the first time a batch size and context bucket occur; a
    pooled batch-16 run of a few seconds warmed on one prompt timed those captures (configs
    that ran the very same plain steps differed 2.4x on the H200). The warm-up now answers
    as many of the longest prompts as the batch holds, then the shortest, untimed; pooled,
    it answers every prompt once, untimed (the longest prompts alone still left batch sizes
    and contexts for the timed run to capture: 1.0 to 1.8 s for the same plain steps). Then
    every other prompt's prefill, one token each."""
    from speculum import LLM
    from speculum.bench import methods

    groups = {"a": [{"prompt_token_ids": [5] * n} for n in (3, 9, 4)], "b": [{"prompt_token_ids": [6] * n} for n in (7, 2)]}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    calls = []

    def make(batch):
        def build(cfg):
            llm = LLM(str(tiny_llama), cfg, device="cpu", dtype="float32", max_num_seqs=batch)
            inner = llm.generate
            llm.generate = lambda prompts, *a, **kw: (calls.append([len(p["prompt_token_ids"]) for p in prompts]),
                                                      inner(prompts, *a, **kw))[1]
            return llm
        return build

    methods.compare([], groups, params, make(3), warmup_tokens=2)
    assert calls[:2] == [[9, 7, 4], [2]]  # the warm-up: the three longest (the batch's width), the shortest
    assert calls[2] == [3]  # then the others' prefills (one token each): no prefill shape is first met timed
    calls.clear()
    methods.compare([], groups, params, make(3), warmup_tokens=2, pooled=True)
    # pooled: the warm-up is every prompt at once (the batch walks down through each size), untimed
    assert len(calls) == 2 and sorted(calls[0]) == sorted(calls[1]) == [2, 3, 4, 7, 9]
    calls.clear()
    methods.compare([], groups, params, make(1), warmup_tokens=2)
    assert calls[:3] == [[9], [2], [7, 4, 3]]  # batch 1: the longest prompt, the shortest, the others' prefills
    calls.clear()
    methods.compare([], {"a": groups["a"][:1]}, params, make(1), warmup_tokens=2)
    assert calls == [[3], [3]]  # one prompt: warmed once, then timed


def test_bench_offline_samples_with_a_seed_per_prompt_the_same_in_every_config(tiny_llama):
    """``bench offline --temperature T`` measures speculative sampling: request ``i`` of a call
    gets seed ``seed + i`` in every config (so a rerun draws the same tokens, and the configs see
    the same prompts with the same seeds), the table shows no identity column ("n/a") and the
    JSON none (``identical`` None): sampled outputs follow the target's law, not its draws."""
    import argparse

    from speculum.bench import methods, offline

    def args(**kw):
        return argparse.Namespace(**{"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, "max_tokens": 8,
                                     **kw})
    assert offline._params(args()).temperature == 0
    sampled = offline._params(args(temperature=0.8, top_p=0.9, seed=7))
    assert (sampled.temperature, sampled.top_p, sampled.seed) == (0.8, 0.9, 7)
    assert [p.seed for p in methods.per_request(sampled, 3)] == [7, 8, 9]
    assert methods.per_request(offline._params(args()), 3).seed is None  # greedy: one params

    groups = {"a": [{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}, {"prompt_token_ids": [9, 10, 11]}]}
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)

    def make(cfg):
        return LLM(str(tiny_llama), cfg, device="cpu", dtype="float32", max_num_seqs=1)
    cfg = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    first = methods.compare([cfg], groups, params, make, warmup_tokens=2)
    again = methods.compare([], groups, params, make, warmup_tokens=2)
    assert first[0].total.outputs == again[0].total.outputs  # seeded: the baseline draws the same tokens again
    assert all(len(o) == 12 for o in first[1].total.outputs) and first[1].total.metrics.num_drafts > 0
    table = methods.table(first, greedy=False)
    assert "n/a" in table and "/2" not in table
    entry = first[1].as_dict(first[0], greedy=False)["total"]
    assert entry["identical"] is None and entry["num_identical"] is None and entry["speedup"] > 0
    assert first[1].as_dict(first[0])["total"]["identical"] in (True, False)  # greedy runs keep the check


def test_bench_runs_the_baseline_again_after_every_config_to_show_the_drift(tiny_llama):
    """``bench offline --baseline-again``: a fresh baseline engine runs once more after every
    config (one at a time and interleaved); its speedup over the first run is the run's drift.
    (On the H200 a batch-16 run measured configs that ran only plain steps at 1.24-1.37x the
    baseline: a ratio of the same work run twice says how far the others can be trusted.)"""
    from speculum.bench import methods

    groups = {"a": [{"prompt_token_ids": [5, 6, 7, 5, 6, 7]}], "b": [{"prompt_token_ids": [9, 10, 11]}]}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    made = []

    def make(cfg):
        made.append(cfg)
        return LLM(str(tiny_llama), cfg, device="cpu", dtype="float32", max_num_seqs=1)
    cfg = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    for interleave in (False, True):
        made.clear()
        events = []
        res = methods.compare([cfg], groups, params, make, warmup_tokens=2, interleave=interleave,
                              baseline_again=True, after=lambda llm, r: events.append(r.name),
                              measured=lambda rs: events.append(len(rs)))
        assert [r.name for r in res] == ["autoregressive", methods.method_name(cfg), methods.AGAIN]
        # interleaved, every timed figure is handed over before the first (slow) after-work: a run
        # cut short during the step profiles keeps them (one session lost a whole run that way)
        names = [r.name for r in res]
        assert events == ([3] + names if interleave else names)
        assert made == [None, cfg, None]  # a fresh engine for the repeat
        again = res[-1]
        assert again.config is None and again.total.outputs == res[0].total.outputs
        assert again.speedup(res[0]) > 0 and again.as_dict(res[0])["total"]["identical"] is True
        from speculum.bench.offline import drift_lines
        drift, against = drift_lines(res, again)
        assert f"{again.speedup(res[0]):.3f}x its first run" in drift
        assert against == f"against the repeated baseline: {res[1].name} {res[1].speedup(again):.2f}x"
    assert [r.name for r in methods.compare([cfg], groups, params, make, warmup_tokens=2)] == \
        ["autoregressive", methods.method_name(cfg)]  # off by default


def test_bench_offline_pools_above_batch_one_unless_told_not_to():
    """Batches above 1 pool the categories; --per-category-batches keeps the old way;
    --interleave pools too (the whole batch through every engine in turn, --rounds times)."""
    import argparse

    from speculum.bench import offline

    def args(**kw):
        return argparse.Namespace(**{"batch_size": 1, "interleave": False, "per_category_batches": False, **kw})
    assert not offline._pooled(args())
    assert offline._pooled(args(batch_size=16))
    assert not offline._pooled(args(batch_size=16, per_category_batches=True))
    assert not offline._pooled(args(interleave=True))
    assert offline._pooled(args(batch_size=16, interleave=True))
    groups = {"a": ["a1", "a2", "a3"], "b": ["b1"], "c": ["c1", "c2"]}
    assert offline._profile_prompts(groups, 1) == ["a1", "b1", "c1"]  # the first of each, as before
    assert offline._profile_prompts(groups, 5) == ["a1", "b1", "c1", "a2", "c2"]
    assert offline._profile_prompts(groups, 16) == ["a1", "b1", "c1", "a2", "c2", "a3"]


def test_rounds_are_for_pooled_runs_in_turns():
    """``--rounds``: 3 by default for a pooled ``--interleave`` run, 1 otherwise; a number of
    rounds where nothing runs in turns is a clear error, not ignored."""
    import argparse

    from speculum.bench.offline import _rounds

    def args(**kw):
        base = dict(batch_size=16, interleave=True, per_category_batches=False, rounds=None)
        return argparse.Namespace(**{**base, **kw})
    assert _rounds(args()) == 3 and _rounds(args(rounds=5)) == 5
    assert _rounds(args(batch_size=1)) == 1 and _rounds(args(interleave=False)) == 1
    for bad in (args(rounds=0), args(batch_size=1, rounds=3), args(interleave=False, rounds=2),
                args(per_category_batches=True, rounds=2)):
        with pytest.raises(SystemExit, match="--rounds"):
            _rounds(bad)


def test_jsonl_lines_end_at_newlines_only(tmp_path):
    """A JSON string may hold U+0085 or U+2028 raw (line 532 of the shipped training prompts
    does); str.splitlines() would cut such a row in two and call the file broken."""
    from speculum.datasets import TRAIN_PROMPTS, data_path, read_jsonl

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a\u0085b"}\r\n{"prompt": "c\u2028d"}\n\n', encoding="utf-8")
    assert [r["prompt"] for r in read_jsonl(f)] == ["a\u0085b", "c\u2028d"]
    assert len(read_jsonl(data_path(TRAIN_PROMPTS))) == 4728
