"""Methods side by side on the same prompts: the comparison behind ``speculum generate
--compare`` and ``speculum bench offline``.

Every configuration (None = no speculation, always first) gets its own engine, one
warm-up request, then the prompt groups (MT-bench categories) one after the other, or
(``pooled``) every group's prompts in one ``generate`` call, so that a batch size above a
group's size is actually reached (per-group MAL and outputs are kept; per-group time is not
separable then, and only the total has tokens/s).
Ratios come from one process and one run; outputs are compared token by token with
the baseline's (greedy runs must be identical: speculation is lossless).
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any, Callable

import attrs
import torch

from speculum.metrics import SpecDecodeMetrics
from speculum.threads import cpu_snapshot, others_busy

#: the name of the baseline measured once more after every config (``baseline_again``)
AGAIN = "autoregressive (again)"
#: cores other processes kept busy during a config's timed run from which its figures are flagged
BUSY_WARN = 0.5


@attrs.define
class GroupResult:
    """One method on one prompt group (or on all of them: the total)."""

    tokens: int = 0
    #: None: not timed on its own (a group of a pooled run: its prompts ran among the others)
    seconds: float | None = 0.0
    metrics: SpecDecodeMetrics = attrs.field(factory=SpecDecodeMetrics)
    outputs: list[list[int]] = attrs.field(factory=list)
    texts: list[str] = attrs.field(factory=list)

    @property
    def tokens_per_s(self) -> float | None:
        if self.seconds is None:
            return None
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def step_seconds(self) -> float | None:
        """Wall time per verify step (drafting, verification and host work)."""
        if self.seconds is None or not self.metrics.num_steps:
            return None
        return self.seconds / self.metrics.num_steps

    def add(self, other: "GroupResult") -> None:
        self.tokens += other.tokens
        self.seconds = None if self.seconds is None or other.seconds is None else self.seconds + other.seconds
        self.metrics.merge(other.metrics)
        self.outputs += other.outputs


@attrs.define
class MethodResult:
    """One configuration over every group; ``speedup`` / ``identical`` against the baseline."""

    name: str
    config: dict | None
    groups: dict[str, GroupResult]
    total: GroupResult
    texts: list[str] = attrs.field(factory=list)
    #: more figures for the JSON (e.g. ``profile``: a step's time split)
    extra: dict = attrs.field(factory=dict)
    #: engine steps run at each speculation length k (index k) over the timed groups
    steps_per_k: list[int] = attrs.field(factory=list)

    def speedup(self, base: "MethodResult", group: str | None = None) -> float | None:
        """Tokens/s against the baseline's (None for a group of a pooled run: not timed alone)."""
        mine = self.total if group is None else self.groups[group]
        theirs = base.total if group is None else base.groups[group]
        if mine.tokens_per_s is None or theirs.tokens_per_s is None:
            return None
        return mine.tokens_per_s / theirs.tokens_per_s if theirs.tokens_per_s else 0.0

    def identical(self, base: "MethodResult", group: str | None = None) -> tuple[int, int]:
        """(outputs token-identical to the baseline's, outputs)."""
        mine = self.total if group is None else self.groups[group]
        theirs = base.total if group is None else base.groups[group]
        return sum(a == b for a, b in zip(mine.outputs, theirs.outputs)), len(mine.outputs)

    def as_dict(self, base: "MethodResult | None" = None, greedy: bool = True) -> dict:
        """The JSON entry; ``greedy=False`` (a sampled run) leaves identity out (``None``):
        sampled outputs follow the target's law, not the baseline's draws."""
        def entry(name: str | None, g: GroupResult) -> dict:
            d = {"tokens": g.tokens, "seconds": g.seconds, "tokens_per_s": g.tokens_per_s,
                 "step_seconds": g.step_seconds, **g.metrics.as_dict()}
            if base is not None and base is not self:
                same, n = self.identical(base, name)
                d.update(speedup=self.speedup(base, name), identical=same == n if greedy else None,
                         num_identical=same if greedy else None)
            return d
        return {"method": self.name, "config": self.config, "steps_per_k": list(self.steps_per_k),
                "categories": {c: entry(c, g) for c, g in self.groups.items()}, "total": entry(None, self.total),
                **self.extra}


def method_name(config: dict | None, resolved_method: str | None = None) -> str:
    if config is None:
        return "autoregressive"
    method = resolved_method or config.get('method') or 'detected'
    from speculum.tree import tree_from_config
    tree = tree_from_config(config.get("speculative_token_tree"), config.get("tree_topk"), config.get("tree_depth"),
                            config.get("num_draft_tokens"))
    sched = config.get("num_speculative_tokens_per_batch_size")
    how = "" if sched is None else ",auto" if sched == "auto" else ",by batch"  # two columns never share a name
    lo, hi = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
    if lo is not None or hi is not None:
        how = f",n={lo if lo is not None else ''}-{hi if hi is not None else ''}{how}"
    if config.get("from_verdict") not in (None, "draft"):  # the default goes unnamed
        how += f",{config['from_verdict']}"
    if config.get("model"):  # a head or draft model of one's own: columns of one method told apart
        how += f",{Path(str(config['model'])).name}"
    for key, value in sorted((config.get("options") or {}).items()):
        how += f",{key}={value}"
    if tree is not None:
        return f"{method}({tree.label()}{how})"
    return f"{method}(k={config.get('num_speculative_tokens')}{how})"


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def per_request(params, n: int):
    """``params`` for a call of ``n`` prompts: as it is when greedy or unseeded, else one per
    request seeded ``seed + i`` (every config samples prompt ``i`` of a call from the same seed)."""
    if params.temperature == 0 or params.seed is None:
        return params
    return [attrs.evolve(params, seed=params.seed + i) for i in range(n)]


def _timed_generate(llm, prompts: list, params) -> tuple[list, float]:
    params = per_request(params, len(prompts))
    _sync(llm.backend.device)
    t0 = time.perf_counter()
    res = llm.generate(prompts, params)
    _sync(llm.backend.device)
    return res, time.perf_counter() - t0


def _group_of(outputs, seconds: float | None) -> GroupResult:
    g = GroupResult(seconds=seconds)
    for o in outputs:
        g.tokens += len(o.token_ids)
        g.metrics.merge(o.metrics)
        g.outputs.append(list(o.token_ids))
        g.texts.append(o.text)
    return g


def run_group(llm, prompts: list, params) -> GroupResult:
    """One group of prompts through ``llm`` (already warm), timed."""
    res, seconds = _timed_generate(llm, prompts, params)
    return _group_of(res, seconds)


def run_pooled(llm, groups: dict[str, list], params) -> tuple[dict[str, GroupResult], float]:
    """Every group's prompts in one ``generate`` call (the engine batches across groups), timed
    as a whole; each group keeps its outputs and metrics, with no time of its own."""
    res, seconds = _timed_generate(llm, [p for ps in groups.values() for p in ps], params)
    out, i = {}, 0
    for cat, prompts in groups.items():
        out[cat] = _group_of(res[i:i + len(prompts)], None)
        i += len(prompts)
    return out, seconds


def _counters(llm) -> tuple[list[int], int, int, int, int]:
    """What :func:`_result` reports as differences: steps per k, forwards run ahead and used,
    dropped, steps whose next drafts and whose next forward were launched from the device verdict."""
    loop = llm.loop
    return list(loop.k_counts), loop.ahead_used, loop.ahead_dropped, loop.drafted_from_verdict, \
        loop.forwards_from_verdict


def _result(llm, name: str, config: dict | None, out: dict[str, GroupResult],
            before: tuple[list[int], int, int, int, int], seconds: float | None = None,
            now: tuple[list[int], int, int, int, int] | None = None) -> MethodResult:
    """``seconds``: the wall time of a pooled run (else the sum of the groups' times);
    ``now``: the counters at the end of the run (default: the engine's, read now)."""
    k_before, used, dropped, drafted_fv, forwards_fv = before
    k_now, used_now, dropped_now, drafted_now, forwards_now = now or _counters(llm)
    total = GroupResult()
    texts: list[str] = []
    for g in out.values():
        total.add(GroupResult(g.tokens, g.seconds, SpecDecodeMetrics(), list(g.outputs)))
        total.metrics.merge(g.metrics)
        texts += g.texts
    if seconds is not None:
        total.seconds = seconds
    steps_per_k = [n - (k_before[i] if i < len(k_before) else 0) for i, n in enumerate(k_now)]
    # overlapped steps: forwards (with their drafts) made during the step before, used or dropped
    extra = {"steps_run_ahead": used_now - used, "steps_dropped_ahead": dropped_now - dropped,
             # ... of which the next drafts, and the next verify forward, started from the device verdict
             "drafted_from_verdict": drafted_now - drafted_fv,
             "forwards_from_verdict": forwards_now - forwards_fv}
    return MethodResult(name, config, out, total, texts, extra=extra, steps_per_k=steps_per_k)


def run_method(llm, groups: dict[str, list], params, name: str, config: dict | None,
               progress: Callable[[str], Any] | None = None, pooled: bool = False) -> MethodResult:
    """Run every group through ``llm`` (already warm); time each group separately, or
    (``pooled``) all of them in one call, timed as a whole."""
    out: dict[str, GroupResult] = {}
    before = _counters(llm)
    load = Load()
    if pooled:
        if progress:
            progress(f"{name}: {sum(map(len, groups.values()))} prompts of {len(groups)} groups at once")
        out, seconds = load.during(run_pooled, llm, groups, params)
        return load.note(_result(llm, name, config, out, before, seconds))
    for cat, prompts in groups.items():
        if progress:
            progress(f"{name}: {cat} ({len(prompts)} prompts)")
        out[cat] = load.during(run_group, llm, prompts, params)
    return load.note(_result(llm, name, config, out, before))


@attrs.define
class Load:
    """The cores other processes kept busy while a config's timed runs ran: averaged over
    those runs (``during``), weighted by their time; None where not measurable (off Linux)."""

    core_seconds: float = 0.0
    seconds: float = 0.0
    measurable: bool = True

    def during(self, fn: Callable, *args):
        """``fn(*args)``, its time and the other processes' load over it counted."""
        since, t0 = cpu_snapshot(), time.perf_counter()
        out = fn(*args)
        busy, dt = others_busy(since), time.perf_counter() - t0
        if busy is None:
            self.measurable = False
        else:
            self.core_seconds += busy * dt
            self.seconds += dt
        return out

    def average(self) -> float | None:
        return round(self.core_seconds / self.seconds, 2) if self.measurable and self.seconds > 0 else None

    def note(self, result: MethodResult) -> MethodResult:
        """``result`` with ``other_busy_cpus`` (its JSON and :func:`load_warnings` read it)."""
        result.extra["other_busy_cpus"] = self.average()
        return result


def load_warnings(results: list[MethodResult], at_least: float = BUSY_WARN) -> list[str]:
    """A line for each config during whose timed run other processes kept ``at_least``
    cores busy: its tokens/s, and every ratio against it, are not the machine's."""
    return [f"warning: other processes kept {busy:.1f} cores busy during {r.name}'s timed run; its tokens/s "
            "and every ratio against it may be low (measure with nothing else running)"
            for r in results if (busy := r.extra.get("other_busy_cpus")) is not None and busy >= at_least]


def compare(configs: list[dict | None], groups: dict[str, list], params, make_llm: Callable[[dict | None], Any],
            warmup_tokens: int = 16, progress: Callable[[str], Any] | None = None,
            after: Callable[[Any, MethodResult], Any] | None = None,
            errors: list | None = None, interleave: bool = False, pooled: bool = False,
            baseline_again: bool = False, measured: Callable[[list[MethodResult]], Any] | None = None,
            rounds: int = 1) -> list[MethodResult]:
    """Baseline (no speculation) first, then each config; one engine at a time.
    ``baseline_again``: a fresh baseline engine once more after every config, named
    :data:`AGAIN`; its speedup is the run's drift (the same work measured twice).
    ``measured(results)`` (interleaved runs): called once every config's timed runs are
    done, before any ``after``, so a caller can keep every figure before slow after-work.
    ``after(llm, result)`` runs once a config is measured, before its engine goes.
    With ``errors`` (a list), a config that fails is recorded there as (config, message)
    and the comparison goes on with the next one (a long benchmark is not lost to one
    broken method); without it the error propagates. ``pooled``: see :func:`run_method`.

    ``interleave``: every engine is loaded at once and each group runs through all of
    them before the next group, so a machine whose speed drifts (a shared CPU) slows
    every config alike instead of whichever ran during the slow minute. Pooled, every
    engine runs the whole pooled batch in turn, ``rounds`` times; each config reports
    its median round (:func:`_compare_pooled_in_turns`)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1 (got {rounds})")
    if interleave and pooled:
        return _compare_pooled_in_turns(configs, groups, params, make_llm, warmup_tokens, progress, after, errors,
                                        baseline_again, measured, rounds)
    if rounds > 1:
        raise ValueError("rounds > 1 runs pooled batches in turns: it needs interleave and pooled")
    if interleave:
        return _compare_interleaved(configs, groups, params, make_llm, warmup_tokens, progress, after, errors,
                                    baseline_again, measured)
    results = []
    for cfg, again in _runs(configs, baseline_again):
        llm = None
        try:
            llm, name = _start(make_llm, cfg, groups, params, warmup_tokens, pooled, again)
            results.append(run_method(llm, groups, params, name, cfg, progress, pooled=pooled))
            if after is not None:
                after(llm, results[-1])
        except Exception as exc:
            _skip(cfg, exc, errors)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def _start(make_llm, cfg: dict | None, groups: dict[str, list], params, warmup_tokens: int,
           pooled: bool = False, again: bool = False) -> tuple[Any, str]:
    """A config's engine, warmed untimed, and its name (:data:`AGAIN` for the repeated baseline).

    CUDA graphs are captured per batch size and context bucket the first time one occurs,
    and a short run timed with those captures in it measures them, not the steps. One at a
    time, the warm-up answers the longest prompt (as many of the longest as the batch holds)
    and then the shortest one (the contexts below the longest prompt: on the H200 the first
    category a config ran was often its slowest, 2-5x under the others at 2 questions per
    category), then every other prompt for one token (each prefill shape met once before
    timing, by every engine: the first engine met them timed, a suspect for a repeated
    baseline running 1.11-1.20x the first on the H200).
    ``pooled`` (every question at once above batch 1): the warm-up is the timed
    run itself, once, untimed: as rows finish the batch walks down through every size, each
    at its own contexts, which the longest prompts alone did not reach (2026-12-02, batch 16:
    configs running the very same plain steps still measured 1.0 to 1.8 s)."""
    llm = make_llm(cfg)
    every = sorted((p for ps in groups.values() for p in ps), key=lambda p: len(str(p)), reverse=True)
    width = max(1, getattr(llm, "max_num_seqs", 1))
    if warmup_tokens > 0:
        short = attrs.evolve(params, max_tokens=min(warmup_tokens, params.max_tokens))
        if pooled and width > 1:
            llm.generate(every, per_request(short, len(every)))
        else:
            llm.generate(every[:width], per_request(short, min(width, len(every))))
            if len(every) > width:
                llm.generate(every[-1:], short)
            # every other prompt's prefill once: a shape first met inside a timed run costs the
            # first engine of the process (cuDNN plans, kernel compiles: caches every later
            # engine shares), and the baseline runs first in every category
            rest = every[width:-1]
            if rest:
                llm.generate(rest, per_request(attrs.evolve(params, max_tokens=1), len(rest)))
    resolved = llm.speculative_config.method if llm.speculative_config else None
    return llm, AGAIN if again else method_name(cfg, resolved)


def _skip(cfg: dict | None, exc: Exception, errors: list | None) -> None:
    """Record a failed config and go on, or re-raise (no ``errors`` list, or the baseline)."""
    if errors is None or cfg is None:
        raise exc
    import traceback
    errors.append((cfg, f"{type(exc).__name__}: {exc}"))
    print(f"bench: {cfg} failed, skipped: {type(exc).__name__}: {exc}\n{traceback.format_exc()}",
          file=__import__("sys").stderr, flush=True)


def _runs(configs, baseline_again: bool) -> list[tuple[dict | None, bool]]:
    """(config, is the repeated baseline) in run order: the baseline, the configs, maybe the baseline again."""
    return [(None, False)] + [(c, False) for c in configs if c is not None] + ([(None, True)] if baseline_again else [])


def _start_all(configs, groups, params, make_llm, warmup_tokens, errors, baseline_again: bool,
               pooled: bool = False) -> list[tuple]:
    """Every config's engine loaded and warmed at once (the comparisons in turns): (config,
    engine, name) in run order; a config that fails to start is skipped (:func:`_skip`)."""
    engines = []
    for cfg, again in _runs(configs, baseline_again):
        try:
            llm, name = _start(make_llm, cfg, groups, params, warmup_tokens, pooled=pooled, again=again)
        except Exception as exc:
            _skip(cfg, exc, errors)
            continue
        engines.append((cfg, llm, name))
    return engines


def _hand_over(engines: list[tuple], results: list[MethodResult], measured, after) -> list[MethodResult]:
    """Every timed figure to ``measured`` first, then each engine's ``after`` work (slow: a run
    cut short during it keeps the figures); the engines go."""
    if measured is not None:
        measured(results)
    if after is not None:
        for (cfg, llm, name), result in zip(engines, results):
            after(llm, result)
    engines.clear()
    gc.collect()
    return results


def _compare_interleaved(configs, groups, params, make_llm, warmup_tokens, progress, after, errors,
                         baseline_again: bool = False, measured=None) -> list[MethodResult]:
    engines = _start_all(configs, groups, params, make_llm, warmup_tokens, errors, baseline_again)
    befores = [_counters(llm) for _, llm, _ in engines]
    outs: list[dict[str, GroupResult]] = [{} for _ in engines]
    loads = [Load() for _ in engines]
    for cat, prompts in groups.items():
        for (cfg, llm, name), out, load in zip(engines, outs, loads):
            if progress:
                progress(f"{name}: {cat} ({len(prompts)} prompts)")
            out[cat] = load.during(run_group, llm, prompts, params)
    results = [load.note(_result(llm, name, cfg, out, before))
               for (cfg, llm, name), out, before, load in zip(engines, outs, befores, loads)]
    return _hand_over(engines, results, measured, after)


def _compare_pooled_in_turns(configs, groups, params, make_llm, warmup_tokens, progress, after, errors,
                             baseline_again: bool, measured, rounds: int) -> list[MethodResult]:
    """Pooled runs (every question at once) with every engine loaded at once: each round runs
    the pooled batch through every engine in turn, and each config keeps its median round
    (the round's seconds, outputs and counters; every round's seconds in ``extra``). A pooled
    run of a few seconds per config, one config after the other, carried 15-30% between
    configs doing the same work (batch 16 on the H200, 2026-12-04): in turns, a slow minute
    hits every config, and the median drops a round that met one."""
    engines = _start_all(configs, groups, params, make_llm, warmup_tokens, errors, baseline_again, pooled=True)
    runs: list[list[tuple]] = [[] for _ in engines]  # per engine, per round: (out, seconds, before, after)
    loads = [Load() for _ in engines]  # over every round
    for r in range(rounds):
        for (cfg, llm, name), mine, load in zip(engines, runs, loads):
            if progress:
                progress(f"{name}: round {r + 1} of {rounds}, {sum(map(len, groups.values()))} prompts at once")
            before = _counters(llm)
            out, seconds = load.during(run_pooled, llm, groups, params)
            mine.append((out, seconds, before, _counters(llm)))
    results = []
    for (cfg, llm, name), mine, load in zip(engines, runs, loads):
        out, seconds, before, now = sorted(mine, key=lambda x: x[1])[(len(mine) - 1) // 2]
        res = load.note(_result(llm, name, cfg, out, before, seconds, now))
        res.extra["round_seconds"] = [x[1] for x in mine]
        results.append(res)
    return _hand_over(engines, results, measured, after)


def _num(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(results: list[MethodResult], greedy: bool = True) -> str:
    """Per group: baseline tokens/s, then per method tokens/s, speedup, MAL, identical."""
    base = results[0]
    rows = list(base.groups) + ["total"]
    cw = max(12, *(len(c) + 1 for c in rows))
    head = f"{'category':<{cw}}{'AR tok/s':>9}"
    widths = [max(24, len(r.name)) for r in results[1:]]
    for r, w in zip(results[1:], widths):
        head += f" | {r.name:<{w}} {'tok/s':>7} {'x':>5} {'MAL':>5} {'same':>5}"
    lines = [head, "-" * len(head)]
    for c in rows:
        key = None if c == "total" else c
        b = base.total if key is None else base.groups[c]
        line = f"{c:<{cw}}{_num(b.tokens_per_s, '.1f'):>9}"
        for r, w in zip(results[1:], widths):
            g = r.total if key is None else r.groups[c]
            mal = g.metrics.mean_acceptance_length
            same, n = r.identical(base, key)
            ident = f"{same}/{n}" if greedy else "n/a"
            line += (f" | {'':<{w}} {_num(g.tokens_per_s, '.1f'):>7} {_num(r.speedup(base, key), '.2f'):>5} "
                     f"{_num(mal, '.2f'):>5} {ident:>5}")
        lines.append(line)
    return "\n".join(lines)


def diagnose(base: MethodResult, r: MethodResult) -> str:
    """One line on why a method is (not) faster: tokens per target forward against the
    cost of a speculative step relative to a plain one, both measured in this run."""
    t = r.total.metrics.tokens_per_step or 1.0
    bs, ss = base.total.step_seconds, r.total.step_seconds
    cost = ss / bs if bs and ss else None
    x = r.speedup(base)
    mal = r.total.metrics.mean_acceptance_length
    what = (f"{r.name}: {x:.2f}x: {t:.2f} tokens per target forward (MAL {'-' if mal is None else f'{mal:.2f}'}), "
            f"each step costing {'?' if cost is None else f'{cost:.2f}'}x a plain decoding step")
    if x >= 1.05:
        return what + "."
    if t < 1.3:
        return (what + ". Acceptance too low: the drafts rarely match this target's output; try another method "
                "(a trained head), fewer draft tokens, or prompts that repeat their input (code, extraction).")
    return (what + ". Step cost too high for what is accepted: on a CPU a verify of k+1 tokens costs more than "
            "one step, the more so for k+1 above 3 (in fp32 up to twice one with SPECULUM_GEMM_TUNE=0, which "
            "turns off oneDNN's prepacked weights; `scripts/cpu_step_cost.py` measures this machine), and the "
            "drafting adds to it (try fewer draft tokens, or a GPU); on a GPU, where verifying a few tokens costs "
            "about as much as one, drafting is what a step adds (try fewer draft tokens or a tree; "
            "`bench offline --profile` splits a step into draft, verify and host time).")


def make_engine_factory(**engine_kwargs) -> Callable[[dict | None], Any]:
    """``make_llm(config)`` for :func:`compare`: one engine per configuration."""
    def make(cfg):
        from speculum.engine import LLM
        return LLM(speculative_config=cfg, **engine_kwargs)
    return make
