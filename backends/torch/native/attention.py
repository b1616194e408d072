"""Attention over the paged KV cache for decode and verify steps.

Two implementations of one semantics: query token ``t`` of row ``b`` at position
``positions[b, t]`` attends to the keys at logical positions ``0..positions[b, t]`` (or,
with a token tree, to those its ``mask`` row allows), read through ``slots`` [B, Lc],
the pool slot of each logical position.

- :func:`paged_decode_attention` (CUDA, up to :data:`MAX_QUERY` query tokens per row):
  one Triton kernel that reads keys and values through the slots itself (no gathered
  copy of the context) and handles the query tokens and the query heads that share a
  KV head as the rows of one tile, with the context split across programs
  (flash-decoding) and a second small kernel combining the splits. Its cost hardly
  depends on the number of query tokens: a verify step of 2-33 tokens costs what a
  decode step costs (cuDNN's fused attention, used before, switched from a fast
  decode kernel at 1 query token to a prefill kernel from 2 on, +14 us per layer on the
  H200; ``scripts/device/profile_step.py``).
- :func:`sdpa_attention` (CPU, prefill chunks, head dims that are not powers of two):
  gathers the context and calls ``scaled_dot_product_attention`` with a boolean mask.

Prefill chunks change shape nearly every call, so every SDPA call here goes through
:func:`sdpa`, which leaves cuDNN's fused attention out: cuDNN builds an execution plan for
each new shape, about 2.3 ms of host time per call on average over a batched generation's
prefills on the H200 (2026-12-03, ``scripts/device/profile_generation.py``; docs/benchmarks.md).

``SPECULUM_ATTENTION=sdpa`` in the environment (read when a forward is captured or run eagerly) sends decode and
verify steps down the SDPA path too: the "before" of benchmarks, and a way around a
kernel problem on an unusual GPU.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F

from speculum.backends.torch.native.kernels import triton, use_triton
from speculum.tree import TreeMask

if triton is not None:
    import triton.language as tl

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    #: SDPA's kernels for shapes that change from call to call: cuDNN's plans are per shape
    NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
except ImportError:  # an older torch: its SDPA has no cuDNN kernel to avoid
    sdpa_kernel = None

#: query tokens per row up to which decode and verify steps take the Triton kernel
MAX_QUERY = 64
#: keys per inner iteration
BLOCK_N = 64
#: programs the split of the context aims at (an H200 has 132 SMs)
TARGET_PROGRAMS = 264


def no_cudnn_attention(device: torch.device | str) -> contextlib.AbstractContextManager:
    """SDPA's kernels without cuDNN's on a CUDA ``device`` (the module doc says why); elsewhere
    a context that changes nothing. The transformers runner runs its models' forwards in it."""
    if sdpa_kernel is None or torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(NO_CUDNN)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` without cuDNN's kernel on CUDA (the module doc says why)."""
    with no_cudnn_attention(q.device):
        return F.scaled_dot_product_attention(q, k, v, **kw)


def causal_mask(positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[B, 1, q, Lc] bool: key position ``j`` is visible to a query at position ``p`` iff ``j <= p``."""
    ar = torch.arange(num_keys, device=positions.device).view(1, 1, 1, num_keys)
    return ar <= positions.unsqueeze(1).unsqueeze(-1)


def sdpa_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                   mask: torch.Tensor | TreeMask, scale: float) -> torch.Tensor:
    """``q`` [B, T, Hq, D], pools [slots, Hkv, D], ``slots`` [B, Lc], ``mask`` [B, 1, T, Lc]
    (or a :class:`~speculum.tree.TreeMask`, spelled out here) -> [B, T, Hq, D], through a
    gathered copy of the context."""
    B, T, Hq, D = q.shape
    Lc, Hkv = slots.shape[1], k_pool.shape[1]
    if isinstance(mask, TreeMask):
        mask = mask.dense(Lc)
    flat = slots.reshape(-1)  # index_select: the same copy as k_pool[slots], 4x faster on a CPU
    kc = k_pool.index_select(0, flat).view(B, Lc, Hkv, D).transpose(1, 2)  # [B, Hkv, Lc, D]
    vc = v_pool.index_select(0, flat).view(B, Lc, Hkv, D).transpose(1, 2)
    gqa = Hq != Hkv
    if gqa and q.device.type == "cuda":  # the memory-efficient kernel (a mask: not flash) reads no grouped heads
        kc, vc, gqa = kc.repeat_interleave(Hq // Hkv, dim=1), vc.repeat_interleave(Hq // Hkv, dim=1), False
    out = sdpa(q.transpose(1, 2), kc, vc, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)


def fresh_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, write_slots: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """The first prefill chunk of sequences with no earlier context: causal attention over
    the chunk's own keys (just written at ``write_slots`` [B, T]), ``q`` [B, T, Hq, D] ->
    [B, T, Hq, D]. No gathered context of the block-table width and no mask, so SDPA takes
    its flash kernel (:func:`sdpa`: not cuDNN's). Right padding is harmless: a padded key sits after every real query."""
    B, T, Hq, D = q.shape
    Hkv = k_pool.shape[1]
    flat = write_slots.reshape(-1)
    k = k_pool.index_select(0, flat).view(B, T, Hkv, D)
    v = v_pool.index_select(0, flat).view(B, T, Hkv, D)
    if Hq != Hkv:  # query head h reads KV head h // (Hq / Hkv)
        k, v = k.repeat_interleave(Hq // Hkv, dim=2), v.repeat_interleave(Hq // Hkv, dim=2)
    out = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale)
    return out.transpose(1, 2)


def use_decode_kernel(q: torch.Tensor, num_query: int, head_dim: int) -> bool:
    """Whether a forward of ``num_query`` tokens per row takes :func:`paged_decode_attention`."""
    return (use_triton(q) and num_query <= MAX_QUERY and head_dim >= 16 and head_dim & (head_dim - 1) == 0
            and os.environ.get("SPECULUM_ATTENTION", "triton") != "sdpa")


def _split(B: int, Hkv: int, row_tiles: int, Lc: int) -> tuple[int, int]:
    """(splits, keys per split) of a context of ``Lc`` keys: enough programs to fill the
    GPU at small batches, one split when the batch fills it already."""
    blocks = triton.cdiv(Lc, BLOCK_N)
    want = max(1, TARGET_PROGRAMS // max(1, B * Hkv * row_tiles))
    per = triton.cdiv(blocks, min(blocks, want))
    return triton.cdiv(blocks, per), per * BLOCK_N


if triton is not None:

    @triton.jit(do_not_specialize=["Lc", "chunk"])
    def _decode_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, pos_ptr, mask_ptr, base_ptr, o_ptr, m_ptr, l_ptr, acc_ptr,
                       T, Lc, K, chunk, scale, NSPLIT,
                       HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BR: tl.constexpr,
                       BN: tl.constexpr, HAS_MASK: tl.constexpr, HAS_TREE: tl.constexpr, HAS_POS: tl.constexpr,
                       DIRECT: tl.constexpr, PREC: tl.constexpr):
        G: tl.constexpr = HQ // HKV
        bk = tl.program_id(0)  # b * HKV + kv head
        split = tl.program_id(1)
        tile = tl.program_id(2)
        b = bk // HKV
        kvh = bk % HKV
        r = tile * BR + tl.arange(0, BR)  # rows: (query token, head of the group)
        t = r // G
        h = kvh * G + r % G
        live = t < T
        d = tl.arange(0, D)
        q_off = ((b * T + t) * HQ + h) * D
        q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=live[:, None], other=0.0)
        pos = tl.load(pos_ptr + b * T + t, mask=live, other=-1)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, Lc)
        base = 0
        if HAS_TREE:  # a compact tree mask (TreeMask): no key past the tree's K
            base = tl.load(base_ptr + b)
            hi = tl.minimum(hi, base + K)
        elif not HAS_MASK:  # no key past the last query's position (tree nodes sit past theirs)
            hi = tl.minimum(hi, tl.max(pos, axis=0) + 1)
        elif HAS_POS:  # a verify forward's tree: its T keys follow the root, and every
            hi = tl.minimum(hi, tl.max(pos, axis=0) + T)  # query's position is >= the root's
        m = tl.full((BR,), -1.0e30, tl.float32)
        l = tl.zeros((BR,), tl.float32)
        acc = tl.zeros((BR, D), tl.float32)
        qk_scale = scale * 1.4426950408889634  # exp2
        for start in range(lo, hi, BN):
            j = start + tl.arange(0, BN)
            inb = j < hi
            slot = tl.load(slots_ptr + b * Lc + j, mask=inb, other=0)
            kv_off = (slot * HKV + kvh) * D
            k = tl.load(k_ptr + kv_off[:, None] + d[None, :], mask=inb[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # [BR, BN]
            if HAS_TREE:  # context before the tree's base; inside it, the query's row of vis
                rel = j[None, :] - base
                seen = tl.load(mask_ptr + (b * T + t)[:, None] * K + rel,
                               mask=live[:, None] & inb[None, :] & (rel >= 0) & (rel < K), other=0) != 0
                vis = (rel < 0) | seen
            elif HAS_MASK:
                vis = tl.load(mask_ptr + (b * T + t)[:, None] * Lc + j[None, :],
                              mask=live[:, None] & inb[None, :], other=0) != 0
            else:
                vis = j[None, :] <= pos[:, None]
            vis = vis & inb[None, :] & live[:, None]
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            l = l * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + kv_off[:, None] + d[None, :], mask=inb[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m = m_new
        if DIRECT:
            out = acc / tl.maximum(l, 1e-30)[:, None]
            tl.store(o_ptr + q_off[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty), mask=live[:, None])
        else:  # partials [B * HKV, NSPLIT, rows, ...], combined by _combine_kernel
            row = (bk * NSPLIT + split) * (T * G) + r
            tl.store(m_ptr + row, m, mask=live)
            tl.store(l_ptr + row, l, mask=live)
            # a row that saw no key keeps m = -1e30 and its acc is never read: not written
            tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=(live & (m > -1.0e29))[:, None])

    @triton.jit
    def _combine_kernel(o_ptr, m_ptr, l_ptr, acc_ptr, T, NSPLIT,
                        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, SP: tl.constexpr):
        G: tl.constexpr = HQ // HKV
        bk = tl.program_id(0)
        r = tl.program_id(1)  # row of the group: (query token, head)
        t = r // G
        h = (bk % HKV) * G + r % G
        b = bk // HKV
        s = tl.arange(0, SP)
        ok = s < NSPLIT
        row = (bk * NSPLIT + s) * (T * G) + r
        m = tl.load(m_ptr + row, mask=ok, other=-1.0e30)
        l = tl.load(l_ptr + row, mask=ok, other=0.0)
        d = tl.arange(0, D)
        seen = ok & (m > -1.0e29)  # splits past the row's keys wrote no acc (weight 0 anyway)
        acc = tl.load(acc_ptr + row[:, None] * D + d[None, :], mask=seen[:, None], other=0.0)
        w = tl.exp2(m - tl.max(m, axis=0))
        out = tl.sum(acc * w[:, None], axis=0) / tl.maximum(tl.sum(l * w, axis=0), 1e-30)
        tl.store(o_ptr + ((b * T + t) * HQ + h) * D + d, out.to(o_ptr.dtype.element_ty))


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                           positions: torch.Tensor | None, scale: float,
                           mask: torch.Tensor | TreeMask | None = None) -> torch.Tensor:
    """The Triton path of the module doc: ``q`` [B, T, Hq, D] at ``positions`` [B, T];
    ``mask`` [B, 1, T, Lc] (a draft head's) or a compact :class:`~speculum.tree.TreeMask`
    (a token tree's: no key past its ``base + K`` is read) replaces the causal rule, and
    then ``positions`` may be None. With a dense mask and positions (its ``T`` keys follow
    the root, every query's position is the root's or past it) no key past
    ``max(positions) + T`` is read. Returns [B, T, Hq, D]."""
    B, T, Hq, D = q.shape
    Lc, Hkv = slots.shape[1], k_pool.shape[1]
    G = Hq // Hkv
    q = q.contiguous()
    out = torch.empty_like(q)
    rows = T * G
    br = min(64, max(16, triton.next_power_of_2(rows)))
    tiles = triton.cdiv(rows, br)
    nsplit, chunk = _split(B, Hkv, tiles, Lc)
    direct = nsplit == 1
    if direct:
        m = l = acc = out  # unused
    else:
        m = torch.empty(B * Hkv * nsplit * rows, dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        acc = torch.empty(B * Hkv * nsplit * rows, D, dtype=torch.float32, device=q.device)
    tree = mask if isinstance(mask, TreeMask) else None
    has_mask = mask is not None and tree is None
    if mask is None and positions is None:
        raise ValueError("paged_decode_attention needs positions or a mask")
    K, base, mk = 0, slots, slots  # (unread unless a mask asks)
    if tree is not None:
        K, base, mk = tree.vis.shape[-1], tree.base.contiguous(), tree.vis.contiguous().view(torch.uint8)
    elif has_mask:
        mk = mask.reshape(B, T, Lc).contiguous().view(torch.uint8)
    has_pos = positions is not None
    positions = slots if positions is None else positions.contiguous()  # unread without positions
    _decode_kernel[(B * Hkv, nsplit, tiles)](
        q, k_pool, v_pool, slots.contiguous(), positions, mk, base, out, m, l, acc, T, Lc, K, chunk,
        float(scale), nsplit, HQ=Hq, HKV=Hkv, D=D, BR=br, BN=BLOCK_N, HAS_MASK=has_mask, HAS_TREE=tree is not None,
        HAS_POS=has_pos, DIRECT=direct, PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4)
    if not direct:
        _combine_kernel[(B * Hkv, rows)](out, m, l, acc, T, nsplit, HQ=Hq, HKV=Hkv, D=D,
                                         SP=triton.next_power_of_2(nsplit), num_warps=1)
    return out


__all__ = ["MAX_QUERY", "causal_mask", "no_cudnn_attention", "paged_decode_attention", "sdpa", "sdpa_attention", "use_decode_kernel"]
