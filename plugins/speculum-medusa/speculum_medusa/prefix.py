"""Per-sequence state of a prefix layer (:mod:`speculum_medusa.model`) while drafting.

The layer reads the heads' features of every position whose next token is known: the target
state ``h_p`` and the token ``x_{p+1}`` it produced. Those states arrive before their tokens
are in the sequence (at the prefill, then each verify step's accepted columns), so they wait
in ``pending`` and are fed at the next propose, which sees the sequence's tokens
(:meth:`PrefixStates.catch_up`): the layer's cache then holds positions ``0 .. len - 2`` and
its output at ``len - 2`` (the state that produced the sequence's last token) is what the heads
draft from. Only true positions ever enter the cache, so neither a rejected draft nor a propose
taken back (a step drafted ahead that never ran) has anything to undo: what a catch-up fed
stays true, and the next one goes on from there.

With overlap (CUDA) a step's states are fed before the host has read how many were accepted
(:meth:`PrefixStates.from_verdict`): every column of the verify step (a tree's in path order)
with the verdict's tokens, at the positions that follow the cache; the output at the accepted
count's column is gathered on the device, and once the count is known (:meth:`PrefixStates.settle`)
the cache is cut to the accepted positions (the columns past them are overwritten by the next
feed, which starts there). That feed is one static-shape function (:class:`PrefixFeed`): a CUDA
graph per (batch bucket, verify width, block bucket) on a GPU, replayed after one copy of its
metadata, and the same function run eagerly elsewhere, so the CPU tests check what the graph
computes. (The catch-up at a propose, after a prefill or a step drafted without the verdict,
stays eager: its widths vary.)
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from speculum.backends.torch.heads import GraphPool, HeadKVCache, StaticGraph
from speculum.interfaces import KVCacheFull, SequenceView, Verdict
from speculum.tree import gather_path


class PrefixFeed:
    """The prefix layer fed a verify step's columns with the verdict's tokens, and its output
    gathered at each row's accepted count, as one static function of buffers: target states
    ``s`` [Bb, W, H], the verdict's rows ``r`` [Bb, R] (accepted count, then tokens: one device
    copy) and the metadata (each row's positions and write slots [Bb, W], its block table
    [Bb, nb]) -> outputs [Bb, H].

    Eagerly the layer's forward is some fifteen kernels launched from Python each step, which
    made the heads with a prefix layer cost 2.00 plain decoding steps a step against 1.34
    without it (H100, 2026-12-05); captured, one replay. Padding rows read and write the
    scratch block 0 (their outputs are dropped); a row's blocks past its table are masked out
    by position."""

    def __init__(self, heads, cache: HeadKVCache, use_graphs: bool):
        self.heads, self.cache = heads, cache
        p = next(heads.parameters())
        self.device = p.device
        self.use_graphs = use_graphs and self.device.type == "cuda"
        #: (batch bucket, width, rows' width, block bucket) -> (graph, its input buffers s and r)
        self._graphs: dict[tuple[int, int, int], tuple[StaticGraph, tuple[torch.Tensor, ...]]] = {}
        self._pool = GraphPool()

    def __call__(self, seq_ids: Sequence[int], states: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``seq_ids`` (each with its last ``W`` positions allocated in the cache for
        ``states`` [B, W, H]) and the verdict's rows ``rows`` [B, 1 + >= W] (its ``as_rows()``:
        accepted count ``a``, then the tokens the step emitted): the layer's outputs at column
        ``a`` [B, H] (being computed)."""
        B, W, H = states.shape
        Bb, nb = self.cache.graph_key(seq_ids)
        pos, wsl, blk = self.cache.allocator.step_slots(list(seq_ids), [W] * B, W, Bb, nb)
        meta_np = np.concatenate([pos.reshape(-1), wsl.reshape(-1), blk.reshape(-1)])
        with torch.inference_mode():
            if self.use_graphs:
                key = (Bb, W, rows.shape[1], nb)
                graph, (s, r) = self._graphs.get(key) or self._capture(key, H, states.dtype, meta_np.size)
                graph.host()[:] = meta_np
                graph.upload()
            else:
                s, r, meta = self._buffers(Bb, W, rows.shape[1], H, states.dtype, meta_np.size)
                meta.copy_(torch.from_numpy(meta_np))
            s[:B].copy_(states)
            r[:B].copy_(rows)  # (padding rows keep earlier values: they read and write the scratch block)
            # a copy of the graph's output: each row keeps its output past the next replay (PrefixStates.settle)
            return graph.replay()[:B].clone() if self.use_graphs else self._feed(s, r, meta, Bb, W, nb)[:B]

    def _buffers(self, Bb: int, W: int, R: int, H: int, dtype: torch.dtype, meta_size: int):
        dev = self.device
        return (torch.zeros(Bb, W, H, dtype=dtype, device=dev), torch.zeros(Bb, R, dtype=torch.int64, device=dev),
                torch.zeros(meta_size, dtype=torch.int64, device=dev))

    def _feed(self, s, r, meta, Bb: int, W: int, nb: int) -> torch.Tensor:
        """The static function (see the class doc)."""
        pos, wsl, blk = meta.split([Bb * W, Bb * W, Bb * nb])
        pos = pos.view(Bb, W)
        ctx = self.cache.context(pos, wsl.view(Bb, W), blk.view(Bb, nb))
        tokens = r[:, 1:1 + W].clamp_min(0)  # (past a row's count: -1, unused)
        out = self.heads.prefix_forward(self.heads.features(s, tokens), pos, ctx)
        a = r[:, 0].clamp(0, W - 1)
        return out.gather(1, a.view(Bb, 1, 1).expand(-1, 1, out.shape[-1])).squeeze(1)

    def _capture(self, key, H: int, dtype: torch.dtype, meta_size: int):
        Bb, W, R, nb = key
        s, r, meta = self._buffers(Bb, W, R, H, dtype, meta_size)
        entry = (self._pool.capture(lambda: self._feed(s, r, meta, Bb, W, nb), meta), (s, r))
        self._graphs[key] = entry
        return entry


class PrefixStates:
    """The prefix layer's KV cache, pending states and last output, per sequence."""

    def __init__(self, heads, cache: HeadKVCache, cuda_graphs: bool = False):
        self.heads, self.cache = heads, cache
        p = next(heads.parameters())
        self.device = p.device
        #: the feed from a verdict (a CUDA graph on a GPU with ``cuda_graphs``)
        self.feed = PrefixFeed(heads, cache, use_graphs=cuda_graphs)
        #: target states not yet fed to the layer [m, H]: positions cache.length .. + m - 1
        self.pending: dict[int, torch.Tensor] = {}
        #: the layer's output at the last position fed (None before any)
        self.z: dict[int, torch.Tensor | None] = {}

    def add(self, seq_id: int, h: torch.Tensor) -> None:
        """A sequence and its prefill states [len - 1, H] (every position but the last token's)."""
        self.cache.add(seq_id)
        self.pending[seq_id] = h.clone()
        self.z[seq_id] = None

    def remove(self, seq_id: int) -> None:
        self.cache.remove(seq_id)
        self.pending.pop(seq_id, None)
        self.z.pop(seq_id, None)

    def observe(self, seq_id: int, h: torch.Tensor) -> None:
        """A verify step's states of the accepted positions and the new token's [a + 1, H] (a
        step that did not draft: the new token's alone), fed at the next catch-up."""
        prev = self.pending.get(seq_id)
        self.pending[seq_id] = h if prev is None or not prev.shape[0] else torch.cat([prev, h])

    def catch_up(self, seqs: Sequence[SequenceView]) -> tuple[list[int], torch.Tensor | None]:
        """Feed every sequence's pending states (with the tokens they produced, from the
        sequence) through the layer, in one batched forward; returns the rows that have an
        output to draft from and those outputs [R, H]."""
        todo = [s for s in seqs if self.pending[s.seq_id].shape[0]]
        if todo:
            sids = [s.seq_id for s in todo]
            counts = [self.pending[sid].shape[0] for sid in sids]
            R, P = len(todo), max(counts)
            H = self.pending[sids[0]].shape[-1]
            feats = self.pending[sids[0]].new_zeros(R, P, H)
            toks = torch.zeros(R, P, dtype=torch.int64)
            for i, s in enumerate(todo):
                sid, m, start = s.seq_id, counts[i], self.cache.length(s.seq_id)
                nxt = s.token_ids[start + 1: start + 1 + m]
                if len(nxt) != m:
                    raise RuntimeError(f"Medusa prefix layer: sequence {sid} has {len(s.token_ids)} tokens, its "
                                       f"layer cache {start} positions and {m} pending states (out of step)")
                feats[i, :m] = self.pending[sid]
                toks[i, :m] = torch.tensor(nxt, dtype=torch.int64)
            with torch.inference_mode():
                f = self.heads.features(feats, toks.to(self.device, non_blocking=True))
                positions, ctx = self.cache.prepare(sids, counts, P)
                out = self.heads.prefix_forward(f, positions, ctx)
                last = out[torch.arange(R, device=out.device), torch.tensor(counts, device=out.device) - 1]
            empty = feats.new_zeros(0, H)
            for i, sid in enumerate(sids):
                self.z[sid], self.pending[sid] = last[i], empty
        rows = [b for b, s in enumerate(seqs) if self.z.get(s.seq_id) is not None]
        x = torch.stack([self.z[seqs[b].seq_id] for b in rows]) if rows else None
        return rows, x

    def from_verdict(self, seq_ids: Sequence[int], lengths: Sequence[int], verdict: Verdict,
                     h: torch.Tensor) -> torch.Tensor | None:
        """Feed the verify step's states ``h`` [B, W, H] (columns; a tree's gathered along its
        accepted path) with the verdict's tokens, while the accepted counts are still on the
        device; returns the layer's output at each row's last accepted position [B, H] (being
        computed), or None (nothing fed) unless every row's cache holds exactly its sequence's
        positions but the last (``lengths[b] - 1``: its pending states consumed) and has room."""
        if any(self.pending[sid].shape[0] or self.cache.length(sid) != n - 1 for sid, n in zip(seq_ids, lengths)):
            return None
        with torch.inference_mode():
            states = h if verdict.path is None else gather_path({-1: h}, verdict.path)[-1]
            W = min(states.shape[1], verdict.token_ids.shape[1])
            try:
                for sid in seq_ids:
                    self.cache.allocator.allocate(sid, W)
            except KVCacheFull:
                for sid, n in zip(seq_ids, lengths):  # rows allocated before the one without room
                    self.take_back(sid, n)
                return None
            return self.feed(seq_ids, states[:, :W], verdict.as_rows().to(states.device))

    def settle(self, seq_id: int, length: int, num_accepted: int, z: torch.Tensor) -> None:
        """A row fed by :meth:`from_verdict` (its sequence ``length`` tokens long before the step)
        once its accepted count is known: the cache keeps the accepted positions, ``z`` is its output."""
        self.cache.truncate(seq_id, length + num_accepted)
        self.z[seq_id] = z
        self.pending[seq_id] = z.new_zeros(0, z.shape[-1])

    def take_back(self, seq_id: int, length: int) -> None:
        """A row fed by :meth:`from_verdict` and never settled: the cache as before the feed."""
        if seq_id in self.pending and self.cache.length(seq_id) > length - 1:
            self.cache.truncate(seq_id, length - 1)

