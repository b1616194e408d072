"""``speculum bench step``: time one decode/verify step of a native model via CUDA graphs.

For shapes with no weights offline (e.g. Llama-3-8B), the model is randomly initialised;
step time does not depend on weight values. Reports the HBM floor (weight bytes /
bandwidth) and the ratio of each step to it, verify (q tokens) against decode (1), the
host's time per step (building the step's metadata and launching the graph) and, from a
torch profile of the same replays, the GPU's busy time per step and its idle share.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from speculum.kv import blocks_for

SHAPES = {
    "llama3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_eps=1e-5,
                      rope_theta=500000.0, rope_scaling=None, tie_word_embeddings=False, qkv_bias=False,
                      qk_norm=False, max_position_embeddings=8192, eos_token_id=None),
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_eps=1e-5,
                         rope_theta=100000.0, rope_scaling=None, tie_word_embeddings=True, qkv_bias=False,
                         qk_norm=False, max_position_embeddings=8192, eos_token_id=None),
}


def add_parser(sub) -> None:
    p = sub.add_parser("step", help="time decode and verify steps of a (random) native model")
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES), help="model shape (random weights)")
    p.add_argument("--batch-sizes", default="1,32", help="comma separated batch sizes")
    p.add_argument("--query-lens", default="1,2,4,6,8", help="comma separated query tokens per sequence")
    p.add_argument("--context", type=int, default=512, help="tokens already in the KV cache")
    p.add_argument("--bandwidth", type=float, default=3.8e12, help="bytes/s for the floor (H200 copy: 3.8e12)")
    p.add_argument("--dtype", default="bfloat16", help="weights and KV dtype")
    p.add_argument("--iters", type=int, default=50, help="timed replays per shape")
    p.add_argument("--batch-invariant", action="store_true",
                   help="time the batch-invariant kernels (speculum.backends.torch.native.invariant) (default: off)")
    p.add_argument("--json", default="results/bench_step.json", help="where the JSON goes")
    p.set_defaults(func=run)


def run(args) -> int:
    from speculum.backends.torch import LlamaArch, NativeRunner, random_native, resolve_dtype
    from speculum.bench.step_profile import busy_us
    from speculum.kv import PagedKVAllocator

    if not torch.cuda.is_available():
        raise SystemExit("bench step needs a CUDA device")
    dev = torch.device("cuda")
    dtype = resolve_dtype(args.dtype, dev)
    arch = LlamaArch(**SHAPES[args.shape])
    model = random_native(arch, dtype, dev).set_batch_invariant(args.batch_invariant)
    runner = NativeRunner(model, max_model_len=4096)
    wbytes = runner.weight_bytes
    floor = wbytes / args.bandwidth
    bss = [int(x) for x in args.batch_sizes.split(",")]
    qs = [int(x) for x in args.query_lens.split(",")]
    need_blocks = max(bss) * blocks_for(args.context + max(qs) + 1, 16) + 2
    runner.attach_cache(PagedKVAllocator("target", need_blocks, 16, 4096))
    rows = []
    print(f"{args.shape}{' (batch-invariant kernels)' if args.batch_invariant else ''}: {wbytes / 1e9:.2f} GB weights, "
          f"HBM floor {floor * 1e3:.3f} ms/step")
    print(f"{'batch':>5} {'q':>3} {'ms/step':>9} {'x floor':>8} {'x q=1':>6} {'host ms':>8} {'GPU ms':>8} {'idle':>6}")
    for B in bss:
        ids = list(range(B))
        for s in ids:
            runner.allocator.allocate(s, args.context)
        t1 = None
        for q in qs:
            tok = torch.randint(0, arch.vocab_size, (B, q), device=dev)

            def replays(n: int) -> float:
                """``n`` forwards (context restored after each); the host's seconds in them."""
                host = 0.0
                for _ in range(n):
                    h0 = time.perf_counter()
                    runner.forward(ids, tok, [q] * B)
                    host += time.perf_counter() - h0
                    for s in ids:
                        runner.truncate(s, args.context)
                return host

            replays(3)  # capture + warm
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            host_ms = replays(args.iters) / args.iters * 1e3
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) / args.iters * 1e3
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                replays(10)
                torch.cuda.synchronize()
            gpu_ms = busy_us(prof) / 10 / 1e3
            idle = max(0.0, 1 - gpu_ms / ms)
            t1 = t1 or ms
            rows.append({"batch": B, "q": q, "ms": ms, "x_floor": ms / (floor * 1e3), "x_q1": ms / t1,
                         "host_ms": host_ms, "gpu_ms": gpu_ms, "gpu_idle_share": idle})
            print(f"{B:>5} {q:>3} {ms:>9.3f} {ms / (floor * 1e3):>8.2f} {ms / t1:>6.2f} {host_ms:>8.3f} "
                  f"{gpu_ms:>8.3f} {idle:>6.1%}")
        for s in ids:
            runner.remove(s)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    plan = model.gemm.summary()  # the GEMMs that the timing sent to another BLAS library
    if plan:
        print("GEMMs on another BLAS library than PyTorch's (rows x N x K): "
              + ", ".join(f"{k} {v}" for k, v in plan.items()))
    Path(args.json).write_text(json.dumps({"shape": args.shape, "batch_invariant": args.batch_invariant,
                                           "weight_bytes": wbytes, "floor_ms": floor * 1e3,
                                           "gpu": torch.cuda.get_device_name(0), "rows": rows,
                                           "gemm_plan": plan}, indent=2))
    print(f"wrote {args.json}")
    return 0
