"""Batch-invariant kernels: every token's row is computed the same way whatever else is in
the forward (``LLM(..., batch_invariant=True)``).

A 1-token decode and a k+1-token verify normally take different cuBLAS GEMMs (the
library picks tiles and split-K by the number of rows) and a different attention path
(masked over a context padded to the batch's longest row), so bf16 rounding differs and
near-ties flip. Here the reduction order of every output element is fixed by the
weights' shapes alone:

- :func:`linear`: a Triton GEMM with one tile configuration per (N, K), 16 rows per
  tile, no split-K; ``M`` (rows) only decides how many tiles run and is not specialised
  on. A row's output is the same dot products, in the same order, alone or among 320.
- :func:`paged_attention`: a Triton kernel with one program per (query token, head). It
  reads the sequence's own keys through its slots, ``BLOCK_L`` at a time, in
  ascending logical position, stopping at the query's position, with an online softmax.
  The loop never depends on the batch, the number of query tokens or the context bucket;
  lanes past the query's position contribute exact zeros. A token tree's query reads
  through a slot table of its own (``slots`` [B, T, Lc]): its ancestors in place of the
  other nodes, so it sums the keys a decode step at its position would, in their order.
- RMSNorm and RoPE are already row-local Triton kernels (:mod:`.kernels`); the LM head
  is :func:`linear`; argmax and the elementwise ops are exact.

Why Triton rather than padding cuBLAS calls to a fixed shape: the order then is ours,
written down here, not a heuristic of a library version. The torch twins define the
same algorithms for CPUs (fp32) and for checking; only the CUDA path is claimed
bitwise invariant (``tests/test_batch_invariant_cuda.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from speculum.backends.torch.native.kernels import triton, use_triton

if triton is not None:
    import triton.language as tl

#: rows per GEMM tile (fixed: the tile shape decides the MMA instruction)
BLOCK_M = 16
#: keys per attention iteration
BLOCK_L = 64


def _tiles(N: int, K: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of a weight [N, K]: chosen from the weight's shape only."""
    bn = 64 if N >= 4096 else 32
    return bn, 64 if K % 64 == 0 else 32


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       PREC: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :],
                        mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None],
                        mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PREC)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit(do_not_specialize=["T", "Lc"])
    def _attention_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, pos_ptr, o_ptr, T, Lc, scale,
                          HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BL: tl.constexpr,
                          PER_QUERY: tl.constexpr):
        tok = tl.program_id(0)  # b * T + t
        h = tl.program_id(1)
        b = tok // T
        row = tok if PER_QUERY else b  # the slot table this query reads
        kvh = h // (HQ // HKV)
        offs_d = tl.arange(0, D)
        offs_l = tl.arange(0, BL)
        q = tl.load(q_ptr + (tok * HQ + h) * D + offs_d).to(tl.float32) * scale
        pos = tl.load(pos_ptr + tok)
        m = tl.full((), float("-inf"), tl.float32)
        l = tl.zeros((), tl.float32)
        acc = tl.zeros((D,), tl.float32)
        for start in range(0, pos + 1, BL):
            j = start + offs_l
            valid = (j <= pos) & (j < Lc)
            slot = tl.load(slots_ptr + row * Lc + j, mask=valid, other=0)
            kv_off = (slot[:, None] * HKV + kvh) * D + offs_d[None, :]
            k = tl.load(k_ptr + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1)
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            v = tl.load(v_ptr + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
            l = l * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m = m_new
        tl.store(o_ptr + (tok * HQ + h) * D + offs_d, (acc / l).to(o_ptr.dtype.element_ty))


def linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The CPU twin: rows in fixed tiles of :data:`BLOCK_M` (padded), one GEMM shape per weight."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    M = x2.shape[0]
    pad = (-M) % BLOCK_M
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, x2.shape[1])])
    y = torch.cat([F.linear(t, weight, bias) for t in x2.split(BLOCK_M)])[:M]
    return y.view(*shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with a per-row result independent of the number of rows."""
    if not use_triton(x):
        return linear_torch(x, weight, bias)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, K = x2.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    bn, bk = _tiles(N, K)
    grid = (triton.cdiv(N, bn), triton.cdiv(M, BLOCK_M))
    _linear_kernel[grid](x2, weight, bias if bias is not None else weight, y, M, N, K, x2.stride(0),
                         weight.stride(0), y.stride(0), HAS_BIAS=bias is not None, BM=BLOCK_M, BN=bn, BK=bk,
                         PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4)
    return y.view(*shape[:-1], N)


def paged_attention_torch(q, k_pool, v_pool, slots, positions, scale):
    """The CPU twin of the kernel: ``q`` [B, T, Hq, D], pools [slots, Hkv, D], ``slots``
    [B, Lc] the slot of each logical position (or [B, T, Lc], a table per query),
    ``positions`` [B, T]; returns [B, T, Hq, D]."""
    B, T, Hq, D = q.shape
    Hkv = k_pool.shape[1]
    g = Hq // Hkv
    qf = q.float() * scale
    per_query = slots.dim() == 3  # then each (b, t) gathers its own keys
    m = torch.full((B, T, Hq), float("-inf"), device=q.device)
    l = torch.zeros(B, T, Hq, device=q.device)
    acc = torch.zeros(B, T, Hq, D, device=q.device)
    top = int(positions.max()) + 1 if positions.numel() else 0
    for start in range(0, top, BLOCK_L):
        j = torch.arange(start, start + BLOCK_L, device=q.device)  # [L]
        valid = j.view(1, 1, -1) <= positions.unsqueeze(-1)  # [B, T, L]
        slot = slots[..., j.clamp_max(slots.shape[-1] - 1)]  # [B, L] or [B, T, L]
        k = k_pool[slot].float().repeat_interleave(g, dim=-2)  # [B, (T,) L, Hq, D]
        v = v_pool[slot].float().repeat_interleave(g, dim=-2)
        s = torch.einsum("bthd,btlhd->bthl" if per_query else "bthd,blhd->bthl", qf, k)
        s = s.masked_fill(~valid.unsqueeze(2), float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new).nan_to_num(0.0)  # rows with no key yet: -inf - -inf
        p = torch.exp(s - m_new.unsqueeze(-1)).nan_to_num(0.0)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha.unsqueeze(-1) + torch.einsum("bthl,btlhd->bthd" if per_query else "bthl,blhd->bthd", p, v)
        m = m_new
    return (acc / l.clamp_min(1e-30).unsqueeze(-1)).to(q.dtype)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                    positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``q`` [B, T, Hq, D] at ``positions`` [B, T] over the paged
    context (the keys at logical positions 0..position, in pool slots ``slots`` [B, Lc],
    or [B, T, Lc] with a table per query); every query's output is independent of the
    other queries in the call."""
    if not use_triton(q):
        return paged_attention_torch(q, k_pool, v_pool, slots, positions, scale)
    B, T, Hq, D = q.shape
    assert D == triton.next_power_of_2(D), "batch-invariant attention needs a power-of-two head dim"
    q = q.contiguous()
    out = torch.empty_like(q)
    _attention_kernel[(B * T, Hq)](q, k_pool, v_pool, slots.contiguous(), positions.contiguous(), out, T,
                                   slots.shape[-1], float(scale), HQ=Hq, HKV=k_pool.shape[1], D=D, BL=BLOCK_L,
                                   PER_QUERY=slots.dim() == 3, num_warps=4)
    return out


__all__ = ["BLOCK_L", "BLOCK_M", "linear", "linear_torch", "paged_attention", "paged_attention_torch"]
