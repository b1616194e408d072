"""Greedy chain drafting of a hidden-state head as one static-shape function (CUDA graphs).

Drafting eagerly, a one-layer head issues some forty kernels per draft step from
Python; on a GPU that costs more than the target's whole graphed verify step, and the
method loses to plain decoding. Here the whole greedy propose of a batch is one
function of static buffers:

1. the catch-up forward over each row's pending true features (the target's states of
   the tokens accepted last step, at most ``k + 1``), padded to ``k + 1`` columns;
2. ``k - 1`` chained steps, each feeding the head its own output and its argmax token;
3. the argmax of every step: ``[B, k]`` draft token ids.

It is captured once per (batch bucket, context-block bucket) and replayed with one
host-to-device copy of its metadata, the same scheme as the target runner. With
``use_graphs=False`` (CPU, tests) the same function runs eagerly, so the CPU test suite
checks exactly what the graph computes.

Padding: padded columns and rows write their K/V into the cache's scratch block 0 and
their outputs are ignored; positions past a row's valid ones are masked out of
attention by position, as in the eager path.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from speculum.kv import blocks_for
from speculum.proposers.head_cache import HeadKVCache, PagedContext

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    return n


def greedy_tokens(head, out: torch.Tensor) -> torch.Tensor:
    """The head's argmax token (target ids) for outputs [..., H]."""
    pick = getattr(head, "greedy", None)
    return pick(out) if pick is not None else head.logits(out).argmax(dim=-1)


class HeadDraftGraphs:
    """Static-shape greedy drafting for :class:`ChainHeadProposer` (see module doc)."""

    def __init__(self, head, cache: HeadKVCache, k: int, dtype: torch.dtype, device: torch.device,
                 use_graphs: bool):
        self.head, self.cache, self.k = head, cache, k
        self.dtype, self.device = dtype, torch.device(device)
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.Q = k + 1
        self._graphs: dict[tuple[int, int], tuple] = {}
        self._pool = None

    def fits(self, counts: Sequence[int]) -> bool:
        """Rows with 1..k+1 pending positions (every step after a request's first)."""
        return bool(counts) and min(counts) >= 1 and max(counts) <= self.Q

    # -- host metadata -----------------------------------------------------------------
    def _meta(self, seq_ids, tokens: Sequence[Sequence[int]], counts: Sequence[int], Bb: int,
              nb: int) -> np.ndarray:
        """[ctoks | cpos | cwsl | last | dpos | dwsl | blk] as one int64 vector.

        Allocates each row's catch-up and draft positions in the head cache first."""
        alloc, bs, Q, k = self.cache.allocator, self.cache.allocator.block_size, self.Q, self.k
        D = max(k - 1, 1)
        ctoks = np.zeros((Bb, Q), np.int64)
        cpos = np.zeros((Bb, Q), np.int64)
        cwsl = np.zeros((Bb, Q), np.int64)
        last = np.zeros(Bb, np.int64)
        dpos = np.zeros((Bb, D), np.int64)
        dwsl = np.zeros((Bb, D), np.int64)
        blk = np.zeros((Bb, nb), np.int64)
        for b, (sid, toks, n) in enumerate(zip(seq_ids, tokens, counts)):
            start = alloc.length(sid) - (n + k - 1)  # allocated by the caller
            table = alloc.block_table(sid)
            blk[b, : len(table)] = table
            p = start + np.arange(n + k - 1, dtype=np.int64)
            slot = blk[b, p // bs] * bs + p % bs
            ctoks[b, :n] = toks
            cpos[b, :n], cwsl[b, :n] = p[:n], slot[:n]
            cpos[b, n:] = p[n - 1]                 # padding columns: a valid position,
            cwsl[b, n:] = p[n - 1] % bs            # writes into the scratch block
            last[b] = n - 1
            if k > 1:
                dpos[b], dwsl[b] = p[n:], slot[n:]
        return np.concatenate([a.reshape(-1) for a in (ctoks, cpos, cwsl, last, dpos, dwsl, blk)])

    def _draft(self, x: torch.Tensor, meta: torch.Tensor, Bb: int, nb: int) -> torch.Tensor:
        """The static function: features x [Bb, Q, H] and metadata -> draft ids [Bb, k]."""
        Q, k, bs = self.Q, self.k, self.cache.allocator.block_size
        D = max(k - 1, 1)
        sizes = [Bb * Q, Bb * Q, Bb * Q, Bb, Bb * D, Bb * D, Bb * nb]
        ctoks, cpos, cwsl, last, dpos, dwsl, blk = meta.split(sizes)
        ctoks, cpos, cwsl = ctoks.view(Bb, Q), cpos.view(Bb, Q), cwsl.view(Bb, Q)
        dpos, dwsl, blk = dpos.view(Bb, D), dwsl.view(Bb, D), blk.view(Bb, nb)
        read = (blk.unsqueeze(-1) * bs + torch.arange(bs, device=meta.device)).reshape(Bb, -1)
        keys = torch.arange(read.shape[1], device=meta.device).view(1, 1, 1, -1)
        pools, head = self.cache.pools, self.head
        ctx = PagedContext(pools, cwsl, read, keys <= cpos.unsqueeze(1).unsqueeze(-1))
        out = head(x, ctoks, cpos, ctx)
        h = out[torch.arange(Bb, device=meta.device), last]  # [Bb, H]
        drafts = []
        for i in range(k):
            tok = greedy_tokens(head, h)
            drafts.append(tok)
            if i + 1 < k:
                p = dpos[:, i: i + 1]
                ctx = PagedContext(pools, dwsl[:, i: i + 1], read, keys <= p.unsqueeze(1).unsqueeze(-1))
                h = head(h.unsqueeze(1), tok.view(Bb, 1), p, ctx)[:, 0]
        return torch.stack(drafts, dim=1)

    # -- one propose ---------------------------------------------------------------------
    def run(self, seq_ids: Sequence[int], feats: Sequence[torch.Tensor], tokens: Sequence[Sequence[int]],
            counts: Sequence[int]) -> torch.Tensor:
        """Greedy drafts [R, k] for rows with ``counts[b]`` pending features/tokens each."""
        alloc = self.cache.allocator
        R = len(seq_ids)
        for sid, n in zip(seq_ids, counts):
            alloc.allocate(sid, int(n) + self.k - 1)
        Bb = _bucket(R, BATCH_BUCKETS)
        need = max(blocks_for(alloc.length(s), alloc.block_size) for s in seq_ids)
        nb = 1 << max(0, need - 1).bit_length()  # power-of-two block buckets
        meta_np = self._meta(seq_ids, tokens, counts, Bb, nb)
        H = feats[0].shape[-1]
        with torch.inference_mode():
            if not self.use_graphs:
                x = torch.zeros(Bb, self.Q, H, dtype=self.dtype, device=self.device)
                for b, (f, n) in enumerate(zip(feats, counts)):
                    x[b, :n] = f
                meta = torch.from_numpy(meta_np).to(self.device)
                return self._draft(x, meta, Bb, nb)[:R]
            graph, x, meta, out, host, done = self._graphs.get((Bb, nb)) or self._capture(Bb, nb, H, meta_np.size)
            if done is not None:
                done.synchronize()  # the last copy from the pinned buffer has finished
            host.numpy()[:] = meta_np
            meta.copy_(host, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self._graphs[(Bb, nb)] = (graph, x, meta, out, host, ev)
            for b, (f, n) in enumerate(zip(feats, counts)):
                x[b, :n] = f
            graph.replay()
            return out[:R]

    def _capture(self, Bb: int, nb: int, H: int, meta_size: int):
        x = torch.zeros(Bb, self.Q, H, dtype=self.dtype, device=self.device)
        meta = torch.zeros(meta_size, dtype=torch.int64, device=self.device)
        # a harmless metadata: every row reads and writes the scratch block at position 0
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self._draft(x, meta, Bb, nb)
        torch.cuda.current_stream().wait_stream(s)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._draft(x, meta, Bb, nb)
        host = torch.zeros(meta_size, dtype=torch.int64).pin_memory()
        entry = (graph, x, meta, out, host, None)
        self._graphs[(Bb, nb)] = entry
        return entry
