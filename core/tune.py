"""``speculum tune``: which speculation to run on this machine, per load level.

For a prompt sample, every candidate method (at its longest ``k``) and the plain
baseline run once per load level ``B`` (at most ``B`` requests decoded together). From
those runs and a profile of the target's verify cost:

- acceptance: ``E_m(k)``, the expected tokens per step of method ``m`` cut at ``k``
  drafts, read off the run at the longest k (``1 + sum_{i<k} accepted at position i /
  steps``: a draft cut at k accepts ``min(a, k)``), and its per-token rate
  ``a`` (accepted / drafted); ``(1 - a^(k+1)) / (1 - a)`` is printed beside it;
- costs: ``T_target(B, q)`` profiled (:mod:`speculum.cost_model`), the method's drafting
  seconds per step (timed around ``propose``) and the rest of a step (verification and
  bookkeeping: the run's measured step time less its profiled forward and its drafting);
- prediction: the run at the longest k ``K`` took ``fixed + S * t(K)`` seconds (``fixed``:
  outside decode steps, prefill mostly; ``S`` steps); cut at ``k`` it takes
  ``S E_m(K) / E_m(k)`` steps of ``t(k) = T_target(B, min(q, k+1)) + T_draft(K) k / K +
  T_other``, the verify width ``q`` of every recorded step capped at ``k + 1`` (model-free
  drafts are often shorter), so tokens/s for every (method, k); no speculation is
  measured.

The recommendation per level is the best prediction; ``--check`` measures every
candidate too and prints the recommended one's measured tokens/s against the best
measured (the tool's own accuracy). Rows of the tuning guide (docs/tuning.md) that apply
are printed with the figures that triggered them.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import attrs

from speculum.sampling import SamplingParams
from speculum.spec_length import FixedLength, expected_tokens


@attrs.define
class Run:
    """One measured run: a configuration at one load level."""

    method: str  # "none" for the baseline
    k: int
    batch: int
    tokens: int
    seconds: float
    step_seconds: float  # inside the loop's steps (decode)
    steps: int
    draft_seconds: float
    ttft: float | None
    accepted_per_position: list[int] = attrs.field(factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    #: verify steps summed over requests (a batch step of B rows counts B)
    row_steps: int = 0
    #: the verify width (q = drafts + 1) of each decode step: model-free drafts are often empty
    widths: list[int] = attrs.field(factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def fixed_seconds(self) -> float:
        return max(self.seconds - self.step_seconds, 0.0)

    def expected_tokens(self, k: int) -> float:
        """Tokens per request step this run's drafts give when cut at ``k``."""
        if not self.row_steps:
            return 1.0
        return 1.0 + sum(self.accepted_per_position[:k]) / self.row_steps

    @property
    def acceptance(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    def as_dict(self) -> dict:
        return {**attrs.asdict(self), "tokens_per_s": self.tokens_per_s}


def measure(llm, prompts: list, params: SamplingParams, batch: int, k: int, method: str) -> Run:
    """Run ``prompts`` through ``llm`` with ``batch`` requests at a time and ``k`` drafts per
    step (tune's own knobs on an engine built for the longest k: see :func:`tune`)."""
    llm.scheduler.max_num_seqs = batch
    if llm.k:
        llm.loop.length = FixedLength(k)
    steps = {"seconds": 0.0, "n": 0, "draft": 0.0}
    loop = llm.loop
    inner_step = loop.step
    inner_propose = llm.proposer.propose if llm.proposer is not None else None

    def timed_step(seqs, **kw):
        t0 = time.perf_counter()
        try:  # nothing run ahead: each step's time is its own (this wrapper syncs after it)
            return inner_step(seqs, **{**kw, "ahead": False})
        finally:
            _sync(llm)
            steps["seconds"] += time.perf_counter() - t0
            steps["n"] += 1

    def timed_propose(batch_):
        t0 = time.perf_counter()
        try:
            return inner_propose(batch_)
        finally:
            _sync(llm)
            steps["draft"] += time.perf_counter() - t0

    widths: list[int] = []
    target = loop.target
    inner_forward = target.forward

    def recorded_forward(seq_ids, token_ids, *a, **kw):  # (last_tokens: column 0 given apart)
        widths.append(int(token_ids.shape[1]) + (kw.get("last_tokens") is not None))
        return inner_forward(seq_ids, token_ids, *a, **kw)

    loop.step = timed_step
    target.forward = recorded_forward
    if inner_propose is not None:
        llm.proposer.propose = timed_propose
    try:
        _sync(llm)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        _sync(llm)
        seconds = time.perf_counter() - t0
    finally:
        loop.step = inner_step
        target.forward = inner_forward
        if inner_propose is not None:
            llm.proposer.propose = inner_propose
    acc: list[int] = []
    drafted = accepted = row_steps = 0
    for o in outs:
        m = o.metrics
        row_steps += m.num_steps
        acc += [0] * max(0, len(m.accepted_per_position) - len(acc))
        for i, n in enumerate(m.accepted_per_position):
            acc[i] += n
        drafted += m.num_draft_tokens
        accepted += m.num_accepted_tokens
    ttfts = [o.time_to_first_token for o in outs if o.time_to_first_token is not None]
    return Run(method, k, batch, sum(len(o.token_ids) for o in outs), seconds, steps["seconds"], steps["n"],
               steps["draft"], sum(ttfts) / len(ttfts) if ttfts else None, acc, drafted, accepted, row_steps,
               widths)


def _sync(llm) -> None:
    import torch
    if llm.backend.device.type == "cuda":
        torch.cuda.synchronize(llm.backend.device)


def predict(base: Run, spec: Run | None, k: int, verify_cost: Callable[[int, int], float]) -> float:
    """Predicted tokens/s of ``spec``'s method cut at ``k`` drafts, at ``base.batch``.

    No speculation (``spec`` None or k = 0) is the baseline's measurement itself. For a
    method, measured at its longest k: steps shrink with the tokens each step gives,
    ``steps(k) = steps(K) E(K) / E(k)``; a step costs the target's verify of its width
    capped at ``k + 1`` (every step's width as recorded: model-free drafts are often
    shorter or empty), drafting in proportion to ``k``, and the rest of a step as
    measured; the time outside steps (prefill) is the run's own. At ``k = K`` this gives
    the measured run back."""
    if spec is None or k == 0:
        return base.tokens_per_s
    B = base.batch
    widths = spec.widths or [spec.k + 1]
    verify_at = lambda cap: sum(verify_cost(B, min(w, cap)) for w in widths) / len(widths)  # noqa: E731
    drafting = spec.draft_seconds / max(spec.steps, 1)
    other = spec.step_seconds / max(spec.steps, 1) - verify_at(spec.k + 1) - drafting
    per_step = verify_at(k + 1) + drafting * k / max(spec.k, 1) + other
    steps = spec.steps * spec.expected_tokens(spec.k) / spec.expected_tokens(k)
    return spec.tokens / (spec.fixed_seconds + steps * per_step)


@attrs.define
class Level:
    """One load level: what was predicted (and measured) for every candidate."""

    batch: int
    predicted: dict[tuple[str, int], float] = attrs.field(factory=dict)
    measured: dict[tuple[str, int], float] = attrs.field(factory=dict)

    @property
    def recommended(self) -> tuple[str, int]:
        return max(self.predicted, key=lambda c: self.predicted[c])

    @property
    def best_measured(self) -> tuple[str, int] | None:
        return max(self.measured, key=lambda c: self.measured[c]) if self.measured else None

    @property
    def accuracy(self) -> float | None:
        """Measured tokens/s of the recommendation over the best measured (1.0 = found the best)."""
        best = self.best_measured
        if best is None or self.recommended not in self.measured:
            return None
        return self.measured[self.recommended] / self.measured[best]


@attrs.define
class TuneReport:
    max_k: int
    levels: list[Level]
    runs: list[Run]
    methods: dict[str, dict]
    verify_cost: Any
    guide: list[tuple[str, str, str]] = attrs.field(factory=list)

    def run(self, method: str, k: int, batch: int) -> Run | None:
        for r in self.runs:
            if (r.method, r.k, r.batch) == (method, k, batch):
                return r
        return None

    def suggested_config(self) -> dict | None:
        """The best method with its k per load level as vLLM-style batch-size ranges."""
        wins: dict[str, float] = {}
        for lv in self.levels:
            base = lv.predicted[("none", 0)]
            for (m, _k), v in lv.predicted.items():
                if m != "none":
                    wins[m] = max(wins.get(m, 0.0), v / base)
        if not wins:
            return None
        chosen = [lv.recommended[0] for lv in self.levels if lv.recommended[0] != "none"]
        if not chosen:
            return None  # no speculation wins anywhere: run without
        method = max(chosen, key=lambda m: (chosen.count(m), -chosen.index(m)))
        ranges, lo = {}, 1
        for i, lv in enumerate(self.levels):
            k = max((kk for (m, kk) in lv.predicted if m in (method, "none")),
                    key=lambda kk: lv.predicted[(method, kk) if kk else ("none", 0)])
            hi = lv.batch if i + 1 < len(self.levels) else 4096
            ranges[f"{lo}-{hi}"] = k
            lo = hi + 1
        cfg = dict(self.methods[method])
        cfg["num_speculative_tokens"] = max(max(ranges.values()), 1)
        cfg["num_speculative_tokens_per_batch_size"] = ranges
        return cfg

    def as_dict(self) -> dict:
        def key(c):
            return f"{c[0]}(k={c[1]})" if c[0] != "none" else "none"
        return {"max_k": self.max_k, "methods": self.methods, "verify_cost": self.verify_cost.as_dict(),
                "levels": [{"batch": lv.batch, "recommended": key(lv.recommended),
                            "best_measured": key(lv.best_measured) if lv.best_measured else None,
                            "accuracy": lv.accuracy, "predicted": {key(c): v for c, v in lv.predicted.items()},
                            "measured": {key(c): v for c, v in lv.measured.items()}} for lv in self.levels],
                "runs": [r.as_dict() for r in self.runs], "suggested_config": self.suggested_config(),
                "guide": [{"if_you_see": a, "try": b, "because": c} for a, b, c in self.guide]}


#: the tuning guide (docs/tuning.md): what a user sees, what to try
GUIDE = {
    "low": ("Acceptance rate < 0.6", "A better draft (closer to the target: a trained EAGLE-3 head, a larger draft "
                                     "model) or fewer draft tokens"),
    "high": ("Acceptance rate > 0.9", "Increase num_speculative_tokens"),
    "ttft": ("TTFT regression", "Reduce num_speculative_tokens or use n-gram (no draft prefill)"),
    "load": ("Throughput worse at high load", 'Turn speculation off at high batch sizes: '
                                              'num_speculative_tokens_per_batch_size ranges, or "auto"'),
}


def guide_rows(report: TuneReport) -> list[tuple[str, str, str]]:
    """The guide's rows that this machine's figures trigger (with the figures)."""
    rows = []
    for m in report.methods:
        accs = [r.acceptance for r in report.runs if r.method == m and r.k == report.max_k and r.acceptance is not None]
        if not accs:
            continue
        a = sum(accs) / len(accs)
        if a < 0.6:
            rows.append((*GUIDE["low"], f"{m}: acceptance rate {a:.2f} at k={report.max_k}"))
        if a > 0.9:
            rows.append((*GUIDE["high"], f"{m}: acceptance rate {a:.2f} at k={report.max_k}"))
    first = report.levels[0].batch
    base = report.run("none", 0, first)
    for m in report.methods:
        r = report.run(m, report.max_k, first)
        if base and r and base.ttft and r.ttft and r.ttft > 1.1 * base.ttft:
            rows.append((*GUIDE["ttft"], f"{m}: mean TTFT {1e3 * r.ttft:.1f} ms against {1e3 * base.ttft:.1f} ms "
                                         f"without speculation at batch {first}"))
    top = report.levels[-1]
    if top.batch > 1:
        base_v = top.measured.get(("none", 0)) or top.predicted[("none", 0)]
        src = top.measured or top.predicted
        best_spec = max((v for (m, _k), v in src.items() if m != "none"), default=None)
        if best_spec is not None and best_spec < base_v:
            rows.append((*GUIDE["load"], f"batch {top.batch}: best speculative {best_spec:.1f} tok/s against "
                                         f"{base_v:.1f} without"))
    return rows


def tune(make_llm: Callable[[dict | None], Any], methods: dict[str, dict], prompts: list, params: SamplingParams,
         batches: Sequence[int], max_k: int, check: bool = False, context: int = 128, repeats: int = 1,
         progress: Callable[[str], Any] | None = None) -> TuneReport:
    """Measure, predict and (``check``) verify; ``methods``: name -> speculative config
    (without k). ``make_llm(config)`` builds an engine for up to ``max(batches)`` requests.

    ``repeats`` > 1 measures every configuration that many times, round robin over the
    configurations of a load level, and keeps the fastest run of each: other processes
    only ever slow a run down, so on a shared machine the fastest is the least disturbed.
    """
    from speculum.cost_model import profile_verify_cost
    say = progress or (lambda _m: None)
    batches = sorted(set(batches))
    warm = attrs.evolve(params, max_tokens=min(8, params.max_tokens))
    engines = {"none": make_llm(None)}
    for name, cfg in methods.items():  # every width captured: k changes between runs
        engines[name] = make_llm({**cfg, "num_speculative_tokens": max_k,
                                  "num_speculative_tokens_per_batch_size": [[1, 4096, max_k]]})
    for llm in engines.values():
        llm.generate(prompts[:1], warm)
    say(f"profiling the verify cost (batch {', '.join(map(str, batches))}; q = 1..{max_k + 1})")
    cost = profile_verify_cost(engines["none"].target, batches, list(range(1, max_k + 2)), context=context,
                               reps=max(3, 2 * repeats), statistic="min" if repeats > 1 else "median").monotone()
    configs = [("none", 0)] + [(name, k) for name in methods
                               for k in (range(max_k, 0, -1) if check else [max_k])]
    best: dict[tuple[str, int, int], Run] = {}
    for B in batches:
        for rep in range(repeats):
            for name, k in configs:
                say(f"{name}{'' if name == 'none' else f' k={k}'} at batch {B}"
                    + (f" (round {rep + 1}/{repeats})" if repeats > 1 else ""))
                r = measure(engines[name], prompts, params, B, k, name)
                key = (name, k, B)
                if key not in best or r.seconds < best[key].seconds:
                    best[key] = r
    del engines
    runs = list(best.values())
    levels = []
    for B in batches:
        base = best[("none", 0, B)]
        lv = Level(B)
        lv.predicted[("none", 0)] = predict(base, None, 0, cost)
        if check:
            lv.measured[("none", 0)] = base.tokens_per_s
        for name in methods:
            at_max = best[(name, max_k, B)]
            for k in range(1, max_k + 1):
                lv.predicted[(name, k)] = predict(base, at_max, k, cost)
                if check:
                    lv.measured[(name, k)] = best[(name, k, B)].tokens_per_s
        levels.append(lv)
    report = TuneReport(max_k, levels, runs, dict(methods), cost)
    report.guide = guide_rows(report)
    return report


def format_report(report: TuneReport) -> str:
    from speculum.cost_model import describe
    out = ["== verify cost: seconds of one target forward, and verifying q tokens against 1",
           describe(report.verify_cost, report.max_k), ""]
    out.append("== acceptance (greedy, this prompt sample)")
    for m in report.methods:
        r = max((x for x in report.runs if x.method == m and x.k == report.max_k), key=lambda x: x.steps)
        a = r.acceptance
        ek = "  ".join(f"k={k}: {r.expected_tokens(k):.2f}" for k in range(1, report.max_k + 1))
        geo = "  ".join(f"{expected_tokens(a, k):.2f}" for k in range(1, report.max_k + 1)) if a is not None else "-"
        out.append(f"{m}: acceptance rate {'-' if a is None else f'{a:.3f}'}; tokens per step {ek}")
        out.append(f"{'':>{len(m)}}  (geometric model (1 - a^(k+1)) / (1 - a) at that rate: {geo}); drafting "
                   f"{1e3 * r.draft_seconds / max(r.steps, 1):.2f} ms per step at k={report.max_k}, batch {r.batch}")
    out.append("")
    cands = list(report.levels[0].predicted)
    name = [("none" if m == "none" else f"{m}(k={k})") for m, k in cands]
    w = max(12, *(len(n) for n in name))
    head = f"{'batch':>5}  " + " ".join(f"{n:>{w}}" for n in name) + "   recommended"
    out += ["== predicted tokens/s (measured below with --check)", head, "-" * len(head)]
    for lv in report.levels:
        rec = lv.recommended
        cells = []
        for c in cands:
            cell = f"{lv.predicted[c]:.1f}" + ("*" if c == rec else "")
            cells.append(f"{cell:>{w}}")
        out.append(f"{lv.batch:>5}  " + " ".join(cells) + f"   {rec[0]}" + (f" k={rec[1]}" if rec[1] else ""))
    if any(lv.measured for lv in report.levels):
        out += ["", "== measured tokens/s", head.replace("recommended", "best measured"), "-" * len(head)]
        for lv in report.levels:
            best = lv.best_measured
            cells = []
            for c in cands:
                v = lv.measured.get(c)
                cell = "-" if v is None else f"{v:.1f}" + ("+" if c == best else "")
                cells.append(f"{cell:>{w}}")
            out.append(f"{lv.batch:>5}  " + " ".join(cells) + f"   {best[0]}" + (f" k={best[1]}" if best[1] else ""))
        out += ["", "== recommendation against the best measured (must be >= 0.90)"]
        for lv in report.levels:
            acc = lv.accuracy
            verdict = "-" if acc is None else ("ok" if acc >= 0.9 else "OFF")
            rec, best = lv.recommended, lv.best_measured
            out.append(f"batch {lv.batch}: recommended {_name(rec)} measured {lv.measured.get(rec, 0):.1f} tok/s, "
                       f"best {_name(best)} {lv.measured[best]:.1f} tok/s: {'-' if acc is None else f'{acc:.3f}'} "
                       f"{verdict}")
    cfg = report.suggested_config()
    if cfg:
        import json
        out += ["", "== suggested speculative config (the best method, k per load level)", json.dumps(cfg),
                'or let the engine choose per step: "num_speculative_tokens_per_batch_size": "auto"']
    out += ["", "== tuning guide rows that apply (docs/tuning.md)"]
    if report.guide:
        out += [f"- {a} -> {b}  [{c}]" for a, b, c in report.guide]
    else:
        out.append("- none of: acceptance < 0.6, acceptance > 0.9, TTFT regression, throughput worse at high load")
    return "\n".join(out)


def _name(c) -> str:
    return "none" if c[0] == "none" else f"{c[0]}(k={c[1]})"
