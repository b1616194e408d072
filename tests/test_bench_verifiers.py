"""``speculum bench verifiers``: its paired measure, its drift tests, and a real-model run.

The paired measure records, at every verify step, ``E[accepted | drafts]`` under both
lossless rules. Averaged over a run it estimates the run's realized acceptance: checked
here against the realized MAL of the verifier the run used (within 5 standard errors,
the standard error taken from the run's own acceptance histogram).
"""

from __future__ import annotations

import json
import math
import random

import pytest

from speculum import LLM, SamplingParams
from speculum.bench.verifiers import PairedShadow, drift

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _se(metrics) -> float:
    h = metrics.acceptance_histogram
    n = sum(h)
    mean = sum(a * c for a, c in enumerate(h)) / n
    var = sum(c * (a - mean) ** 2 for a, c in enumerate(h)) / n
    return math.sqrt(var / n)


@pytest.mark.parametrize("verifier, rule", [("rejection_sampler", "token_wise"), ("block", "block")])
def test_paired_expectation_matches_the_realized_acceptance(tiny_llama, verifier, rule):
    spec = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3,
            "options": {"num_layers": 1}, "acceptance_method": verifier}
    llm = LLM(str(tiny_llama), spec, device="cpu", dtype="float32", max_num_seqs=64, kv_cache_memory=64 << 20)
    shadow = PairedShadow(llm.loop.verifier)
    llm.loop.verifier = shadow
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(6)]} for _ in range(64)]
    params = [SamplingParams(temperature=1.0, top_k=5, max_tokens=40, seed=i, ignore_eos=True) for i in range(64)]
    llm.generate(prompts, params)
    m = llm.metrics
    paired = shadow.mal()
    assert shadow.steps == m.num_drafts > 500
    assert abs(paired[rule] - m.mean_acceptance_length) < 5 * _se(m), (paired, m.mean_acceptance_length)
    assert paired["block"] >= paired["token_wise"] - 0.01  # block is never worse in expectation
    assert paired["token_wise"] >= paired["one_hot"]  # min(1, p/q) >= p for every draft
    gain, se = shadow.gain()
    assert gain == pytest.approx(paired["block"] - paired["token_wise"], abs=1e-5) and 0 < se < 0.05


def test_drift_tests_see_a_shift_and_not_noise():
    rng = random.Random(1)
    ref = [[rng.gauss(-2.0, 1.0) for _ in range(40)] for _ in range(64)]
    same = [[rng.gauss(-2.0, 1.0) for _ in range(40)] for _ in range(64)]
    shifted = [[rng.gauss(-1.4, 1.0) for _ in range(40)] for _ in range(64)]
    d = drift(same, ref)
    assert d["positions_tested"] == 40 and d["positions_p_below_0.05"] <= 8 and d["sequence_mean_p"] > 1e-3
    assert d["paired_wilcoxon_p"] > 1e-3
    d = drift(shifted, ref)
    assert d["positions_p_below_0.05"] >= 20 and d["sequence_mean_p"] < 1e-6
    assert all(x > 0 for x in d["per_position_mean_diff"])
    assert d["paired_wilcoxon_p"] < 1e-6 and abs(d["paired_sequence_mean_diff"] - 0.6) < 4 * d["paired_sequence_mean_diff_se"]
    # pairing removes the spread between prompts: a prompt effect shared by both runs
    prompt = [rng.gauss(0, 3) for _ in range(64)]
    base = [[prompt[i] + rng.gauss(-2.0, 1.0) for _ in range(40)] for i in range(64)]
    up = [[prompt[i] + rng.gauss(-1.8, 1.0) for _ in range(40)] for i in range(64)]
    d = drift(up, base)
    assert d["sequence_mean_p"] > 0.05 and d["paired_wilcoxon_p"] < 1e-3


@pytest.mark.real_model
def test_bench_verifiers_runs_on_the_default_model(tmp_path, capsys):
    from speculum.cli import main
    out = tmp_path / "bv.json"
    rc = main(["bench", "verifiers", "--dtype", "float32", "--device", "cpu", "--categories", "writing",
               "--prompts-per-category", "1", "--samples", "2", "--max-tokens", "8", "--batch-size", "2",
               "--temperature", "1.0", "--verifier", "rejection_sampler,block", "--logprobs",
               "--method", '{"method":"draft_model","model":"@target","num_speculative_tokens":2,'
                           '"options":{"num_layers":2}}', "--json", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    rows = {r["verifier"]: r for r in rep["results"]}
    assert set(rows) == {"rejection_sampler", "block"}
    for r in rows.values():
        assert 0 < r["tokens"] <= 16 and r["mean_acceptance_length"] >= 1 and r["mean_target_logprob"] < 0
        assert r["paired_mal_block"] >= 1 and r["lossless"]
    assert "drift_vs_reference" in rows["block"] and "drift_vs_reference" not in rows["rejection_sampler"]
    assert "E-MAL blk" in capsys.readouterr().out
