"""Where a verify step's extra time goes (issue 16): kernel profile of one eager forward of
a model shape (SmolLM2-135M by default, or Llama-3-8B) at q = 1, 2, 5, 33 (batch 1, context
512), and graphed micro-benchmarks of each GEMM shape and of the attention at those q,
against Triton candidates: the batch-invariant kernel's tiles and a split-K skinny GEMM
(``speculum.backends.torch.native.skinny``), and cuBLASLt. Random weights; no model file.

    python scripts/device/profile_step.py [--shape llama3-8b] [--parts profile,gemm] [--json $OUT/profile_step.json]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from speculum.backends.torch import LlamaArch, NativeRunner, random_native
from speculum.backends.torch.native import gemm, invariant
from speculum.backends.torch.native.gemm import capture, replay_us  # (profile_tree_draft.py imports them here)
from speculum.bench.step import SHAPES
from speculum.kv import PagedKVAllocator

QS = (1, 2, 5, 33)


def graph_us(fn, reps=20, iters=30):
    """Microseconds per call of ``fn`` captured ``reps`` times in one CUDA graph."""
    return replay_us(capture([fn] * reps, warmup=2), iters, calls=reps)


def skinny(x, w, y, bn, bk, warps, stages):
    M, K = x.shape
    N = w.shape[0]
    bm = 16 if M <= 16 else 32 if M <= 32 else 64
    # the batch-invariant GEMM kernel with other tile shapes (rows per tile by M here)
    invariant._linear_kernel[(triton.cdiv(N, bn), triton.cdiv(M, bm))](
        x, w, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0), HAS_BIAS=False, BM=bm, BN=bn, BK=bk,
        PREC="tf32", num_warps=warps, num_stages=stages)


@triton.jit
def _splitk_kernel(x_ptr, w_ptr, p_ptr, M, N, K, K_PER, stride_xm, stride_wn,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One (BN columns, K_PER slice of K) tile of x @ w.T for all M (<= BM) rows; partial sums
    to p[split, m, n] (float32), or the result when there is one split."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_lo = pid_k * K_PER
    for k0 in range(k_lo, k_lo + K_PER, BK):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0)
        b = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K),
                    other=0.0)
        acc = tl.dot(a, b, acc)
    tl.store(p_ptr + (pid_k * M + rm[:, None]) * N + rn[None, :], acc.to(p_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _sum_splits_kernel(p_ptr, y_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(p_ptr + s * MN + i, mask=i < MN, other=0.0)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=i < MN)


def splitk(x, w, y, part, bn, bk, split, warps, stages):
    M, K = x.shape
    N = w.shape[0]
    bm = 16 if M <= 16 else 32 if M <= 32 else 64
    k_per = triton.cdiv(triton.cdiv(K, split), bk) * bk
    out = y if split == 1 else part
    _splitk_kernel[(triton.cdiv(N, bn), split)](x, w, out, M, N, K, k_per, x.stride(0), w.stride(0),
                                                BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(M * N, 1024),)](part, y, M * N, SPLIT=split, BLOCK=1024)


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


SPLITK = [(16, 256, 4, 4), (16, 512, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3), (32, 256, 4, 4), (64, 128, 4, 3),
          (64, 128, 4, 4), (64, 256, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4)]


def gemm_bench(arch, dev, dtype, qs, skinny_too=True):
    a = arch
    shapes = {"qkv": ((a.num_heads + 2 * a.num_kv_heads) * a.head_dim, a.hidden_size),
              "o": (a.hidden_size, a.num_heads * a.head_dim), "gate_up": (2 * a.intermediate_size, a.hidden_size),
              "down": (a.hidden_size, a.intermediate_size), "lm_head": (a.vocab_size, a.hidden_size)}
    per_step = {"qkv": a.num_layers, "o": a.num_layers, "gate_up": a.num_layers, "down": a.num_layers, "lm_head": 1}
    configs = [(bn, bk, w, s) for bn in (16, 32, 64) for bk in (64, 128, 256) for w in (2, 4) for s in (3,)]
    res = {}
    totals = defaultdict(lambda: defaultdict(float))
    print("\n== GEMM us/call (graphed): cuBLAS, cuBLASLt, invariant, best skinny tile, best split-K")
    for name, (N, K) in shapes.items():
        w = torch.randn(N, K, device=dev, dtype=dtype) * 0.02
        for M in qs:
            x = torch.randn(M, K, device=dev, dtype=dtype)
            y = torch.empty(M, N, device=dev, dtype=dtype)
            part = torch.empty(8, M, N, device=dev, dtype=torch.float32)
            r = {"cublas": graph_us(lambda: F.linear(x, w))}
            with gemm.blas("cublaslt"):
                r["cublaslt"] = graph_us(lambda: F.linear(x, w))
            ref = F.linear(x.float(), w.float())
            if skinny_too:
                r["invariant"] = graph_us(lambda: invariant.linear(x, w))
                best = None
                for c in configs:
                    try:
                        us = graph_us(lambda: skinny(x, w, y, *c), reps=10, iters=10)
                    except Exception:  # a config Triton cannot compile (shared memory)
                        continue
                    if best is None or us < best[0]:
                        best = (us, c)
                r["skinny"], r["skinny_config"] = best
            best = None
            for bn, bk, warps, stages in SPLITK:
                for split in (1, 2, 4, 8):
                    if split * bk > K:
                        continue
                    c = (bn, bk, split, warps, stages)
                    try:
                        us = graph_us(lambda: splitk(x, w, y, part, *c), reps=10, iters=10)
                    except Exception:  # shared memory
                        continue
                    if best is None or us < best[0]:
                        best = (us, c)
            splitk(x, w, y, part, *best[1])
            err = (y.float() - ref).abs().max().item()
            r["splitk"], r["splitk_config"], r["splitk_err"] = best[0], best[1], err
            timed = {k: v for k, v in r.items() if isinstance(v, float) and not k.endswith("err")}
            for k, v in timed.items():
                totals[M][k] += v * per_step[name]
            totals[M]["best"] += min(timed.values()) * per_step[name]
            print(f"{name:8} N={N:6} K={K:5} M={M:3}: " + "  ".join(f"{k} {v:7.2f}" for k, v in timed.items())
                  + f"  split-K {best[1]} (max err {err:.3g}, {N * K * 2 / best[0] / 1e6:.2f} TB/s; cuBLAS "
                  f"{N * K * 2 / r['cublas'] / 1e6:.2f})")
            res[f"{name}_M{M}"] = r
    print("\n== GEMM time per forward (us: 4 per layer x layers + LM head)")
    for M, t in totals.items():
        print(f"M={M:3}: " + "  ".join(f"{k} {v:8.1f}" for k, v in t.items()))
    res["per_forward"] = {str(M): dict(t) for M, t in totals.items()}
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
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--parts", default="profile,attention,gemm", help="comma separated: profile, attention, gemm")
    ap.add_argument("--gemm-qs", default="1,2,5,33", help="rows of the GEMM micro-benchmarks")
    ap.add_argument("--no-skinny", action="store_true", help="leave out the invariant kernel's tiles")
    ap.add_argument("--json", default="results/profile_step.json")
    args = ap.parse_args()
    parts = args.parts.split(",")
    dev, dtype = torch.device("cuda"), torch.bfloat16
    arch = LlamaArch(**SHAPES[args.shape])
    out = {"shape": args.shape}
    if "profile" in parts or "attention" in parts:
        runner = NativeRunner(random_native(arch, dtype, dev), max_model_len=4096, cuda_graphs=False)
        runner.attach_cache(PagedKVAllocator("target", 300, 16, 4096))
        runner.allocator.allocate(0, 512)
        if "profile" in parts:
            out["profile"] = kernel_profile(runner, arch, dev)
        if "attention" in parts:
            out["attention"] = attention_bench(arch, dev, dtype, runner)
        del runner
        torch.cuda.empty_cache()
    if "gemm" in parts:
        out["gemm"] = gemm_bench(arch, dev, dtype, [int(q) for q in args.gemm_qs.split(",")], not args.no_skinny)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
