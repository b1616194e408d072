"""``speculum bench scaling``: the same greedy requests one at a time and all together.

Checks that continuous batching changes nothing in the outputs, and reports aggregate
tokens/s at each batch size relative to batch 1.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import torch


def add_parser(sub) -> None:
    p = sub.add_parser("scaling", help="throughput at batch 1 vs N concurrent requests, same outputs")
    p.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--num-requests", type=int, default=64, help="requests (MT-bench turns, repeated)")
    p.add_argument("--batch-sizes", default="1,64", help="comma separated max_num_seqs to compare")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--speculative-config", default=None, metavar="JSON", help="speculation (default: none)")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda")
    p.add_argument("--batch-invariant", default="off", choices=("off", "on", "both"),
                   help="the engine's batch-invariant mode; 'both' measures the default mode and then the "
                        "batch-invariant one, and prints what the mode costs at each batch size")
    p.add_argument("--no-overlap", action="store_true",
                   help="no overlapped steps (LLM(overlap=False)): the 'before' of overlap (default: overlap on CUDA)")
    p.add_argument("--json", default="results/bench_scaling.json", help="where the JSON goes")
    p.set_defaults(func=run)


def _measure(args, prompts, sizes, batch_invariant: bool) -> tuple[list[dict], object]:
    from speculum.engine import LLM
    from speculum.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm = LLM(model=args.model, speculative_config=args.speculative_config, dtype=args.dtype, device=args.device,
              max_num_seqs=max(sizes), batch_invariant=batch_invariant, overlap=not args.no_overlap)
    llm.generate(prompts[: max(sizes)], SamplingParams(temperature=0, max_tokens=8))  # warm up / capture
    results, ref = [], None
    for bs in sizes:
        llm.scheduler.max_num_seqs = bs  # admission bound (the engine keeps its capacity), as speculum tune does
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        ntok = sum(len(o.token_ids) for o in outs)
        same = None if ref is None else sum(a.token_ids == b.token_ids for a, b in zip(ref, outs))
        ref = ref or outs
        results.append({"batch": bs, "tokens": ntok, "seconds": dt, "tokens_per_s": ntok / dt, "identical": same,
                        "batch_invariant": batch_invariant})
    for r in results:
        r["x_batch1"] = r["tokens_per_s"] / results[0]["tokens_per_s"]
    return results, f"{llm.backend.device} {str(llm.backend.dtype).replace('torch.', '')}"


def run(args) -> int:
    from speculum.datasets import mt_bench

    rows = mt_bench()
    prompts = [[{"role": "user", "content": rows[i % len(rows)]["turns"][i // len(rows) % len(rows[i % len(rows)]["turns"])]}]
               for i in range(args.num_requests)]
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.batch_invariant]
    results, device = [], None
    for inv in modes:  # one engine at a time: the first is gone before the second loads
        part, device = _measure(args, prompts, sizes, inv)
        results += part
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"{'mode':>16} {'batch':>6} {'tok/s':>10} {'x batch1':>9} {'identical':>10}")
    for r in results:
        ident = "-" if r["identical"] is None else f"{r['identical']}/{args.num_requests}"
        mode = "batch-invariant" if r["batch_invariant"] else "default"
        print(f"{mode:>16} {r['batch']:>6} {r['tokens_per_s']:>10.1f} {r['x_batch1']:>9.2f} {ident:>10}")
    costs = []
    if len(modes) == 2:
        for a, b in zip(results[: len(sizes)], results[len(sizes):]):
            costs.append({"batch": a["batch"], "default_tokens_per_s": a["tokens_per_s"],
                          "invariant_tokens_per_s": b["tokens_per_s"],
                          "invariant_over_default": b["tokens_per_s"] / a["tokens_per_s"]})
            print(f"batch {a['batch']}: the batch-invariant mode runs at {costs[-1]['invariant_over_default']:.2f}x "
                  f"the default mode ({b['tokens_per_s']:.1f} against {a['tokens_per_s']:.1f} tok/s)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"device": device, "num_requests": args.num_requests,
                                           "speculative_config": args.speculative_config,
                                           "results": results, "mode_cost": costs}, indent=2))
    print(f"wrote {args.json}")
    return 0
