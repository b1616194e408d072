"""Host time of a loop step by phase, unprofiled: where a host-bound speculative step goes.

    python3 scripts/device/step_phases.py MODEL CONFIG_JSON... [--prompts 4] [--max-tokens 128] [--json F]

Each phase is a function of the loop wrapped with a timer (about a microsecond each, no
profiler): the microseconds per loop step spent in it, with ``wait`` the time the host
blocks on the verdict's copy (the GPU still busy: the step's slack) and ``graph launch``
the host time inside CUDA graph replays (every graph: the target's, the head's). ``engine``
is what the engine does between steps; ``other`` the rest of the step (its own Python).
``ar`` for no speculation. Batch 1, greedy.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch

from slack_probe import load, run  # this folder's: an engine warmed up, a timed generate
from speculum import SamplingParams
from speculum import loop as loop_mod
from speculum.backends.torch.graphs import StaticGraph
from speculum.testing import mt_bench_chat_prompts

#: (owner, attribute, label) of the timed functions; nested phases are subtracted from their caller
PHASES = [
    (loop_mod.DraftVerifyLoop, "step", "step"),
    (loop_mod.DraftVerifyLoop, "_verify", "verify"),
    (loop_mod.DraftVerifyLoop, "_draft_from_verdict", "draft from verdict"),
    (loop_mod.DraftVerifyLoop, "_keep_paths", "tree path K/V"),
    (loop_mod.DraftVerifyLoop, "_observe", "observe"),
    (loop_mod.DraftVerifyLoop, "_plan", "plan (propose, inputs)"),
    (loop_mod.DraftVerifyLoop, "_launch_ahead", "launch ahead"),
    (loop_mod.DraftVerifyLoop, "_run_ahead", "run ahead"),
    (StaticGraph, "replay", "graph launch"),
]


class Timers:
    def __init__(self):
        self.total: dict[str, float] = collections.defaultdict(float)
        self.stack: list[list[float]] = []  # per open phase: [start, time in nested phases]

    def wrap(self, owner, name: str, label: str):
        inner = getattr(owner, name)
        timers = self

        def timed(*a, **kw):
            timers.stack.append([time.perf_counter(), 0.0])
            try:
                return inner(*a, **kw)
            finally:
                t0, nested = timers.stack.pop()
                dt = time.perf_counter() - t0
                timers.total[label] += dt - nested
                if timers.stack:
                    timers.stack[-1][1] += dt
        setattr(owner, name, timed)
        return lambda: setattr(owner, name, inner)

    def wrap_wait(self):
        """The function ``_to_host`` returns blocks until the verdict is on the host."""
        inner = loop_mod._to_host
        timers = self

        def to_host(*a, **kw):
            wait = inner(*a, **kw)

            def waited():
                t0 = time.perf_counter()
                try:
                    return wait()
                finally:
                    dt = time.perf_counter() - t0
                    timers.total["wait (verdict copy)"] += dt
                    if timers.stack:
                        timers.stack[-1][1] += dt
            return waited
        loop_mod._to_host = to_host
        return lambda: setattr(loop_mod, "_to_host", inner)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a model path, or default (SmolLM2-135M-Instruct)")
    ap.add_argument("configs", nargs="+", help="speculative config JSON, or 'ar'")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    prompts = mt_bench_chat_prompts(a.prompts)
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    rows = {}
    for cfg in a.configs:
        llm = load(a.model, cfg, a.dtype, prompts, params)
        timers = Timers()
        dynamic = [(type(llm.target), "forward", "target forward (launch)")]
        if llm.proposer is not None:
            dynamic.append((type(llm.proposer), "propose", "propose"))
        undo = [timers.wrap(o, n, l) for o, n, l in PHASES + dynamic] + [timers.wrap_wait()]
        wall, steps, tokens = run(llm, prompts, params)
        for u in undo:
            u()
        us = {k: 1e6 * v / steps for k, v in timers.total.items()}
        us["other (step's own Python)"] = us.pop("step", 0.0)
        inside = sum(us.values())
        us["engine (between steps, prefills)"] = 1e6 * wall / steps - inside
        rows[cfg] = {"us_per_step": us, "wall_us_per_step": 1e6 * wall / steps, "tokens_per_step": tokens / steps,
                     "steps": steps}
        print(f"=== {cfg}: {steps} steps, {1e6 * wall / steps:.0f} us per step, {tokens / steps:.2f} tokens per step")
        for k, v in sorted(us.items(), key=lambda kv: -kv[1]):
            print(f"  {k:34} {v:8.1f} us")
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"configs": rows, "prompts": a.prompts, "max_tokens": a.max_tokens}, f, indent=1)


if __name__ == "__main__":
    main()
