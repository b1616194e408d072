"""Fused GPU kernels (Triton) with plain-torch twins for CPU and for checking.

- ``add_rmsnorm``: optional residual add, then RMSNorm (one kernel instead of ~8).
- ``rope_write_kv``: rotary embedding of q and k, and the write of k and v into the paged
  pools at their slots (one kernel instead of ~12).
- ``silu_mul``: the gated MLP's ``silu(gate) * up`` from the fused gate/up projection
  (one kernel instead of two).
- ``topk_logprobs``: the log-probabilities and ids of a head's ``k`` best tokens, what each
  level of a drafted token tree chooses from (two kernels: ``torch.topk`` after a
  ``log_softmax`` took 55-80 us per call on the H200 whatever the shape, ~40% of a tree's
  drafting; docs/benchmarks.md, seventeenth session); ``topk`` the same without the
  logsumexp, for a dynamic tree's frontiers and nodes.
- ``greedy_tree_path``: greedy verification of a token tree, the accepted path and the
  tokens emitted (one kernel instead of ~25; see :mod:`speculum.verifiers.tree`).
- ``greedy_chain_verdict``: greedy verification of a chain after the argmax, the accepted
  count and the tokens emitted side by side in one tensor (one kernel instead of five, and
  none to join them for the copy to the host; see :mod:`speculum.verifiers.greedy`): an
  eager launch costs the host 17-30 us in a step on the H200 machine (docs/benchmarks.md,
  nineteenth session).

Fewer launches matter because small-model steps are launch-bound even inside CUDA
graphs. The torch versions define the semantics; tests compare the two on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from speculum.proposers.tree import topk_stable

try:  # Triton ships with CUDA builds of torch; CPU builds have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU CI
    triton = None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [..., D] (``cos``/``sin`` broadcast to it)."""
    return x * cos + rotate_half(x) * sin


def rmsnorm_torch(x, weight, eps):
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def add_rmsnorm_torch(x, residual, weight, eps):
    """Returns (norm(x + residual), x + residual); residual None means just x."""
    h = x if residual is None else x + residual
    return rmsnorm_torch(h, weight, eps), h


def rope_write_kv_torch(q, k, v, cos, sin, write_slots, k_pool, v_pool):
    """q: [B, t, Hq, D], k/v: [B, t, Hkv, D], cos/sin: [B, t, 1, D]; returns roped q."""
    B, t, nkv, d = k.shape
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_pool.index_copy_(0, write_slots.reshape(-1), k.reshape(B * t, nkv, d))
    v_pool.index_copy_(0, write_slots.reshape(-1), v.reshape(B * t, nkv, d))
    return q


def silu_mul_torch(gu: torch.Tensor, inter: int) -> torch.Tensor:
    g, u = gu.split(inter, dim=-1)
    return F.silu(g) * u


def topk_logprobs_torch(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs float32, ids int64) of the ``k`` best tokens of logits [..., V]."""
    return logits.float().log_softmax(dim=-1).topk(k, dim=-1)


#: vocabulary entries per program of the first top-k kernel, and the largest k it serves
TOPK_CHUNK, TOPK_MAX_K = 1024, 32


if triton is not None:

    @triton.jit
    def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, N, eps,
                            HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        m = offs < N
        x = tl.load(x_ptr + row * N + offs, mask=m, other=0.0)
        if HAS_RES:
            x = x + tl.load(res_ptr + row * N + offs, mask=m, other=0.0)
            tl.store(h_ptr + row * N + offs, x, mask=m)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / N
        y = (xf * tl.rsqrt(var + eps)).to(x.dtype)
        w = tl.load(w_ptr + offs, mask=m, other=0.0)
        tl.store(out_ptr + row * N + offs, (y * w).to(x.dtype), mask=m)

    @triton.jit
    def _rope_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, k_ptr, v_ptr, q_ptr,
                        NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr):
        tok = tl.program_id(0)
        head = tl.program_id(1)
        stride = (NQ + 2 * NKV) * D
        base = qkv_ptr + tok * stride + head * D
        if head < NQ + NKV:
            offs = tl.arange(0, HALF)
            c = tl.load(cos_ptr + tok * D + offs).to(tl.float32)
            s = tl.load(sin_ptr + tok * D + offs).to(tl.float32)
            x1 = tl.load(base + offs).to(tl.float32)
            x2 = tl.load(base + HALF + offs).to(tl.float32)
            o1 = x1 * c - x2 * s
            o2 = x2 * c + x1 * s
            if head < NQ:
                dst = q_ptr + (tok * NQ + head) * D
            else:
                slot = tl.load(slot_ptr + tok)
                dst = k_ptr + (slot * NKV + (head - NQ)) * D
            tl.store(dst + offs, o1.to(q_ptr.dtype.element_ty))
            tl.store(dst + HALF + offs, o2.to(q_ptr.dtype.element_ty))
        else:
            offs_d = tl.arange(0, D)
            slot_v = tl.load(slot_ptr + tok)
            tl.store(v_ptr + (slot_v * NKV + (head - NQ - NKV)) * D + offs_d, tl.load(base + offs_d))

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, N, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        g = tl.load(gu_ptr + row * 2 * N + offs, mask=m, other=0.0)
        u = tl.load(gu_ptr + row * 2 * N + N + offs, mask=m, other=0.0)
        g32 = g.to(tl.float32)
        s = (g32 / (1.0 + tl.exp(-g32))).to(g.dtype)  # rounded where torch's silu rounds
        tl.store(out_ptr + row * N + offs, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=m)


if triton is not None:

    @triton.jit
    def _take_best(x, taken, lanes, BLOCK: tl.constexpr):
        # the best value not taken yet and its lane (the lowest on ties; never a taken lane
        # while one is left, even among -inf values)
        best = tl.max(tl.where(taken, float("-inf"), x), axis=0)
        at = tl.min(tl.where((x == best) & ~taken, lanes, BLOCK), axis=0)
        return best, at

    @triton.jit
    def _topk_chunk_kernel(x_ptr, v_ptr, i_ptr, m_ptr, s_ptr, V, C, K: tl.constexpr, BLOCK: tl.constexpr,
                           NORM: tl.constexpr):
        # one program per (row, chunk of BLOCK entries): the chunk's k best (value, index),
        # best first, and (NORM) its max and sum of exp(x - max) for the row's logsumexp
        row = tl.program_id(0)
        c = tl.program_id(1)
        lanes = tl.arange(0, BLOCK)
        offs = c * BLOCK + lanes
        valid = offs < V
        x = tl.load(x_ptr + row.to(tl.int64) * V + offs, mask=valid, other=float("-inf")).to(tl.float32)
        if NORM:
            mx = tl.max(x, axis=0)
            tl.store(m_ptr + row * C + c, mx)
            tl.store(s_ptr + row * C + c, tl.sum(tl.where(valid, tl.exp(x - mx), 0.0), axis=0))
        taken = ~valid
        out = (row * C + c) * K
        for j in tl.static_range(K):
            best, at = _take_best(x, taken, lanes, BLOCK)
            tl.store(v_ptr + out + j, best)
            tl.store(i_ptr + out + j, tl.minimum(c * BLOCK + at, V - 1).to(tl.int64))
            taken = taken | (lanes == at)

    @triton.jit
    def _topk_merge_kernel(v_ptr, i_ptr, m_ptr, s_ptr, lp_ptr, id_ptr, C, K: tl.constexpr, CB: tl.constexpr,
                           CKB: tl.constexpr, NORM: tl.constexpr):
        # one program per row: the k best of its chunks' candidates (NORM: minus the row's
        # logsumexp)
        row = tl.program_id(0)
        lse = 0.0
        if NORM:
            cs = tl.arange(0, CB)
            cm = cs < C
            m = tl.load(m_ptr + row * C + cs, mask=cm, other=float("-inf"))
            top = tl.max(m, axis=0)
            lse = top + tl.log(tl.sum(tl.where(cm, tl.load(s_ptr + row * C + cs, mask=cm, other=0.0)
                                               * tl.exp(m - top), 0.0), axis=0))
        lanes = tl.arange(0, CKB)
        lm = lanes < C * K
        v = tl.load(v_ptr + row * C * K + lanes, mask=lm, other=float("-inf"))
        ids = tl.load(i_ptr + row * C * K + lanes, mask=lm, other=0)
        taken = ~lm
        for j in tl.static_range(K):
            best, at = _take_best(v, taken, lanes, CKB)
            tl.store(lp_ptr + row * K + j, best - lse)
            tl.store(id_ptr + row * K + j, tl.sum(tl.where(lanes == at, ids, 0), axis=0))
            taken = taken | (lanes == at)


#: the largest tree (nodes + root) greedy verification takes in one program; larger trees
#: run the eager twin
GREEDY_TREE_MAX = 128

if triton is not None:

    @triton.jit(do_not_specialize=["N"])  # (a tree's size varies: no variant compiled mid-run for 1 or 16)
    def _greedy_tree_kernel(am_ptr, tok_ptr, par_ptr, anc_ptr, dep_ptr, rows_ptr, N, BLOCK: tl.constexpr):
        # one program per row. Node j matches when it drafted the target's argmax after its
        # parent; node i qualifies when all its ancestors (itself included) match, i.e. when
        # the matches among them number its depth; the deepest, then earliest, wins
        b = tl.program_id(0).to(tl.int64)
        r = tl.arange(0, BLOCK)  # as rows: nodes i, or output positions s
        c = tl.arange(0, BLOCK)[None, :]  # as columns: nodes j
        cm = c < N
        rm = r < N
        tok_c = tl.load(tok_ptr + b * N + c, mask=cm, other=-1)
        par_c = tl.load(par_ptr + b * N + c, mask=cm, other=-1)
        match_c = cm & (tok_c >= 0) & (tok_c == tl.load(am_ptr + b * (N + 1) + par_c + 1, mask=cm, other=-1))
        dep_c = tl.load(dep_ptr + b * N + c, mask=cm, other=0)
        dep_r = tl.load(dep_ptr + b * N + r, mask=rm, other=0)
        anc = tl.load(anc_ptr + b * N * N + r[:, None] * N + c, mask=rm[:, None] & cm, other=0) != 0
        hits = tl.sum((anc & match_c).to(tl.int32), axis=1)
        score = tl.where(rm & (dep_r > 0) & (hits == dep_r), dep_r * (N + 1) - r, 0)
        top = tl.max(score, axis=0)
        best = tl.min(tl.where(score == top, r, BLOCK), axis=0)
        found = top > 0
        acc = tl.where(found, tl.sum(tl.where(r == best, dep_r, 0), axis=0), 0)
        on_c = found & cm & (tl.load(anc_ptr + b * N * N + best * N + c, mask=cm, other=0) != 0)
        # row b of the output: [count | tokens emitted (N + 1) | path (N)]
        acc_ptr = rows_ptr + b * (2 * N + 2)
        out_ptr = acc_ptr + 1
        path_ptr = acc_ptr + N + 2
        # the path: slot s holds the accepted node of depth s + 1 (-1 past the accepted count)
        tl.store(path_ptr + r, tl.max(tl.where(on_c & (dep_c - 1 == r[:, None]), c, -1), axis=1), mask=rm)
        # emitted s: the argmax at the root (s = 0), else after the accepted node of depth s
        prev = tl.max(tl.where(on_c & (dep_c == r[:, None]), c, -1), axis=1)
        keep = r <= acc
        col = tl.where(r == 0, 0, prev + 1)
        emitted = tl.load(am_ptr + b * (N + 1) + col, mask=keep & (r <= N), other=-1)
        tl.store(out_ptr + r, tl.where(keep, emitted, -1), mask=r <= N)
        tl.store(acc_ptr, acc)


def greedy_tree_path(am: torch.Tensor, token_ids: torch.Tensor, parents: torch.Tensor, anc: torch.Tensor,
                     depth: torch.Tensor) -> torch.Tensor | None:
    """Greedy tree verification in one kernel: what
    :func:`speculum.verifiers.tree.greedy_path` computes, as one int64 tensor
    [B, 1 + (N+1) + N] per row: the accepted count, the tokens emitted, the accepted nodes
    root first (-1 padded) (:meth:`speculum.interfaces.Verdict.from_rows` with ``path_width
    = N``), from the argmax ``am`` [B, N+1], node tokens, parents and depths [B, N] and
    ancestors [B, N, N]; None where it does not apply (no CUDA, or more than
    ``GREEDY_TREE_MAX - 1`` nodes): the caller runs the twin. One launch instead of ~25
    small kernels (or a graph replay and its copies) after every tree verify forward, and
    none to join its outputs for the copy to the host."""
    B, N = token_ids.shape
    if not use_triton(am) or not 0 < N < GREEDY_TREE_MAX:
        return None
    rows = torch.empty(B, 2 * N + 2, dtype=torch.int64, device=am.device)
    block = triton.next_power_of_2(N + 1)
    _greedy_tree_kernel[(B,)](am.contiguous(), token_ids.contiguous(), parents.contiguous(),
                              anc.contiguous().view(torch.uint8), depth.contiguous(), rows, N,
                              BLOCK=block, num_warps=4 if block <= 64 else 8)
    return rows


if triton is not None:

    @triton.jit(do_not_specialize=["K"])  # (k drops near a request's end: no variant compiled mid-run for 1)
    def _greedy_chain_kernel(am_ptr, d_ptr, out_ptr, K, BLOCK: tl.constexpr):
        # one program per row: draft r is accepted when it and every draft before it equal the
        # argmax at their positions; the count is the first r that fails (r = K always does),
        # and the argmax is emitted up to and including that position. Row b of the output is
        # [count, tokens...] (K + 2 int64)
        b = tl.program_id(0).to(tl.int64)
        r = tl.arange(0, BLOCK)
        am = tl.load(am_ptr + b * (K + 1) + r, mask=r <= K, other=-1)
        d = tl.load(d_ptr + b * K + r, mask=r < K, other=-1)
        miss = (r >= K) | (d < 0) | (d != am)
        acc = tl.min(tl.where(miss, r, BLOCK), axis=0)
        tl.store(out_ptr + b * (K + 2) + 1 + r, tl.where(r <= acc, am, -1), mask=r <= K)
        tl.store(out_ptr + b * (K + 2), acc.to(tl.int64))


#: the longest chain :func:`greedy_chain_verdict` takes (drafts + 1); longer ones run the twin
GREEDY_CHAIN_MAX = 1024


def greedy_chain_verdict(am: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor | None:
    """Greedy chain verification in one kernel: what :func:`speculum.verifiers.greedy.greedy_verify`
    computes after the argmax ``am`` [B, k+1] and the drafts [B, k] (int64, -1 padded; k may
    be 0), as one int64 tensor [B, 1 + k+1] per row: the accepted count, then the tokens
    emitted (the accepted drafts, the argmax at the first mismatch, -1 after):
    :meth:`speculum.interfaces.Verdict.from_rows`. The count and the tokens side by side let
    the loop copy the verdict to the host with no launch to join them. None where it does not
    apply (no CUDA, chains longer than ``GREEDY_CHAIN_MAX``): the caller runs the twin."""
    B, K1 = am.shape
    if not use_triton(am) or not 0 < K1 <= GREEDY_CHAIN_MAX:
        return None
    out = torch.empty(B, K1 + 1, dtype=torch.int64, device=am.device)
    am = am.contiguous()
    # (no drafts: the argmax stands in for their pointer, which nothing reads; an empty
    # tensor's may be null)
    _greedy_chain_kernel[(B,)](am, drafts.contiguous() if K1 > 1 else am, out, K1 - 1,
                               BLOCK=max(2, triton.next_power_of_2(K1)))
    return out


def wants_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records an op on ``tensors`` (None entries ignored)."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


def use_triton(t: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """The fused kernel for ``t`` (and the other inputs ``others``): on CUDA, and only where
    no gradient is wanted (the kernels have no backward: a head trained through one would
    silently freeze the weights before it)."""
    return triton is not None and t.is_cuda and not wants_grad(t, *others)


def add_rmsnorm(x, residual, weight, eps):
    """(norm(x + residual), x + residual), fused on CUDA."""
    if not use_triton(x, residual, weight):
        return add_rmsnorm_torch(x, residual, weight, eps)
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    out = torch.empty_like(x2)
    if residual is None:
        _add_rmsnorm_kernel[(x2.shape[0],)](x2, x2, weight, out, x2, N, eps, HAS_RES=False,
                                            BLOCK=triton.next_power_of_2(N))
        return out.view_as(x), x
    h = torch.empty_like(x2)
    _add_rmsnorm_kernel[(x2.shape[0],)](x2, residual.reshape(-1, N), weight, out, h, N, eps, HAS_RES=True,
                                        BLOCK=triton.next_power_of_2(N))
    return out.view_as(x), h.view_as(x)


def silu_mul(gu: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate) * up`` of ``gu`` [..., 2 * inter] (gate first), fused on CUDA."""
    if not use_triton(gu):
        return silu_mul_torch(gu, inter)
    g2 = gu.reshape(-1, 2 * inter).contiguous()
    out = torch.empty(g2.shape[0], inter, dtype=gu.dtype, device=gu.device)
    _silu_mul_kernel[(g2.shape[0], triton.cdiv(inter, 1024))](g2, out, inter, BLOCK=1024)
    return out.view(*gu.shape[:-1], inter)


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs float32, ids int64) of the ``k`` best tokens of logits [..., V], best
    first: ``log_softmax`` then ``topk`` (:func:`topk_logprobs_torch`), fused on CUDA into two
    kernels (each chunk's k best and its share of the logsumexp, then the row's k best
    of those). Ties go to the lower id there; ``torch.topk`` leaves their order open."""
    if not use_triton(logits) or not 0 < k <= min(TOPK_MAX_K, logits.shape[-1]):
        return topk_logprobs_torch(logits, k)
    return _fused_topk(logits, k, norm=True)


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values float32, indices int64) of the ``k`` largest of ``x`` [..., n], ties to the
    lower index (a stable descending sort's order, :func:`speculum.proposers.tree.topk_stable`),
    fused on CUDA (the top-k kernels without the logsumexp)."""
    if not use_triton(x) or not 0 < k <= min(TOPK_MAX_K, x.shape[-1]):
        v, i = topk_stable(x, k)
        return v.float(), i
    return _fused_topk(x, k, norm=False)


def _fused_topk(x: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    V = x.shape[-1]
    x2 = x.reshape(-1, V).contiguous()
    R, C = x2.shape[0], triton.cdiv(V, TOPK_CHUNK)
    block = min(TOPK_CHUNK, triton.next_power_of_2(V))
    v = torch.empty(R, C, k, dtype=torch.float32, device=x.device)
    i = torch.empty(R, C, k, dtype=torch.int64, device=x.device)
    m = torch.empty(R, C if norm else 1, dtype=torch.float32, device=x.device)
    s = torch.empty_like(m)
    _topk_chunk_kernel[(R, C)](x2, v, i, m, s, V, C, K=k, BLOCK=block, NORM=norm)
    out = torch.empty(R, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(R, k, dtype=torch.int64, device=x.device)
    _topk_merge_kernel[(R,)](v, i, m, s, out, ids, C, K=k, CB=triton.next_power_of_2(C),
                             CKB=triton.next_power_of_2(C * k), NORM=norm)
    return out.view(*x.shape[:-1], k), ids.view(*x.shape[:-1], k)


def rope_write_kv(qkv, nq, nkv, d, cos, sin, write_slots, k_pool, v_pool):
    """Split fused ``qkv`` [B, t, (Hq+2Hkv)*D], rope q and k, write k/v; returns q [B, t, Hq, D]."""
    B, t, _ = qkv.shape
    if not use_triton(qkv, cos, sin):
        qh, kh, vh = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
        return rope_write_kv_torch(qh.view(B, t, nq, d), kh.view(B, t, nkv, d), vh.view(B, t, nkv, d),
                                   cos, sin, write_slots, k_pool, v_pool)
    q = torch.empty(B, t, nq, d, dtype=qkv.dtype, device=qkv.device)
    _rope_kv_kernel[(B * t, nq + 2 * nkv)](qkv.contiguous(), cos.contiguous(), sin.contiguous(),
                                           write_slots.reshape(-1).contiguous(), k_pool, v_pool, q,
                                           NQ=nq, NKV=nkv, D=d, HALF=d // 2)
    return q
