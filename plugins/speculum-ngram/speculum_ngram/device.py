"""N-gram drafting on the device, from a verdict the host has not read yet.

A speculative n-gram step used to end with a host round trip: the verdict copied to the
host, the tokens appended, the lookup run in Python, the next forward launched; on the
H200 the GPU idles through all of it (an n-gram step cost 1.23x a plain decoding step
while its verify forward costs 1.01x). Here each sequence's tokens also live on the
device (:class:`DeviceHistory`): the verdict's tokens are appended there by the device,
and the next drafts are looked up there (:func:`suffix_match`, then the corpus's table:
:class:`~speculum_ngram.corpus.DeviceCorpus`), so the loop can launch the next verify
forward before the host reads anything (``from_verdict``, :class:`~speculum.interfaces.VerdictDrafter`).

The drafts are exactly the host lookup's (:class:`~speculum_ngram.proposer.SuffixIndex`,
then :meth:`Corpus.draft <speculum_ngram.corpus.Corpus.draft>`): the latest earlier
occurrence of the longest matching suffix, its continuation cut at the sequence's end;
rows without a match draft -1 (never accepted). Every row drafts k tokens as far as the
host can tell (their count lives on the device).
"""

from __future__ import annotations

from typing import Sequence

import torch


def suffix_match(hist: torch.Tensor, length: torch.Tensor, n_min: int, n_max: int, k: int,
                 window: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([B, k] drafts, -1 padded; [B] found; [B, n_max] the suffix, column j the (j+1)-th
    newest token, -2 before the start) of sequences ``hist`` [B, W] (positions at or past
    ``length`` [B] are ignored): for n from ``n_max`` down to ``n_min``, the tokens after the
    latest earlier occurrence of the last n tokens (``window``: occurrences starting in the
    last ``window`` tokens only), as :class:`~speculum_ngram.proposer.SuffixIndex` drafts.

    Every window end e at once: its backward match length with the suffix (up to n_max),
    capped by what n may be there (at most length - 1, and the window); the best end has
    the largest capped length, then the largest e."""
    B, W = hist.shape
    dev = hist.device
    j = torch.arange(n_max, device=dev)
    L = length.view(B, 1)
    sidx = L - 1 - j.view(1, n_max)
    suffix = torch.where(sidx >= 0, hist.gather(1, sidx.clamp_min(0)), -2)
    e = torch.arange(W, device=dev)
    widx = e.view(W, 1) - j.view(1, n_max)  # [W, n_max]: the tokens ending at e, newest first
    eq = (hist[:, widx.clamp_min(0)] == suffix.view(B, 1, n_max)) & (widx >= 0)
    m = eq.to(torch.int32).cumprod(-1).sum(-1)  # [B, W] backward match length
    cap = (L - 1).clamp_max(n_max)
    if window:
        cap = torch.minimum(cap, L.clamp_max(window) - 1)
        m = torch.minimum(m, e.view(1, W) + 1 - L + window)  # starts inside the window
    m = torch.minimum(m, cap)
    ok = (e.view(1, W) <= L - 2) & (m >= n_min)
    score = torch.where(ok, m.to(torch.int64) * W + e.view(1, W), -1)
    best, at = score.max(1)
    found = best >= 0
    cols = at.view(B, 1) + 1 + torch.arange(k, device=dev).view(1, k)
    draft = hist.gather(1, cols.clamp_max(W - 1))
    draft = torch.where(found.view(B, 1) & (cols < L), draft, -1)
    return draft, found, suffix


class DeviceHistory:
    """Each sequence's tokens on one device, one row of a buffer per sequence: synced from
    the host (:meth:`sync`) or appended to from a verdict on the device (:meth:`append`).
    ``known[seq_id]``: how many leading tokens of the sequence the row holds, as far as the
    host knows."""

    def __init__(self, device, capacity: int = 1024):
        self.device = torch.device(device)
        self.buf = torch.full((0, capacity), -1, dtype=torch.int64, device=self.device)
        self.row: dict[int, int] = {}
        self.known: dict[int, int] = {}
        self._free: list[int] = []

    def _grow(self, rows: int, cols: int) -> None:
        R, C = self.buf.shape
        if rows <= R and cols <= C:
            return
        nr, nc = (max(rows, 2 * R) if rows > R else R), C
        while nc < cols:
            nc *= 2
        buf = torch.full((nr, nc), -1, dtype=torch.int64, device=self.device)
        buf[:R, :C] = self.buf
        self.buf = buf

    def _row_of(self, sid: int) -> int:
        r = self.row.get(sid)
        if r is None:
            r = self._free.pop() if self._free else len(self.row)  # (every row in use: the next one)
            self.row[sid] = r
            self.known[sid] = 0
        return r

    def sync(self, seqs) -> None:
        """Copy each sequence's tokens the row lacks (one copy for all of them)."""
        rows, cols, vals = [], [], []
        for s in seqs:
            r, n, L = self._row_of(s.seq_id), self.known.get(s.seq_id, 0), len(s.token_ids)
            if n > L:  # the row is ahead of the sequence (never, but then: take it again)
                n = 0
            if n < L:
                rows += [r] * (L - n)
                cols += range(n, L)
                vals += s.token_ids[n:L]
                self.known[s.seq_id] = L
        self._grow(len(self.row) + len(self._free), max((len(s.token_ids) for s in seqs), default=0) + 1)
        if vals:
            idx = torch.tensor([rows, cols], dtype=torch.int64).to(self.device, non_blocking=True)
            v = torch.tensor(vals, dtype=torch.int64).to(self.device, non_blocking=True)
            self.buf[idx[0], idx[1]] = v

    def rows_of(self, seq_ids: Sequence[int]) -> list[int]:
        return [self.row[sid] for sid in seq_ids]

    def reserve(self, cols: int) -> None:
        """Room for ``cols`` tokens in every row."""
        self._grow(self.buf.shape[0], cols)

    def append(self, rows: torch.Tensor, lengths: torch.Tensor, tokens: torch.Tensor, max_len: int) -> None:
        """Write ``tokens`` [R, q] at ``lengths`` [R] of ``rows`` [R] (all q columns: those
        past what was accepted lie beyond the new length, ignored until overwritten)."""
        q = tokens.shape[1]
        self.reserve(max_len + q + 1)
        cols = lengths.view(-1, 1) + torch.arange(q, device=self.device).view(1, q)
        self.buf[rows.view(-1, 1), cols] = tokens

    def release(self, sid: int) -> None:
        r = self.row.pop(sid, None)
        self.known.pop(sid, None)
        if r is not None:
            self._free.append(r)
