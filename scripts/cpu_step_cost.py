"""What one target forward of q tokens costs on this CPU, per dtype (``bench step`` is
CUDA-only): the default model, one sequence with a 200-token context, the median of
``--iters`` forwards per q. Prints a table (ms, and the ratio to q = 1) and writes JSON.

    python scripts/cpu_step_cost.py --dtypes float32,bfloat16 --query-lens 1,2,3,5,8 --threads 2

In fp32 the runner's GEMMs go through oneDNN's prepacked weights (speculum.backends.torch.native.gemm);
``--unpacked`` times fp32 through ``F.linear`` as well, in the same run (``SPECULUM_GEMM_TUNE=0``).
Speculation pays on a device where verifying k + 1 tokens costs about one decoding step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from unittest import mock

import torch


def measure(dtype: str, query_lens: list[int], threads: int | None, iters: int, model: str | None,
            packed: bool = True) -> dict[int, float]:
    from speculum.engine import LLM
    # read when the runner is made; put back as it was after
    with mock.patch.dict(os.environ, SPECULUM_GEMM_TUNE="1" if packed else "0"):
        llm = LLM(model, dtype=dtype, device="cpu", max_num_seqs=1, threads=threads)
    target = llm.target
    target.add_many([0], [list(range(100, 300))])
    base = target.length(0)
    out: dict[int, float] = {}
    for rep in range(2):  # the first round warms up
        for q in query_lens:
            x = torch.tensor([[7] * q])
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                logits = target.forward([0], x, [q], ()).logits
                float(logits[0, 0, 0])
                times.append(time.perf_counter() - t0)
                target.truncate(0, base)
            times.sort()
            out[q] = times[len(times) // 2]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma separated")
    p.add_argument("--query-lens", default="1,2,3,5,8", help="comma separated tokens per forward")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: speculum's rule)")
    p.add_argument("--iters", type=int, default=10, help="timed forwards per q (the median is kept)")
    p.add_argument("--unpacked", action="store_true",
                   help="also time float32 with every GEMM through F.linear (no oneDNN prepacked weights)")
    p.add_argument("--json", default="results/cpu_step_cost.json", help="where the JSON goes")
    args = p.parse_args(argv)
    qs = [int(q) for q in args.query_lens.split(",")]
    runs = [(dt, dt, True) for dt in args.dtypes.split(",")]
    if args.unpacked:
        runs.append(("float32 F.linear", "float32", False))
    rows = {}
    for label, dt, packed in runs:
        ms = measure(dt, qs, args.threads, args.iters, args.model, packed)
        rows[label] = {q: round(1e3 * s, 3) for q, s in ms.items()}
        print(f"{label:16s} " + "  ".join(f"q={q}: {1e3 * s:6.1f} ms ({s / ms[qs[0]]:.2f})" for q, s in ms.items()))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"cpu": platform.processor() or platform.machine(),
                                           "threads": args.threads, "ms": rows}, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
