"""The device lookup of :mod:`speculum_ngram.device` as one Triton kernel.

Run as torch ops, drafting from the verdict launched 43 kernels a step (133 with a corpus):
on the H200 the host spent 0.25-0.77 ms launching them, before the next verify forward
could be launched, and the step got no faster than the host lookup (docs/benchmarks.md,
twenty-sixth session). One program per row here does all of it: appends the verdict's
tokens to the row's history, finds the latest earlier occurrence of the longest matching
suffix (scanning the history in blocks), cuts its continuation at the sequence's end and,
where the request has no match, searches the corpus's tables (one lane per n-gram length,
a binary search each, the longest hit wins). :func:`speculum_ngram.device.suffix_match`
and :meth:`~speculum_ngram.corpus.DeviceCorpus.lookup` define what it computes (tests
compare them on a GPU, and on a CPU through Triton's interpreter).
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; CPU builds have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU CI
    triton = None

if triton is not None:

    # the ints vary from step to step (a verify of fewer tokens near a request's end, longer
    # history rows): Triton would compile a variant of the kernel for each that is 1 or a
    # multiple of 16, in the middle of a run (seconds, the first time on a machine)
    @triton.jit(do_not_specialize=["HS", "VS", "q", "K", "n_min", "window", "DEPTH"])
    def _ngram_draft_kernel(hist_ptr, HS, rows_ptr, base_ptr, v_ptr, VS, q, out_ptr, cnt_out_ptr, K, n_min, window,
                            hs_ptr, grams_ptr, cont_ptr, off_ptr, cnt_ptr, pw_ptr, DEPTH,
                            N_MAX: tl.constexpr, NP2: tl.constexpr, KB: tl.constexpr, QB: tl.constexpr,
                            BLOCK: tl.constexpr, CORPUS: tl.constexpr, C_MIN: tl.constexpr, C_NUM: tl.constexpr,
                            CP2: tl.constexpr, STEPS: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        row = hist_ptr + tl.load(rows_ptr + b) * HS
        base = tl.load(base_ptr + b)
        L = base + tl.load(v_ptr + b * VS) + 1  # the verdict row: count, then the tokens
        qi = tl.arange(0, QB)
        tl.store(row + base + qi, tl.load(v_ptr + b * VS + 1 + qi, mask=qi < q, other=-1), mask=qi < q)
        tl.debug_barrier()
        jj = tl.arange(0, NP2)
        sv = tl.load(row + L - 1 - jj, mask=(jj < N_MAX) & (L - 1 - jj >= 0), other=-2)  # newest first
        cap = tl.minimum(L - 1, N_MAX)
        if window > 0:
            cap = tl.minimum(cap, tl.minimum(L, window) - 1)
        best = tl.full((), -1, tl.int64)
        for start in range(0, L - 1, BLOCK):
            e = start + tl.arange(0, BLOCK).to(tl.int64)
            inside = e <= L - 2
            m = tl.zeros((BLOCK,), tl.int64)
            alive = inside
            for j in tl.static_range(N_MAX):
                s_j = tl.sum(tl.where(jj == j, sv, 0), axis=0)
                t = tl.load(row + e - j, mask=inside & (e - j >= 0), other=-3)
                alive = alive & (e - j >= 0) & (t == s_j)
                m += alive.to(tl.int64)
            m = tl.minimum(m, cap)
            if window > 0:
                m = tl.minimum(m, e + 1 - L + window)
            score = tl.where(inside & (m >= n_min), m * 4294967296 + e, -1)  # length, then end (< 2^32)
            best = tl.maximum(best, tl.max(score, axis=0))
        kk = tl.arange(0, KB)
        found = (kk.to(tl.int64) * 0 + best) >= 0  # (a vector: scalar & vector masks trip the interpreter)
        c = (best % 4294967296) + 1 + kk
        ok = found & (c < L) & (kk < K)
        draft = tl.load(row + c, mask=ok, other=-1)
        if CORPUS:
            # one lane per n-gram length n = C_MIN + lane: its hash, a binary search of its table
            n = C_MIN + tl.arange(0, CP2)
            lane = n < C_MIN + C_NUM
            key = tl.zeros((CP2,), tl.int64)
            for j in tl.static_range(N_MAX):
                s_j = tl.sum(tl.where(jj == j, sv, 0), axis=0)
                key += tl.where(j < n, s_j * tl.load(pw_ptr + j), 0)
            off = tl.load(off_ptr + n, mask=lane, other=0)
            cnt = tl.load(cnt_ptr + n, mask=lane, other=0)
            lo = tl.zeros((CP2,), tl.int64)
            hi = cnt
            for _ in tl.static_range(STEPS):  # lower bound of key in hs[off : off + cnt]
                active = lo < hi
                mid = (lo + hi) // 2
                h = tl.load(hs_ptr + off + mid, mask=active, other=0)
                right = h < key
                lo = tl.where(active & right, mid + 1, lo)
                hi = tl.where(active & ~right, mid, hi)
            idx = off + lo
            hit = lane & (lo < cnt) & (L >= n)
            hit = hit & (tl.load(hs_ptr + idx, mask=hit, other=0) == key)
            for col in tl.static_range(N_MAX):  # the n-gram itself, oldest first: column col is s_(n-1-col)
                want = tl.sum(tl.where(jj[None, :] == (n - 1 - col)[:, None], sv[None, :], 0), axis=1)
                g = tl.load(grams_ptr + idx * N_MAX + col, mask=hit & (col < n), other=0)
                hit = hit & ((col >= n) | (g == want))
            nb = tl.max(tl.where(hit, n, -1), axis=0)
            at = tl.sum(tl.where(n == nb, idx, 0), axis=0)
            cont = tl.load(cont_ptr + at * DEPTH + kk, mask=((kk * 0 + nb) >= 0) & (kk < K) & ~found, other=-1)
            draft = tl.where(found, draft, cont)
        tl.store(out_ptr + b * K + kk, draft, mask=kk < K)
        tl.store(cnt_out_ptr + b, tl.sum(((draft >= 0) & (kk < K)).to(tl.int64), axis=0))  # leading: valid ones come first


def available(t: torch.Tensor) -> bool:
    """Whether the kernel runs for tensors like ``t`` (CUDA with Triton)."""
    return triton is not None and t.is_cuda


def ngram_draft(hist: torch.Tensor, rows: torch.Tensor, base: torch.Tensor, verdict_rows: torch.Tensor,
                n_min: int, n_max: int, k: int, window: int = 0, corpus=None) -> tuple[torch.Tensor, torch.Tensor]:
    """([R, k] drafts, -1 padded; [R] how many each row has) of rows ``rows`` [R] of ``hist`` [*, HS] (int64, each row a
    sequence's tokens) after appending the verdict's tokens at ``base`` [R] (``verdict_rows``
    [R, 1 + q]: the accepted count, then q tokens, as :meth:`speculum.interfaces.Verdict.as_rows`):
    the request's own match (:func:`~speculum_ngram.device.suffix_match`), else ``corpus``'s
    (:class:`~speculum_ngram.corpus.DeviceCorpus`, or None)."""
    R, q1 = verdict_rows.shape
    q = q1 - 1
    out = torch.empty(R, k, dtype=torch.int64, device=hist.device)
    counts = torch.empty(R, dtype=torch.int64, device=hist.device)
    if corpus is not None:
        c = corpus
        cargs = (c.hs, c.grams, c.cont, c.off, c.cnt, c.powers, c.depth)
        ckw = dict(CORPUS=True, C_MIN=c.n_min, C_NUM=c.n_max - c.n_min + 1,
                   CP2=triton.next_power_of_2(c.n_max - c.n_min + 1), STEPS=c.steps)
    else:
        cargs = (hist, hist, hist, hist, hist, hist, 1)
        ckw = dict(CORPUS=False, C_MIN=1, C_NUM=1, CP2=1, STEPS=1)
    v = verdict_rows if verdict_rows.stride(1) == 1 else verdict_rows.contiguous()
    _ngram_draft_kernel[(R,)](hist, hist.stride(0), rows, base, v, v.stride(0), q, out, counts, k, n_min, window, *cargs,
                              N_MAX=n_max, NP2=triton.next_power_of_2(max(n_max, 2)),
                              KB=triton.next_power_of_2(max(k, 2)), QB=triton.next_power_of_2(max(q, 2)),
                              BLOCK=256, **ckw)
    return out, counts
