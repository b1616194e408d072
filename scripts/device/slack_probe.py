"""Where a step has slack: host work added at one point of the loop step, and what it costs.

    python3 scripts/device/slack_probe.py MODEL CONFIG_JSON... [--delays 100,300] [--prompts 4] [--json F]

For each config (``ar`` for no speculation) the same prompts are generated with a busy-wait
of ``delay`` microseconds added at one point of every loop step, in turns with no delay:

- ``start``: when the step begins (the last step's forward, launched ahead, is running);
- ``before_wait``: before the verdict's copy to the host is queued (the verify forward and
  the verification are queued; drafting from the verdict is not launched yet);
- ``after_wait``: after the host has read the verdict, before its bookkeeping (the proposer's
  observe; the next drafts and forward are launched after it).

Each row prints ms per loop step and the slope (added ms per step / added ms): near 1 the
point is on the step's critical path (host time saved there is step time saved), near 0
the GPU is still busy there (host time saved there buys nothing). Batch 1, greedy.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from speculum import LLM, SamplingParams
from speculum import loop as loop_mod
from speculum.testing import mt_bench_chat_prompts

POINTS = ("start", "before_wait", "after_wait")


def busy(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


class Probe:
    """Patches the three points once; ``point`` and ``us`` pick what is delayed."""

    def __init__(self):
        self.point, self.us = None, 0.0
        cls = loop_mod.DraftVerifyLoop
        step, observe, to_host = cls.step, cls._observe, loop_mod._to_host
        probe = self

        def step_(self, *a, **kw):
            if probe.point == "start":
                busy(probe.us)
            return step(self, *a, **kw)

        def to_host_(*a, **kw):
            if probe.point == "before_wait":
                busy(probe.us)
            return to_host(*a, **kw)

        def observe_(self, *a, **kw):
            if probe.point == "after_wait":
                busy(probe.us)
            return observe(self, *a, **kw)

        cls.step, cls._observe, loop_mod._to_host = step_, observe_, to_host_


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(llm: LLM, prompts, params) -> tuple[float, int, int]:
    s0 = llm.loop._steps
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync()
    return time.perf_counter() - t0, llm.loop._steps - s0, sum(len(o.token_ids) for o in outs)


def load(model: str, cfg: str, dtype: str, prompts, params) -> LLM:
    """The engine of one config (``ar``: no speculation), warmed up on ``prompts`` (every graph shape)."""
    spec = None if cfg == "ar" else json.loads(cfg)
    llm = LLM(None if model == "default" else model, speculative_config=spec, dtype=dtype, max_num_seqs=1)
    llm.generate(prompts, params)
    return llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a model path, or default (SmolLM2-135M-Instruct)")
    ap.add_argument("configs", nargs="+", help="speculative config JSON, or 'ar'")
    ap.add_argument("--delays", default="100,300", help="microseconds, comma separated")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="turns over every variant (the mean is reported)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    probe = Probe()
    prompts = mt_bench_chat_prompts(a.prompts)
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    delays = [float(d) for d in a.delays.split(",") if d]
    rows = []
    print(f"{'config':42} {'point':12} {'us':>5} {'ms/step':>8} {'tok/step':>8} {'slope':>6}")
    for cfg in a.configs:
        llm = load(a.model, cfg, a.dtype, prompts, params)
        variants = [(None, 0.0)] + [(p, d) for p in POINTS for d in delays]
        got: dict = {v: [] for v in variants}
        for _ in range(a.rounds):
            for v in variants:
                probe.point, probe.us = v
                got[v].append(run(llm, prompts, params))
        probe.point = None
        base = None
        for v in variants:
            secs = sum(g[0] for g in got[v])
            steps = sum(g[1] for g in got[v])
            toks = sum(g[2] for g in got[v])
            ms = 1e3 * secs / max(steps, 1)
            if v[0] is None:
                base = ms
            slope = (ms - base) / (v[1] / 1e3) if v[1] else 0.0
            row = {"config": cfg, "point": v[0] or "none", "delay_us": v[1], "ms_per_step": ms,
                   "tokens_per_step": toks / max(steps, 1), "tok_s": toks / secs, "slope": slope}
            rows.append(row)
            print(f"{cfg[:42]:42} {row['point']:12} {v[1]:5.0f} {ms:8.3f} {row['tokens_per_step']:8.2f} {slope:6.2f}")
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "prompts": a.prompts, "max_tokens": a.max_tokens, "rounds": a.rounds}, f,
                      indent=1)


if __name__ == "__main__":
    main()
