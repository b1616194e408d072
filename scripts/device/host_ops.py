"""Host microseconds per small CUDA op, with the GPU idle and with it busy.

    python3 scripts/device/host_ops.py [--json F]

The eighteenth session's phase timings (step_phases.py) put 30-40 us of host time on each
small torch op of a speculative step on the H200 machine, several times what such an op
costs to launch, and cutting 13 launches from a chain step did not shorten it. This
separates the cases: each op timed in a loop (host time per call, the device synchronised
only before and after) with the GPU idle, behind a long kernel (``torch.cuda._sleep``: the
queue holds work, as in a step), and right after a CUDA graph replay of a few hundred
kernels (the verify forward's position in a step). Pinned and pageable host-to-device
copies are among the ops.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def per_call(fn, before=None, n: int = 500) -> float:
    """Median host microseconds of ``fn()``, each call after ``before()`` (untimed)."""
    times = []
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    for _ in range(n):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if before is not None:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return 1e6 * sorted(times)[len(times) // 2]


def _inference(fn):
    with torch.inference_mode():
        return fn()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--model", default=None,
                    help="also time the ops again after an engine (this model, an EAGLE-3 chain) has run in "
                         "this process: whatever it sets process-wide (threads, modes) shows up as a difference")
    a = ap.parse_args()
    dev = torch.device("cuda")
    x = torch.zeros(1, 5, dtype=torch.int64, device=dev)
    logits = torch.randn(1, 5, 49152, device=dev)
    host = torch.arange(64, dtype=torch.int64)
    pinned = host.pin_memory()
    big = torch.randn(512, 512, device=dev)
    graph = torch.cuda.CUDAGraph()  # a few hundred small kernels, like a forward's
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = big @ big
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        y = big
        for _ in range(300):
            y = y * 1.0001
    ops = {
        "add": lambda: x + 1,
        "argmax [1,5,49152]": lambda: logits.argmax(-1),
        "cat": lambda: torch.cat([x, x], 1),
        "empty": lambda: torch.empty(5, device=dev),
        "H2D pinned 64": lambda: pinned.to(dev, non_blocking=True),
        "H2D pageable 64": lambda: host.to(dev, non_blocking=True),
        "tensor(list).to(dev)": lambda: torch.tensor([1, 2, 3]).to(dev, non_blocking=True),
        "graph replay (300 kernels)": graph.replay,
    }
    conds = {
        "GPU idle": None,
        "GPU busy (1 ms sleep kernel queued)": lambda: torch.cuda._sleep(2_000_000),
        "after a graph replay": graph.replay,
    }
    ops["add (inference_mode)"] = lambda: _inference(lambda: x + 1)

    def table(title: str) -> dict:
        rows = {}
        print(f"{title}: grad {torch.is_grad_enabled()}, deterministic {torch.are_deterministic_algorithms_enabled()}, "
              f"threads {torch.get_num_threads()}")
        print(f"{'op':30} " + " ".join(f"{c[:24]:>26}" for c in conds))
        for name, fn in ops.items():
            rows[name] = {c: per_call(fn, before) for c, before in conds.items()}
            print(f"{name:30} " + " ".join(f"{v:26.1f}" for v in rows[name].values()))
        return rows

    rows = table("before any engine")
    after = None
    if a.model:
        from speculum import LLM, SamplingParams
        llm = LLM(a.model, speculative_config={"method": "eagle3", "num_speculative_tokens": 4}, dtype="bfloat16")
        t0 = time.perf_counter()
        out = llm.generate([[{"role": "user", "content": "Tell me about the sea."}]] * 1,
                           SamplingParams(temperature=0, max_tokens=128))
        print(f"engine: {len(out[0].token_ids)} tokens in {time.perf_counter() - t0:.2f} s")
        after = table("after an engine ran")
    t0 = time.perf_counter()
    for _ in range(100000):
        pass
    py = 1e6 * (time.perf_counter() - t0) / 100000
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"python empty loop: {py * 1e3:.1f} ns per iteration; {os.cpu_count()} CPUs: {cpu}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"us_per_call": rows, "us_per_call_after_engine": after, "python_loop_ns": py * 1e3,
                       "cpu": cpu}, f, indent=1)


if __name__ == "__main__":
    main()
