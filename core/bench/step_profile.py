"""Where one decode step's time goes: draft, verify and host work (``bench offline --profile``).

The engine's loop is timed part by part on a few prompts after the throughput run:

- ``draft``: the proposer (``propose`` and ``observe``: head forwards, its feature
  computation, tree building);
- ``verify``: the target forward, the verifier and moving an accepted tree path's K/V;
- ``host``: everything else in the step (sampling batch, draft capping, stop checks,
  bookkeeping, Python).

The device is synchronised around every timed part (so GPU work lands in its part); the
total is therefore slightly above an untimed step. Prefill steps are not counted.

On CUDA the first two prompts then run once more untimed under the torch profiler: the union
of the kernels' intervals is the GPU's busy time, and against the wall time of the run
(both per loop step, prefill included) it gives the share of each step the GPU idles
(``gpu_busy_ms``, ``wall_ms``, ``gpu_idle_share``): the host work that overlapping
(``LLM(overlap=True)``) hides, or does not. A third untimed run of the same prompts, with
the host side profiled too, counts per loop step the CUDA runtime calls the host makes (kernel
and graph launches, copies, synchronisations: ``cuda_api``, calls and host microseconds each)
and which eager operators launch kernels (``launches_by_op``): where the host time of a step
goes on a GPU, which a CPU profile of the same code cannot show.
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
    for name in ("move_kv", "forward_from_verdict"):  # trees' path moves; a forward launched from the verdict
        if hasattr(loop.target, name):
            undo.append(t.wrap(loop.target, name, "verify"))
    if loop.proposer is not None:
        undo += [t.wrap(loop.proposer, "propose", "draft"), t.wrap(loop.proposer, "observe", "draft")]
        if hasattr(loop.proposer, "draft_from_verdict"):  # drafts made from the device verdict
            undo.append(t.wrap(loop.proposer, "draft_from_verdict", "draft"))
    try:
        outs = llm.generate(prompts, params)
    finally:
        for u in undo:
            u()
    n = max(1, t.calls["step"])  # loop steps: one per engine step, over every running request
    ms = {k: v * 1e3 / n for k, v in t.totals.items()}
    tokens = sum(o.metrics.num_emitted_tokens for o in outs)
    out = {"loop_steps": n, "tokens_per_loop_step": tokens / n,
           "step_ms": ms["step"], "draft_ms": ms["draft"], "verify_ms": ms["verify"],
           "host_ms": max(0.0, ms["step"] - ms["draft"] - ms["verify"])}
    if t.cuda:  # two prompts: a profile of every kernel of a long run is slow to collect
        out.update(gpu_busy(llm, prompts[:2], params))
        out.update(host_calls(llm, prompts[:2], params))
    return out


def host_calls(llm, prompts: list, params) -> dict:
    """CUDA runtime calls and kernel-launching operators per loop step of an untimed run with
    the host profiled (see the module doc)."""
    from torch.profiler import ProfilerActivity, profile

    steps0 = llm.loop._steps
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params)
        torch.cuda.synchronize()
    return api_summary(prof.events(), max(1, llm.loop._steps - steps0))


#: CUDA runtime calls, grouped: (group, substrings of the call's name)
API_GROUPS = (("kernel launches", ("LaunchKernel", "cuLaunch")), ("graph launches", ("GraphLaunch",)),
              ("copies", ("Memcpy", "Memset")), ("synchronisations", ("Synchronize", "StreamWaitEvent", "EventQuery")),
              ("host allocations", ("HostAlloc", "MallocHost", "HostRegister")),
              ("events", ("EventRecord", "EventCreate", "EventDestroy")))


def api_summary(events, steps: int, top: int = 12) -> dict:
    """Per loop step: ``cuda_api`` {group: [calls, host us]} of the CUDA runtime calls in
    ``events`` (a torch profile's host events) and ``launches_by_op`` [[operator, kernel
    launches]] (the outermost ``aten::`` operator above each launch; "(outside an operator)"
    for launches made by the runtime itself, e.g. a copy), heaviest first."""
    groups: dict[str, list[float]] = {}
    by_op: dict[str, int] = {}
    for e in events:
        name = getattr(e, "name", "")
        if not name.startswith("cu"):
            continue
        group = next((g for g, keys in API_GROUPS if any(k in name for k in keys)), "other")
        entry = groups.setdefault(group, [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.elapsed_us()
        if group == "kernel launches":
            op, parent = "(outside an operator)", getattr(e, "cpu_parent", None)
            while parent is not None:
                if parent.name.startswith("aten::"):
                    op = parent.name
                parent = getattr(parent, "cpu_parent", None)
            by_op[op] = by_op.get(op, 0) + 1
    return {"cuda_api": {g: [round(c / steps, 2), round(us / steps, 1)] for g, (c, us) in
                         sorted(groups.items(), key=lambda kv: -kv[1][1])},
            "launches_by_op": [[op, round(n / steps, 2)] for op, n in
                               sorted(by_op.items(), key=lambda kv: -kv[1])[:top]]}


def gpu_busy(llm, prompts: list, params) -> dict:
    """GPU busy and wall time per loop step of an untimed run (see the module doc)."""
    from torch.profiler import ProfilerActivity, profile

    steps0 = llm.loop._steps
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    busy = busy_us(prof)
    n = max(1, llm.loop._steps - steps0)
    return {"gpu_busy_ms": busy / 1e3 / n, "wall_ms": wall * 1e3 / n,
            "gpu_idle_share": max(0.0, 1.0 - busy / 1e6 / wall) if wall else None}


def busy_us(prof) -> float:
    """Microseconds of a torch profile during which some kernel or copy ran on the GPU
    (the union of their intervals)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def profile_table(rows: list[dict]) -> str:
    """One line per config: ms per step and its split, tokens per step."""
    gpu = any("gpu_busy_ms" in r["profile"] for r in rows)
    head = f"{'config':<28}{'step ms':>9}{'draft':>9}{'verify':>9}{'host':>9}{'tok/step':>10}"
    if gpu:
        head += f"{'wall ms':>9}{'GPU ms':>9}{'GPU idle':>9}"
    out = ["step profile (mean per loop step, device synchronised around each part"
           + ("; then untimed: wall, GPU busy and its idle share" if gpu else "") + ")", head]
    for r in rows:
        p = r["profile"]
        line = (f"{r['method'][:27]:<28}{p['step_ms']:>9.3f}{p['draft_ms']:>9.3f}{p['verify_ms']:>9.3f}"
                f"{p['host_ms']:>9.3f}{p['tokens_per_loop_step']:>10.2f}")
        if "gpu_busy_ms" in p:
            line += f"{p['wall_ms']:>9.3f}{p['gpu_busy_ms']:>9.3f}{p['gpu_idle_share']:>9.1%}"
        out.append(line)
    for r in rows:  # on a GPU: what the host does per step
        api = r["profile"].get("cuda_api")
        if api:
            calls = ", ".join(f"{g} {c:g} ({us:.0f} us)" for g, (c, us) in api.items())
            ops = ", ".join(f"{op} {n:g}" for op, n in r["profile"].get("launches_by_op", [])[:6])
            out.append(f"{r['method'][:27]:<28}CUDA calls per step: {calls}; kernels launched by: {ops}")
    return "\n".join(out)
