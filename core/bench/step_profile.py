"""Where one decode step's time goes: draft, verify and host work (``bench offline --profile``).

The engine's loop is timed part by part on a few prompts after the throughput run:

- ``draft``: the proposer (``propose`` and ``observe``: head forwards, its feature
  computation, tree building);
- ``verify``: the target forward, the verifier and moving an accepted tree path's K/V;
- ``host``: everything else in the step (sampling batch, draft capping, stop checks,
  bookkeeping, Python).

The device is synchronised around every timed part (so GPU work lands in its part); the
total is therefore slightly above an untimed step. Prefill steps are not counted.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class _Timer:
    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.totals = {"draft": 0.0, "verify": 0.0, "step": 0.0}
        self.calls = {"draft": 0, "verify": 0, "step": 0}

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def wrap(self, obj: Any, name: str, part: str):
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            self.sync()
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.sync()
                self.totals[part] += time.perf_counter() - t0
                self.calls[part] += 1

        setattr(obj, name, timed)
        return lambda: setattr(obj, name, inner)


def profile_steps(llm, prompts: list, params) -> dict:
    """Run ``prompts`` through ``llm`` with the loop's parts timed; mean ms per step."""
    loop = llm.loop
    t = _Timer(llm.backend.device)
    undo = [t.wrap(loop, "step", "step"), t.wrap(loop.target, "forward", "verify"),
            t.wrap(loop.verifier, "verify", "verify")]
    if hasattr(loop.target, "move_kv"):
        undo.append(t.wrap(loop.target, "move_kv", "verify"))
    if loop.proposer is not None:
        undo += [t.wrap(loop.proposer, "propose", "draft"), t.wrap(loop.proposer, "observe", "draft")]
    try:
        outs = llm.generate(prompts, params)
    finally:
        for u in undo:
            u()
    n = max(1, t.calls["step"])  # loop steps: one per engine step, over every running request
    ms = {k: v * 1e3 / n for k, v in t.totals.items()}
    tokens = sum(o.metrics.num_emitted_tokens for o in outs)
    return {"loop_steps": n, "tokens_per_loop_step": tokens / n,
            "step_ms": ms["step"], "draft_ms": ms["draft"], "verify_ms": ms["verify"],
            "host_ms": max(0.0, ms["step"] - ms["draft"] - ms["verify"])}


def profile_table(rows: list[dict]) -> str:
    """One line per config: ms per step and its split, tokens per step."""
    head = f"{'config':<28}{'step ms':>9}{'draft':>9}{'verify':>9}{'host':>9}{'tok/step':>10}"
    out = ["step profile (mean per loop step, device synchronised around each part)", head]
    for r in rows:
        p = r["profile"]
        out.append(f"{r['method'][:27]:<28}{p['step_ms']:>9.3f}{p['draft_ms']:>9.3f}{p['verify_ms']:>9.3f}"
                   f"{p['host_ms']:>9.3f}{p['tokens_per_loop_step']:>10.2f}")
    return "\n".join(out)
