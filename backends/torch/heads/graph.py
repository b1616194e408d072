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
host-to-device copy of its metadata, the same scheme as the target runner
(:mod:`speculum.backends.torch.graphs`). With ``use_graphs=False`` (CPU, tests) the same
function runs eagerly, so the CPU test suite checks exactly what the graph computes.

Token trees (:class:`HeadTreeGraphs`): the same catch-up, then the tree is drafted
level by level (:mod:`speculum.proposers.tree`): one batched head forward per depth over
every frontier node, each attending to the committed context and its ancestors' K/V in
a region of the head cache after the catch-up positions. The function returns the
tree's tokens, parents, depths and ancestor matrix, so no tree bookkeeping is left for
the host.

From a verdict still on the device (:meth:`HeadDraftGraphs.run_from_device`, chains and
trees alike): each row's accepted count (its pending positions are one more) and its
tokens come as one device tensor, the verdict's rows, copied into the graph whole; the
metadata holds every position the row may use, and the function picks its columns from
them, so the next drafts start before the host has read the verdict.

Padding: padded columns and rows write their K/V into the cache's scratch block 0 and
their outputs are ignored; positions past a row's valid ones are masked out of
attention by position, as in the eager path.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from speculum.backends.torch.graphs import GraphPool, StaticGraph
from speculum.backends.torch.heads.cache import HeadKVCache, PagedContext
from speculum.interfaces import KVCacheFull
from speculum.backends.torch.native.kernels import topk, topk_logprobs
from speculum.proposers.tree import StaticPlan, draft_tree, packed_tree, region_size
from speculum.tree import TreeMask, TreeSpec


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
        #: head-cache positions a step appends per row after its catch-up positions
        self.extra = k - 1
        #: (batch bucket, block bucket) -> (graph, its feature input x [Bb, Q, H])
        #: (and (batch bucket, block bucket, "device") -> (graph, its inputs x and verdict rows):
        #: drafting from a verdict on the device, :meth:`run_from_device`)
        self._graphs: dict[tuple, tuple[StaticGraph, torch.Tensor | tuple[torch.Tensor, ...]]] = {}
        self._pool = GraphPool()

    def fits(self, counts: Sequence[int]) -> bool:
        """Rows with 1..k+1 pending positions (every step after a request's first)."""
        return bool(counts) and min(counts) >= 1 and max(counts) <= self.Q

    # -- host metadata -----------------------------------------------------------------
    def _meta(self, seq_ids, tokens: Sequence[Sequence[int]], counts: Sequence[int], Bb: int,
              nb: int) -> np.ndarray:
        """[ctoks | cpos | cwsl | last | dpos | dwsl | blk] as one int64 vector.

        Each row's catch-up and draft positions (its last ``n + E``) were allocated in the
        head cache by the caller; padding rows are zeros (the scratch block). Built as
        Python lists, one array at the end: for a few rows of a few positions that is
        several times faster than numpy calls per row (host time of every drafting step)."""
        alloc, bs, Q, E = self.cache.allocator, self.cache.allocator.block_size, self.Q, self.extra
        ctoks, cpos, cwsl, last, dpos, dwsl, blk = [], [], [], [], [], [], []
        for sid, toks, n in zip(seq_ids, tokens, counts):
            table = alloc.block_table(sid)
            start = alloc.length(sid) - (n + E)
            p = range(start, start + n + E)
            slot = [table[i // bs] * bs + i % bs for i in p]
            pad = Q - n  # padding columns: the last valid position, written into the scratch block
            ctoks += [*toks, *[0] * pad]
            cpos += [*p[:n], *[p[n - 1]] * pad]
            cwsl += [*slot[:n], *[p[n - 1] % bs] * pad]
            last.append(n - 1)
            dpos += p[n:] if E else [0]
            dwsl += slot[n:] if E else [0]
            blk += [*table, *[0] * (nb - len(table))]
        rows = Bb - len(seq_ids)
        zeros = [0] * (rows * Q)
        dz = [0] * (rows * max(E, 1))
        return np.array(ctoks + zeros + cpos + zeros + cwsl + zeros + last + [0] * rows + dpos + dz + dwsl + dz
                        + blk + [0] * (rows * nb), dtype=np.int64)

    def _catch_up(self, x: torch.Tensor, meta: torch.Tensor, Bb: int, nb: int, D: int):
        """The part every static function shares: unpack the metadata (see ``_meta``) and
        run the head over the pending features. Returns (the head's states at each row's
        last pending position [Bb, H], its position [Bb], the draft positions and write
        slots [Bb, D] each, the KV positions to read [Bb, nb * block], their key index)."""
        Q = self.Q
        sizes = [Bb * Q, Bb * Q, Bb * Q, Bb, Bb * D, Bb * D, Bb * nb]
        ctoks, cpos, cwsl, last, dpos, dwsl, blk = meta.split(sizes)
        return self._head_catch_up(x, ctoks.view(Bb, Q), cpos.view(Bb, Q), cwsl.view(Bb, Q), last,
                                   dpos.view(Bb, D), dwsl.view(Bb, D), blk.view(Bb, nb))

    def _catch_up_device(self, x: torch.Tensor, rows: torch.Tensor, meta: torch.Tensor, Bb: int, nb: int, D: int):
        """:meth:`_catch_up` with each row's accepted count and tokens on the device (a verdict
        not yet read by the host): ``rows`` [Bb, 1 + Q] holds the count (the pending positions
        are one more) then the tokens; ``meta`` holds every position a row may use,
        ``[fpos | fwsl | blk]`` (see :meth:`_meta_device`), and the catch-up columns, padding
        and draft positions are chosen from them here, as ``_meta`` chooses them on the host."""
        Q, W, bs = self.Q, self.Q + self.extra, self.cache.allocator.block_size
        fpos, fwsl, blk = meta.split([Bb * W, Bb * W, Bb * nb])
        fpos, fwsl, blk = fpos.view(Bb, W), fwsl.view(Bb, W), blk.view(Bb, nb)
        c = (rows[:, :1] + 1).clamp(1, Q)
        ctoks = rows[:, 1:]
        valid = torch.arange(Q, device=meta.device).view(1, Q) < c
        lastpos = fpos.gather(1, c - 1)  # [Bb, 1]: padding columns repeat it, written into the scratch block
        cpos = torch.where(valid, fpos[:, :Q], lastpos)
        cwsl = torch.where(valid, fwsl[:, :Q], lastpos % bs)
        cols = (c + torch.arange(D, device=meta.device).view(1, D)).clamp_max(W - 1)
        return self._head_catch_up(x, ctoks.clamp_min(0), cpos, cwsl, (c - 1).view(Bb), fpos.gather(1, cols),
                                   fwsl.gather(1, cols), blk)

    def _head_catch_up(self, x, ctoks, cpos, cwsl, last, dpos, dwsl, blk):
        """The head over the catch-up columns (tokens, positions, write slots [Bb, Q]; ``last``
        [Bb] each row's last valid column; draft positions and slots [Bb, D]; blocks [Bb, nb])."""
        Bb, bs, dev = x.shape[0], self.cache.allocator.block_size, blk.device
        read = (blk.unsqueeze(-1) * bs + torch.arange(bs, device=dev)).reshape(Bb, -1)
        keys = torch.arange(read.shape[1], device=dev).view(1, 1, 1, -1)
        ctx = PagedContext(self.cache.pools, cwsl, read, keys <= cpos.unsqueeze(1).unsqueeze(-1))
        out = self.head(x, ctoks, cpos, ctx)
        rows = torch.arange(Bb, device=dev)
        return out[rows, last], cpos[rows, last], dpos, dwsl, read, keys

    def _draft(self, x: torch.Tensor, meta: torch.Tensor, Bb: int, nb: int) -> torch.Tensor:
        """The static function: features x [Bb, Q, H] and metadata -> drafts (:meth:`_after`)."""
        return self._after(*self._catch_up(x, meta, Bb, nb, max(self.extra, 1)))

    def _after(self, h, _pos, dpos, dwsl, read, keys) -> torch.Tensor:
        """What follows the catch-up (its outputs, see :meth:`_catch_up`): ``k`` greedy draft
        steps, each feeding the head its own output -> draft ids [Bb, k]."""
        k, pools, head = self.k, self.cache.pools, self.head
        Bb = h.shape[0]
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
            alloc.allocate(sid, int(n) + self.extra)
        Bb, nb = self.cache.graph_key(seq_ids)
        meta_np = self._meta(seq_ids, tokens, counts, Bb, nb)
        H = feats[0].shape[-1]
        with torch.inference_mode():
            if not self.use_graphs:
                x = torch.zeros(Bb, self.Q, H, dtype=self.dtype, device=self.device)
                for b, (f, n) in enumerate(zip(feats, counts)):
                    x[b, :n] = f
                meta = torch.from_numpy(meta_np).to(self.device)
                return self._draft(x, meta, Bb, nb)[:R]
            graph, x = self._graphs.get((Bb, nb)) or self._capture(Bb, nb, H, meta_np.size)
            graph.host()[:] = meta_np  # once the last copy from the pinned buffer has finished
            graph.upload()
            for b, (f, n) in enumerate(zip(feats, counts)):
                x[b, :n] = f
            return graph.replay()[:R]

    # -- drafting from a verdict still on the device ------------------------------------
    def run_from_device(self, seq_ids: Sequence[int], bases: Sequence[int], feats: torch.Tensor,
                        rows: torch.Tensor) -> torch.Tensor:
        """:meth:`run` with the pending states and the verdict still on the device.

        Row ``b`` catches up on the first ``rows[b, 0] + 1`` (its accepted count plus one) of
        ``feats[b]`` [Q, H] and of its tokens ``rows[b, 1:]`` at head-cache positions
        ``bases[b]`` on, then drafts its chain or tree; ``rows`` [R, 1 + >= Q] int64 is the
        verdict's [count | tokens] (:attr:`~speculum.interfaces.Verdict.rows`), copied into
        the graph in one piece. The host does not know the counts (the verdict of the step
        that made them is still being copied), so every row is given room for the longest
        outcome (``Q`` catch-up positions and the draft positions after them): :meth:`settle`
        cuts each back once the counts are known. Raises
        :class:`~speculum.interfaces.KVCacheFull` (every row cut back to its base) when the
        cache cannot hold that."""
        alloc, Q, E = self.cache.allocator, self.Q, self.extra
        R = len(seq_ids)
        try:
            for sid, base in zip(seq_ids, bases):
                alloc.truncate(sid, base)
                alloc.allocate(sid, Q + E)
        except KVCacheFull:  # no room for the longest outcome: every row as before the catch-up
            for sid, base in zip(seq_ids, bases):
                alloc.truncate(sid, min(base, alloc.length(sid)))
            raise
        Bb, nb = self.cache.graph_key(seq_ids)
        meta_np = self._meta_device(seq_ids, Bb, nb)
        H = feats.shape[-1]
        with torch.inference_mode():
            if not self.use_graphs:
                x = torch.zeros(Bb, Q, H, dtype=self.dtype, device=self.device)
                r = torch.zeros(Bb, 1 + Q, dtype=torch.int64, device=self.device)
                x[:R], r[:R] = feats[:, :Q], rows[:, :1 + Q]
                meta = torch.from_numpy(meta_np).to(self.device)
                return self._after(*self._catch_up_device(x, r, meta, Bb, nb, max(E, 1)))[:R]
            key = (Bb, nb, "device")
            graph, (x, r) = self._graphs.get(key) or self._capture_device(key, H, meta_np.size)
            graph.host()[:] = meta_np
            graph.upload()
            x[:R].copy_(feats[:, :Q])
            r[:R].copy_(rows[:, :1 + Q])
            return graph.replay()[:R]

    def settle(self, seq_id: int, base: int, count: int) -> None:
        """The head-cache length of a row drafted by :meth:`run_from_device` once its
        ``count`` is known: its catch-up positions and the draft positions after them."""
        self.cache.allocator.truncate(seq_id, base + count + self.extra)

    def _meta_device(self, seq_ids, Bb: int, nb: int) -> np.ndarray:
        """``[fpos | fwsl | blk]``: every position of each row's allocated catch-up and draft
        positions (``Q + extra`` from its base), their write slots, its block table; padding
        rows zeros (the scratch block)."""
        alloc, bs, W = self.cache.allocator, self.cache.allocator.block_size, self.Q + self.extra
        fpos, fwsl, blk = [], [], []
        for sid in seq_ids:
            table = alloc.block_table(sid)
            start = alloc.length(sid) - W
            p = range(start, start + W)
            fpos += p
            fwsl += [table[i // bs] * bs + i % bs for i in p]
            blk += [*table, *[0] * (nb - len(table))]
        rows = Bb - len(seq_ids)
        return np.array(fpos + [0] * (rows * W) + fwsl + [0] * (rows * W) + blk + [0] * (rows * nb), dtype=np.int64)

    def _capture_device(self, key, H: int, meta_size: int):
        Bb, nb, _ = key
        x = torch.zeros(Bb, self.Q, H, dtype=self.dtype, device=self.device)
        # padding rows: accepted count 0 (one pending position), tokens 0
        r = torch.zeros(Bb, 1 + self.Q, dtype=torch.int64, device=self.device)
        meta = torch.zeros(meta_size, dtype=torch.int64, device=self.device)
        entry = (self._pool.capture(
            lambda: self._after(*self._catch_up_device(x, r, meta, Bb, nb, max(self.extra, 1))), meta), (x, r))
        self._graphs[key] = entry
        return entry

    def _capture(self, Bb: int, nb: int, H: int, meta_size: int) -> tuple[StaticGraph, torch.Tensor]:
        x = torch.zeros(Bb, self.Q, H, dtype=self.dtype, device=self.device)
        # a harmless metadata: every row reads and writes the scratch block at position 0
        meta = torch.zeros(meta_size, dtype=torch.int64, device=self.device)
        entry = (self._pool.capture(lambda: self._draft(x, meta, Bb, nb), meta), x)
        self._graphs[(Bb, nb)] = entry
        return entry


# ----------------------------------------------------------------------------- token trees
def head_topk(head, out: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, target ids) of the head's ``width`` best tokens for outputs [..., H]
    (over the draft vocabulary when the head has one, as EAGLE-3)."""
    draft_logits = getattr(head, "draft_logits", None)
    if draft_logits is not None and hasattr(head, "to_target"):
        lp, idx = topk_logprobs(draft_logits(out), width)
        return lp, head.to_target(idx)
    return topk_logprobs(head.logits(out), width)


class HeadExpander:
    """A head as a :class:`speculum.proposers.tree.Expander` over its paged cache.

    ``h_root`` [B, H]: the head's output at the last catch-up position (its logits give
    the root's children); ``root_pos`` [B] that position; the tree region starts at
    logical position ``region_start`` [B] and its slots are written at ``region_wsl``
    [B, S]."""

    def __init__(self, head, pools, read: torch.Tensor, h_root: torch.Tensor, root_pos: torch.Tensor,
                 region_start: torch.Tensor, region_wsl: torch.Tensor):
        self.head, self.pools, self.read = head, pools, read
        self.h_root, self.root_pos = h_root, root_pos
        self.region_start, self.region_wsl = region_start.contiguous(), region_wsl  # (read in every layer)
        self.device = h_root.device
        self.prev = h_root.unsqueeze(1)
        #: 0, 1, 2, ...: region slots, made once per draft (not per level)
        self.count = torch.arange(region_wsl.shape[1], device=self.device)

    #: frontiers and nodes of dynamic trees chosen by the fused top-k on CUDA
    topk = staticmethod(topk)

    def root(self, width: int):
        return head_topk(self.head, self.h_root, width)

    def expand(self, level, parent, tokens, vis, slots, width):
        B, F = tokens.shape
        src = self.h_root.unsqueeze(1) if level == 1 else self.prev
        feats = src.gather(1, parent.unsqueeze(-1).expand(B, F, src.shape[-1]))  # the parent's output
        pos = (self.root_pos + level).view(B, 1).expand(B, F)
        # own[i, slots[i]] by comparison (an indexed write of True would copy from the host,
        # which a CUDA graph capture refuses)
        own = self.count[: vis.shape[-1]].view(1, -1) == slots.view(F, 1)
        mask = TreeMask(self.region_start, vis | own)
        ctx = PagedContext(self.pools, self.region_wsl[:, slots], self.read, mask)
        self.prev = self.head(feats, tokens, pos, ctx)
        return head_topk(self.head, self.prev, width)


class HeadTreeGraphs(HeadDraftGraphs):
    """Static-shape tree drafting (see the module doc); same capture and replay as chains.

    ``run`` returns [R, 3N + N*N] int64: tokens, parents, depths and the ancestor matrix
    of each row's tree (:func:`speculum.proposers.tree.unpack_tree`)."""

    def __init__(self, head, cache: HeadKVCache, tree: TreeSpec, dtype: torch.dtype, device: torch.device,
                 use_graphs: bool):
        super().__init__(head, cache, tree.num_nodes, dtype, device, use_graphs)
        self.tree = tree
        self.Q = tree.depth + 1  # pending positions after a step: accepted path + 1
        self.extra = region_size(tree)
        self.plan = StaticPlan(tree, self.device) if tree.is_static else None

    def _after(self, h, pos, rpos, rwsl, read, _keys) -> torch.Tensor:
        """The tree after the catch-up: packed [Bb, 3N + N*N] (see the class doc)."""
        ex = HeadExpander(self.head, self.cache.pools, read, h, pos, rpos[:, 0], rwsl)
        return packed_tree(*draft_tree(ex, self.tree, self.plan))
