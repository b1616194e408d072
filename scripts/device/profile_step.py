"""Where a verify step's extra time goes (issue 16): kernel profile of one eager forward of
the SmolLM2-135M shape at q = 1, 2, 5, 33 (batch 1, context 512), and graphed
micro-benchmarks of each GEMM shape and of the attention at those q, against Triton
candidates. Random weights; no model file needed.

    python scripts/device/profile_step.py [--json $OUT/profile_step.json]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
import torch.nn.functional as F
import triton

from speculum.backends.torch import LlamaArch, NativeRunner, random_native
from speculum.backends.torch.native import invariant
from speculum.bench.step import SHAPES
from speculum.kv import PagedKVAllocator

QS = (1, 2, 5, 33)


def graph_us(fn, reps=20, iters=30):
    """Microseconds per call of ``fn`` captured ``reps`` times in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return replay_us(g, iters, calls=reps)


def replay_us(graph, iters: int = 30, calls: int = 1) -> float:
    """Microseconds per call of a captured ``graph`` holding ``calls`` calls (after one
    untimed replay)."""
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (iters * calls)


def skinny(x, w, y, bn, bk, warps, stages):
    M, K = x.shape
    N = w.shape[0]
    bm = 16 if M <= 16 else 32 if M <= 32 else 64
    # the batch-invariant GEMM kernel with other tile shapes (rows per tile by M here)
    invariant._linear_kernel[(triton.cdiv(N, bn), triton.cdiv(M, bm))](
        x, w, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0), HAS_BIAS=False, BM=bm, BN=bn, BK=bk,
        PREC="tf32", num_warps=warps, num_stages=stages)


def kernel_profile(runner, arch, dev):
    out = {}
    for q in QS:
        tok = torch.randint(0, arch.vocab_size, (1, q), device=dev)
        for _ in range(3):
            runner.forward([0], tok, [q])
            runner.truncate(0, 512)
        torch.cuda.synchronize()
        n = 10
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                runner.forward([0], tok, [q])
                runner.truncate(0, 512)
            torch.cuda.synchronize()
        per = defaultdict(lambda: [0.0, 0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name][0] += e.device_time / n
                per[e.name][1] += 1 / n
        total = sum(v[0] for v in per.values())
        count = sum(v[1] for v in per.values())
        top = sorted(per.items(), key=lambda kv: -kv[1][0])[:14]
        print(f"\n== q={q}: {count:.0f} kernels, {total:.0f} us of kernel time per forward")
        for name, (us, c) in top:
            print(f"{us:8.1f} us {c:5.0f}x  {name[:110]}")
        out[q] = {"kernels": count, "kernel_us": total, "top": [(n_, us, c) for n_, (us, c) in top]}
    return out


def gemm_bench(arch, dev, dtype):
    a = arch
    shapes = {"qkv": ((a.num_heads + 2 * a.num_kv_heads) * a.head_dim, a.hidden_size),
              "o": (a.hidden_size, a.num_heads * a.head_dim), "gate_up": (2 * a.intermediate_size, a.hidden_size),
              "down": (a.hidden_size, a.intermediate_size), "lm_head": (a.vocab_size, a.hidden_size)}
    configs = [(bn, bk, w, s) for bn in (16, 32, 64) for bk in (64, 128, 256) for w in (2, 4) for s in (3,)]
    res = {}
    print("\n== GEMM us/call (graphed): cuBLAS, invariant, best skinny config")
    for name, (N, K) in shapes.items():
        w = torch.randn(N, K, device=dev, dtype=dtype) * 0.02
        for M in QS:
            x = torch.randn(M, K, device=dev, dtype=dtype)
            y = torch.empty(M, N, device=dev, dtype=dtype)
            cub = graph_us(lambda: F.linear(x, w))
            inv = graph_us(lambda: invariant.linear(x, w))
            best = None
            for c in configs:
                try:
                    us = graph_us(lambda: skinny(x, w, y, *c), reps=10, iters=10)
                except Exception:  # a config Triton cannot compile (shared memory)
                    continue
                if best is None or us < best[0]:
                    best = (us, c)
            ref = F.linear(x.float(), w.float())
            skinny(x, w, y, *best[1])
            err = (y.float() - ref).abs().max().item()
            print(f"{name:8} N={N:6} K={K:5} M={M:3}: cublas {cub:6.2f}  invariant {inv:6.2f}  "
                  f"skinny {best[0]:6.2f} {best[1]} (max err {err:.3g})")
            res[f"{name}_M{M}"] = {"cublas": cub, "invariant": inv, "skinny": best[0], "config": best[1]}
    return res


def attention_bench(arch, dev, dtype, runner):
    nq, nkv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    k_pool, v_pool = runner.pools[0]
    res = {}
    print("\n== attention us/call (graphed, one layer, context 512 + q)")
    for ctx in (512, 2048):
        for q in QS:
            Lc = ctx + 64
            read = torch.arange(Lc, device=dev).view(1, Lc)
            pos = (ctx + torch.arange(q, device=dev)).view(1, q)
            qh = torch.randn(1, q, nq, d, device=dev, dtype=dtype)
            mask = torch.arange(Lc, device=dev).view(1, 1, 1, Lc) <= pos.unsqueeze(1).unsqueeze(-1)

            def cur():
                flat = read.reshape(-1)
                kc = k_pool.index_select(0, flat).view(1, Lc, nkv, d).transpose(1, 2)
                vc = v_pool.index_select(0, flat).view(1, Lc, nkv, d).transpose(1, 2)
                return F.scaled_dot_product_attention(qh.transpose(1, 2), kc, vc, attn_mask=mask, enable_gqa=True)

            def sdpa_only():
                kc = k_pool[:Lc].view(1, Lc, nkv, d).transpose(1, 2)
                vc = v_pool[:Lc].view(1, Lc, nkv, d).transpose(1, 2)
                return F.scaled_dot_product_attention(qh.transpose(1, 2), kc, vc, attn_mask=mask, enable_gqa=True)

            def paged():
                return invariant.paged_attention(qh, k_pool, v_pool, read, pos, d ** -0.5)

            r = {"current": graph_us(cur), "sdpa_no_gather": graph_us(sdpa_only), "triton_paged": graph_us(paged)}
            print(f"ctx {ctx:5} q={q:3}: " + "  ".join(f"{k} {v:6.2f}" for k, v in r.items()))
            res[f"ctx{ctx}_q{q}"] = r
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="results/profile_step.json")
    args = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    arch = LlamaArch(**SHAPES["smollm2-135m"])
    runner = NativeRunner(random_native(arch, dtype, dev), max_model_len=4096, cuda_graphs=False)
    runner.attach_cache(PagedKVAllocator("target", 300, 16, 4096))
    runner.allocator.allocate(0, 512)
    out = {"profile": kernel_profile(runner, arch, dev)}
    out["attention"] = attention_bench(arch, dev, dtype, runner)
    out["gemm"] = gemm_bench(arch, dev, dtype)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
