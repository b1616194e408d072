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
feed, which starts there).
"""

from __future__ import annotations

from typing import Sequence

import torch

from speculum.backends.torch.heads import HeadKVCache
from speculum.interfaces import KVCacheFull, SequenceView, Verdict
from speculum.tree import gather_path


class PrefixStates:
    """The prefix layer's KV cache, pending states and last output, per sequence."""

    def __init__(self, heads, cache: HeadKVCache):
        self.heads, self.cache = heads, cache
        p = next(heads.parameters())
        self.device = p.device
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
        B = len(seq_ids)
        with torch.inference_mode():
            states = h if verdict.path is None else gather_path({-1: h}, verdict.path)[-1]
            W = min(states.shape[1], verdict.token_ids.shape[1])
            toks = verdict.token_ids[:, :W].to(states.device, torch.int64).clamp_min(0)  # past the count: unused
            try:
                positions, ctx = self.cache.prepare(list(seq_ids), [W] * B, W)
            except KVCacheFull:
                for sid, n in zip(seq_ids, lengths):  # rows allocated before the one without room
                    self.take_back(sid, n)
                return None
            out = self.heads.prefix_forward(self.heads.features(states[:, :W], toks), positions, ctx)
            acc = verdict.num_accepted.to(out.device, torch.int64).view(B, 1, 1)
            return out.gather(1, acc.expand(-1, 1, out.shape[-1])).squeeze(1)

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

