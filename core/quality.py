"""``speculum verify-quality``: does speculation change the output? Checked on a prompt set.

Greedy: every prompt runs with and without speculation; the exact-match rate is the
share of identical outputs. For each output that differs, the first divergence is
explained from the target's own logits at that point (the common prefix): a *near-tie*
when the target's two likeliest tokens are within ``tie_margin`` of each other (in
log-probability) and speculation took the other one of the two (floating-point
summation order decides such ties: expected in bf16, rare in fp32), else a *mismatch*,
which a lossless verifier must never produce.

Sampled (``samples > 0``): every prompt is sampled ``samples`` times on each side
(seeds differ between sides) for ``positions`` tokens. Speculation is lossless when the
joint law of the output is the target's, so the law of the token at every position is
the same on both sides: each (prompt, position) gets a two-sample chi-square test of
homogeneity (tokens seen fewer than 5 times on both sides pooled), and the run fails
when the smallest p-value is below ``alpha / number of tests`` (Bonferroni: the
false-alarm rate of the whole run is at most ``alpha``). The mean target log-probability
per token of each side (the target's raw logprobs, which speculation leaves unchanged)
is reported with a Welch test: a verifier that pushes the output towards its draft
shows up there too.

The run fails (exit code 1) only when the verifier claims to be lossless.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import attrs

from speculum.sampling import SamplingParams


@attrs.define
class Divergence:
    """Where a speculative greedy output first differs from the plain one, and why."""

    index: int
    position: int
    baseline_token: int | None
    speculative_token: int | None
    #: log-probability gap between the target's two likeliest tokens there
    margin: float | None
    cause: str  # "near-tie", "mismatch", "length"

    def as_dict(self) -> dict:
        return attrs.asdict(self)


@attrs.define
class QualityReport:
    verifier: str
    lossless: bool
    num_prompts: int = 0
    num_identical: int = 0
    divergences: list[Divergence] = attrs.field(factory=list)
    #: sampled part: (prompt index, position, p-value, tokens compared)
    tests: list[tuple[int, int, float, int]] = attrs.field(factory=list)
    alpha: float = 1e-3
    mean_logprob: dict[str, float | None] = attrs.field(factory=dict)
    logprob_pvalue: float | None = None

    @property
    def exact_match_rate(self) -> float | None:
        return self.num_identical / self.num_prompts if self.num_prompts else None

    @property
    def mismatches(self) -> list[Divergence]:
        return [d for d in self.divergences if d.cause != "near-tie"]

    @property
    def min_pvalue(self) -> float | None:
        return min((t[2] for t in self.tests), default=None)

    @property
    def sampled_failed(self) -> bool:
        return bool(self.tests) and self.min_pvalue < self.alpha / len(self.tests)

    @property
    def failed(self) -> bool:
        """A lossless verifier changed the output beyond floating-point ties, or the law."""
        return self.lossless and (bool(self.mismatches) or self.sampled_failed)

    def as_dict(self) -> dict:
        return {"verifier": self.verifier, "lossless": self.lossless, "num_prompts": self.num_prompts,
                "num_identical": self.num_identical, "exact_match_rate": self.exact_match_rate,
                "divergences": [d.as_dict() for d in self.divergences],
                "near_ties": sum(d.cause == "near-tie" for d in self.divergences),
                "mismatches": len(self.mismatches),
                "sampled": {"tests": len(self.tests), "alpha": self.alpha, "min_pvalue": self.min_pvalue,
                            "bonferroni_threshold": self.alpha / len(self.tests) if self.tests else None,
                            "failed": self.sampled_failed, "per_test": [list(t) for t in self.tests],
                            "mean_target_logprob": self.mean_logprob, "logprob_welch_pvalue": self.logprob_pvalue},
                "failed": self.failed}


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def explain(base_llm, prompt_ids: list[int], base_out: list[int], spec_out: list[int], position: int,
            tie_margin: float) -> Divergence:
    """Classify a divergence from the target's top-2 log-probabilities at its prefix."""
    bt = base_out[position] if position < len(base_out) else None
    st = spec_out[position] if position < len(spec_out) else None
    if bt is None or st is None:  # one side stopped (EOS / stop string) where the other went on
        return Divergence(-1, position, bt, st, None, "length")
    prefix = list(prompt_ids) + list(base_out[:position])
    out = base_llm.generate({"prompt_token_ids": prefix}, SamplingParams(temperature=0, max_tokens=1, logprobs=2))[0]
    d = out.outputs[0].logprobs[0]
    top = sorted(d.items(), key=lambda kv: -kv[1].logprob)[:2]
    margin = top[0][1].logprob - top[1][1].logprob if len(top) > 1 else math.inf
    tie = margin <= tie_margin and st in {t for t, _ in top}
    return Divergence(-1, position, bt, st, margin, "near-tie" if tie else "mismatch")


def two_sample_pvalue(a: Sequence[int], b: Sequence[int], min_count: int = 5) -> tuple[float, int]:
    """Chi-square homogeneity test of two samples of tokens; (p-value, cells compared)."""
    from scipy import stats
    counts: dict[int, list[int]] = {}
    for side, xs in enumerate((a, b)):
        for x in xs:
            counts.setdefault(x, [0, 0])[side] += 1
    big = [v for v in counts.values() if v[0] + v[1] >= min_count]
    rest = [sum(v[i] for v in counts.values() if v[0] + v[1] < min_count) for i in (0, 1)]
    rows = big + ([rest] if sum(rest) else [])
    if len(rows) < 2:
        return 1.0, len(rows)
    table = [[r[0] for r in rows], [r[1] for r in rows]]
    return float(stats.chi2_contingency(table, correction=False).pvalue), len(rows)


def run_quality(base_llm, spec_llm, prompts: list[Any], *, max_tokens: int = 64, tie_margin: float = 1e-3,
                samples: int = 0, positions: int = 4, temperature: float = 1.0, top_k: int = 0,
                alpha: float = 1e-3, seed: int = 0,
                progress: Callable[[str], Any] | None = None) -> QualityReport:
    """Compare ``spec_llm`` against ``base_llm`` (same target) on ``prompts`` (module doc)."""
    spec = spec_llm.verifier_spec
    report = QualityReport(verifier=spec.name, lossless=bool(spec.lossless), alpha=alpha)
    say = progress or (lambda _m: None)
    say(f"greedy: {len(prompts)} prompts x {max_tokens} tokens, without and with speculation")
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    base = base_llm.generate(prompts, greedy)
    fast = spec_llm.generate(prompts, greedy)
    report.num_prompts = len(prompts)
    for i, (b, s) in enumerate(zip(base, fast)):
        pos = first_divergence(b.token_ids, s.token_ids)
        if pos is None:
            report.num_identical += 1
            continue
        d = explain(base_llm, b.prompt_token_ids, b.token_ids, s.token_ids, pos, tie_margin)
        d.index = i
        report.divergences.append(d)
    if samples > 0:
        say(f"sampled: {len(prompts)} prompts x {samples} samples x {positions} tokens per side")
        _sampled(report, base_llm, spec_llm, prompts, samples, positions, temperature, top_k, seed)
    return report


def _sampled(report: QualityReport, base_llm, spec_llm, prompts, samples, positions, temperature, top_k,
             seed) -> None:
    from scipy import stats
    logprobs: dict[str, list[float]] = {"baseline": [], "speculative": []}
    for i, prompt in enumerate(prompts):
        runs = {}
        for side, llm, offset in (("baseline", base_llm, 0), ("speculative", spec_llm, 1)):
            params = [SamplingParams(temperature=temperature, top_k=top_k, max_tokens=positions, ignore_eos=True,
                                     logprobs=0, seed=seed + 2 * (i * samples + j) + offset) for j in range(samples)]
            outs = llm.generate([prompt] * samples, params)
            runs[side] = [o.token_ids for o in outs]
            for o in outs:
                lps = o.outputs[0].logprobs
                if lps:
                    logprobs[side].append(sum(d[t].logprob for d, t in zip(lps, o.token_ids)) / len(lps))
        for pos in range(positions):
            a = [t[pos] for t in runs["baseline"] if len(t) > pos]
            b = [t[pos] for t in runs["speculative"] if len(t) > pos]
            p, cells = two_sample_pvalue(a, b)
            report.tests.append((i, pos, p, cells))
    for side, xs in logprobs.items():
        report.mean_logprob[side] = sum(xs) / len(xs) if xs else None
    if len(logprobs["baseline"]) > 1 and len(logprobs["speculative"]) > 1:
        report.logprob_pvalue = float(stats.ttest_ind(logprobs["baseline"], logprobs["speculative"],
                                                      equal_var=False).pvalue)


def format_report(report: QualityReport, labels: Sequence[str] | None = None) -> str:
    """The table and verdict ``speculum verify-quality`` prints."""
    lines = [f"verifier: {report.verifier} ({'claims lossless' if report.lossless else 'LOSSY by its own account'})"]
    rate = report.exact_match_rate
    lines.append(f"greedy exact match: {report.num_identical}/{report.num_prompts}"
                 + (f" ({100 * rate:.1f}%)" if rate is not None else ""))
    if report.divergences:
        head = f"{'prompt':<28} {'position':>8} {'plain':>8} {'spec':>8} {'top-2 gap':>10}  cause"
        lines += [head, "-" * len(head)]
        for d in report.divergences:
            name = labels[d.index] if labels else str(d.index)
            gap = "-" if d.margin is None else f"{d.margin:.2e}"
            lines.append(f"{name[:28]:<28} {d.position:>8} {str(d.baseline_token):>8} {str(d.speculative_token):>8} "
                         f"{gap:>10}  {d.cause}")
        ties = sum(d.cause == "near-tie" for d in report.divergences)
        lines.append(f"near-ties (the target's top two within the margin; floating point decides): {ties}; "
                     f"mismatches: {len(report.mismatches)}")
    if report.tests:
        thr = report.alpha / len(report.tests)
        lines.append(f"sampled: {len(report.tests)} two-sample tests (prompt x position), smallest p = "
                     f"{report.min_pvalue:.2e}, Bonferroni threshold {thr:.2e} (run-wide false alarm <= "
                     f"{report.alpha:g}): {'DIFFERENT LAWS' if report.sampled_failed else 'same law'}")
        m = report.mean_logprob
        lines.append("mean target log-probability per token: "
                     + ", ".join(f"{k} {'-' if v is None else f'{v:.4f}'}" for k, v in m.items())
                     + ("" if report.logprob_pvalue is None else f" (Welch p = {report.logprob_pvalue:.3f})"))
    if report.failed:
        lines.append("FAIL: a verifier that claims to be lossless changed the output; report this with the JSON")
    elif report.lossless:
        lines.append("PASS: speculation left the output unchanged (ties aside)")
    else:
        lines.append("(a lossy verifier: differences are expected; nothing fails)")
    return "\n".join(lines)
