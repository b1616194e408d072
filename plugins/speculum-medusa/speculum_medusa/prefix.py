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
"""

from __future__ import annotations

from typing import Sequence

import torch

from speculum.backends.torch.heads import HeadKVCache
from speculum.interfaces import SequenceView


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
