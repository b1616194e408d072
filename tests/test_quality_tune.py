"""``speculum verify-quality`` catches a broken verifier; ``speculum tune`` predicts and checks.

Broken verifiers are registered in-process as plugins that claim to be lossless:
``accept_all`` accepts every draft (greedy outputs change: a real mismatch, not a tie)
and ``residual_p`` resamples from ``p`` instead of ``max(0, p - q)`` after a rejection
(the classic mistake: greedy rows stay exact, only the sampled two-sample test sees
it). Both must make the run fail (exit code 1); the shipped rejection sampler passes.
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

import speculum
from speculum import LLM
from speculum.interfaces import Verdict
from speculum.logprobs import Logprob
from speculum.quality import explain, first_divergence, run_quality, two_sample_pvalue
from speculum.sampling import processed_probs
from speculum.tune import Level, Run, TuneReport, guide_rows, predict, tune
from speculum.verifiers import rejection_sample

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [{"prompt_token_ids": p} for p in ([17, 4, 30, 9, 17, 4, 30, 9], [384, 466, 262, 475, 384, 466],
                                             [5, 6, 7, 8, 5, 6, 7], [100, 200, 300, 100, 200, 300])]


class AcceptAll:
    """Broken: every draft accepted, then the target's choice."""

    lossless = True

    def verify(self, logits, draft, sampling):
        B, k1, _ = logits.shape
        ids = draft.token_ids.to(logits.device)
        n = (ids >= 0).to(torch.int64).cumprod(1).sum(1)
        last = logits.argmax(-1).gather(1, n.view(B, 1))
        pos = torch.arange(k1, device=logits.device).view(1, k1)
        padded = torch.cat([ids, ids.new_full((B, 1), -1)], 1)
        tokens = torch.where(pos < n.view(B, 1), padded, torch.where(pos == n.view(B, 1), last, -1))
        return Verdict(tokens, n)


class ResidualP:
    """Broken: after a rejection, the token comes from p, not from max(0, p - q)."""

    lossless = True

    def verify(self, logits, draft, sampling):
        p = processed_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        return rejection_sample(p, draft.probs, draft.token_ids, sampling.generators, residual="p")


class Broken:
    @speculum.hookimpl
    def speculum_register_verifiers(self, register):
        register("accept_all", AcceptAll, lossless=True, description="test: broken")
        register("residual_p", ResidualP, lossless=True, description="test: broken")


def engines(tiny_llama, verifier: str):
    spec = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3,
            "options": {"num_layers": 1}, "acceptance_method": verifier}
    kw = dict(device="cpu", dtype="float32", max_num_seqs=64, plugins=[Broken()])
    return LLM(str(tiny_llama), None, **kw), LLM(str(tiny_llama), spec, **kw)


def test_a_verifier_that_accepts_everything_is_caught(tiny_llama):
    base, spec = engines(tiny_llama, "accept_all")
    report = run_quality(base, spec, PROMPTS, max_tokens=24)
    assert report.lossless and report.failed
    assert report.num_identical < len(PROMPTS)
    assert any(d.cause == "mismatch" for d in report.divergences)


def test_a_wrong_residual_is_caught_by_the_sampled_test(tiny_llama):
    base, spec = engines(tiny_llama, "residual_p")
    report = run_quality(base, spec, PROMPTS[:2], max_tokens=8, samples=1500, positions=2, top_k=5)
    assert report.num_identical == 2  # greedy rows are verified exactly: only sampling shows it
    assert report.sampled_failed and report.failed


def test_the_rejection_sampler_passes(tiny_llama):
    base, spec = engines(tiny_llama, "rejection_sampler")
    report = run_quality(base, spec, PROMPTS[:2], max_tokens=24, samples=1500, positions=2, top_k=5)
    assert report.num_identical == 2 and not report.divergences
    assert not report.failed, report.min_pvalue


def test_the_command_exits_1_for_a_broken_verifier(tiny_llama, tmp_path, monkeypatch, capsys):
    (tmp_path / "broken_verifier_plugin.py").write_text(textwrap.dedent('''
        import speculum
        import torch
        from speculum.interfaces import Verdict

        class AcceptAll:
            lossless = True
            def verify(self, logits, draft, sampling):
                B, k1, _ = logits.shape
                ids = draft.token_ids.to(logits.device)
                n = (ids >= 0).to(torch.int64).cumprod(1).sum(1)
                last = logits.argmax(-1).gather(1, n.view(B, 1))
                pos = torch.arange(k1).view(1, k1)
                padded = torch.cat([ids, ids.new_full((B, 1), -1)], 1)
                return Verdict(torch.where(pos < n.view(B, 1), padded, torch.where(pos == n.view(B, 1), last, -1)), n)

        @speculum.hookimpl
        def speculum_register_verifiers(register):
            register("accept_all", AcceptAll, lossless=True)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p["prompt_token_ids"]}) + "\n" for p in PROMPTS))
    from speculum.cli import main
    argv = ["verify-quality", "--model", str(tiny_llama), "--dataset", str(data), "--num-prompts", "4",
            "--max-tokens", "16", "--device", "cpu", "--plugin", "broken_verifier_plugin",
            "--json", str(tmp_path / "q.json")]
    spec = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3,
            "options": {"num_layers": 1}}
    assert main(argv + ["--speculative-config", json.dumps({**spec, "acceptance_method": "accept_all"})]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert json.loads((tmp_path / "q.json").read_text())["failed"] is True
    assert main(argv + ["--speculative-config", json.dumps(spec)]) == 0
    assert "PASS" in capsys.readouterr().out
    # batch-invariant mode: identity is the check, no divergence is excused as a near-tie
    assert main(argv + ["--batch-invariant", "--speculative-config", json.dumps(spec)]) == 0
    q = json.loads((tmp_path / "q.json").read_text())
    assert q["batch_invariant"] is True and q["tie_margin"] < 0 and q["failed"] is False
    assert main(argv + ["--batch-invariant", "--speculative-config",
                        json.dumps({**spec, "acceptance_method": "accept_all"})]) == 1


class _FakeBase:
    """Answers the top-2 query of :func:`explain` with fixed log-probabilities."""

    def __init__(self, top):
        self.top = top

    def generate(self, prompt, params):
        class O:
            pass
        o = O()
        o.outputs = [O()]
        o.outputs[0].logprobs = [{t: Logprob(lp, r + 1) for r, (t, lp) in enumerate(self.top)}]
        return [o]


def test_a_divergence_is_a_near_tie_only_between_the_top_two_within_the_margin():
    tie = explain(_FakeBase([(7, -0.6931), (9, -0.6932)]), [1, 2], [7, 3], [9, 3], 0, 1e-3)
    assert tie.cause == "near-tie" and tie.margin == pytest.approx(1e-4)
    far = explain(_FakeBase([(7, -0.1), (9, -2.5)]), [1, 2], [7, 3], [9, 3], 0, 1e-3)
    assert far.cause == "mismatch"
    other = explain(_FakeBase([(7, -0.6931), (9, -0.6932)]), [1, 2], [7], [4], 0, 1e-3)
    assert other.cause == "mismatch"  # not one of the two tied tokens
    assert explain(_FakeBase([]), [1], [7], [], 0, 1e-3).cause == "length"
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None and first_divergence([1, 2], [1, 2, 3]) == 2


def test_two_sample_test_pools_rare_tokens():
    same = two_sample_pvalue([1] * 50 + [2] * 50, [1] * 48 + [2] * 52)[0]
    diff = two_sample_pvalue([1] * 80 + [2] * 20, [1] * 20 + [2] * 80)[0]
    assert same > 0.5 and diff < 1e-10
    assert two_sample_pvalue([1, 2, 3], [4, 5, 6]) == (1.0, 1)  # all pooled: nothing to compare


# -- tune -------------------------------------------------------------------------------------
def _run(method, k, batch, tokens, seconds, step_seconds, steps, draft=0.0, acc=(), row_steps=0):
    return Run(method, k, batch, tokens, seconds, step_seconds, steps, draft, None, list(acc),
               sum(acc) + 10, sum(acc), row_steps)


def test_prediction_reproduces_the_run_it_was_measured_from():
    cost = lambda B, q: 0.01 * (1 + 0.1 * (q - 1))  # noqa: E731
    base = _run("none", 0, 4, tokens=400, seconds=2.0, step_seconds=1.8, steps=100)
    assert predict(base, None, 0, cost) == pytest.approx(200.0)  # no speculation: measured
    # 400 tokens at k = 2 in 400 / (4 * 1.75) steps of 0.035 s, plus 0.3 s outside steps
    steps = 400 / (4 * 1.75)
    spec = _run("m", 2, 4, tokens=400, seconds=0.3 + steps * 0.035, step_seconds=steps * 0.035, steps=steps,
                draft=steps * 0.004, acc=[60, 15], row_steps=100)
    spec.widths = [3] * 40 + [1] * 17  # some steps drafted nothing
    assert spec.expected_tokens(2) == pytest.approx(1.75) and spec.expected_tokens(1) == pytest.approx(1.6)
    assert predict(base, spec, 2, cost) == pytest.approx(spec.tokens_per_s)  # its own k: the run itself
    # cut at k = 1: more steps (E 1.6), each verifying at most 2 tokens and drafting half as much
    verify2 = sum(cost(4, w) for w in spec.widths) / 57
    verify1 = sum(cost(4, min(w, 2)) for w in spec.widths) / 57
    other = 0.035 - verify2 - 0.004
    want = 400 / (0.3 + steps * 1.75 / 1.6 * (verify1 + 0.002 + other))
    assert predict(base, spec, 1, cost) == pytest.approx(want)


def test_guide_rows_name_the_figures_that_triggered_them():
    cost = lambda B, q: 0.01  # noqa: E731
    runs = [_run("none", 0, 1, 100, 1.0, 0.9, 100), _run("none", 0, 16, 1600, 2.0, 1.9, 100),
            _run("m", 2, 1, 100, 1.2, 1.0, 60, acc=[5, 1], row_steps=60),
            _run("m", 2, 16, 1600, 3.0, 2.9, 70, acc=[5, 1], row_steps=1000)]
    runs[0].ttft, runs[2].ttft = 0.010, 0.020
    lv1, lv16 = Level(1), Level(16)
    lv1.predicted = {("none", 0): 100.0, ("m", 1): 120.0, ("m", 2): 110.0}
    lv16.predicted = {("none", 0): 800.0, ("m", 1): 700.0, ("m", 2): 600.0}
    report = TuneReport(2, [lv1, lv16], runs, {"m": {"method": "m"}}, cost)
    rows = guide_rows(report)
    kinds = [r[0] for r in rows]
    assert "Acceptance rate < 0.6" in kinds and "TTFT regression" in kinds and "Throughput worse at high load" in kinds
    assert report.suggested_config()["num_speculative_tokens_per_batch_size"] == {"1-1": 1, "2-4096": 0}


def test_tune_measures_every_candidate_on_the_tiny_model(tiny_llama):
    from speculum.sampling import SamplingParams
    methods = {"ngram": {"method": "ngram", "prompt_lookup_min": 1},
               "draft_model": {"method": "draft_model", "model": str(tiny_llama), "options": {"num_layers": 1}}}
    report = tune(lambda cfg: LLM(str(tiny_llama), cfg, device="cpu", dtype="float32", max_num_seqs=4),
                  methods, PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), [1, 4], 2,
                  check=True, context=16)
    for lv in report.levels:
        assert set(lv.predicted) == set(lv.measured) == {("none", 0)} | {(m, k) for m in methods for k in (1, 2)}
        assert lv.accuracy is not None and 0 < lv.accuracy <= 1
    d = report.as_dict()
    assert d["levels"][0]["recommended"] and json.dumps(d)
    from speculum.tune import format_report
    assert "tuning guide rows" in format_report(report)


@pytest.mark.skipif(sys.platform != "linux", reason="timings")
def test_cli_tune_help_lists_the_check():
    from speculum.cli import build_parser
    text = build_parser()._subparsers._group_actions[0].choices["tune"].format_help()
    assert "--check" in text and "--batch-sizes" in text
