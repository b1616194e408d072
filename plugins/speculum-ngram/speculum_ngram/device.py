"""Prompt lookup on the device: the chain rule of :func:`~speculum_ngram.proposer.find_ngram_draft`
over token histories kept on the target's device, so that the next step's drafts can be made
from a verdict the host has not read yet (:meth:`NgramProposer.draft_from_verdict`).

Each sequence owns a row of one ``[slots, capacity]`` buffer. The host knows how many of the
row's leading tokens are valid (``known``); a step drafted from the verdict writes its new
tokens there on the device and the host learns how many were valid when it observes the step.
Tokens the device has not seen (a prompt, steps drafted on the host) are copied from the
sequence's own list before the next device draft.
"""

from __future__ import annotations

import torch

from speculum.devices import on_device


def match_drafts(hist: torch.Tensor, length: torch.Tensor, n_min: int, n_max: int, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts [R, k] (-1 padded) and their lengths [R] for token rows ``hist`` [R, W] whose
    first ``length`` [R] tokens are valid (on the same device, ``length >= 1``): for n from
    ``n_max`` down to ``n_min``, the up to k tokens after the most recent earlier occurrence
    of the last n tokens, exactly as :func:`find_ngram_draft` drafts on the host.

    No host synchronisation: a fixed number of kernels over the whole width. Window end e
    (its last token) is a candidate when e <= length - 2; its match length is how many of
    ``hist[e], hist[e-1], ...`` equal ``hist[length-1], hist[length-2], ...`` in a row (at most
    n_max); the best candidate has the longest match (cut at n_max), then the latest end.
    """
    R, W = hist.shape
    dev = hist.device
    j = torch.arange(n_max, device=dev)
    # the suffix, last token first: hist[length - 1 - j] (-3 where the sequence is shorter: never equal)
    at = length.view(R, 1) - 1 - j
    suffix = torch.where(at >= 0, hist.gather(1, at.clamp_min(0)), -3)
    # windows[r, e, i] = hist[r, e - (n_max - 1) + i] (-2 before the start): i = n_max - 1 - j
    padded = torch.nn.functional.pad(hist, (n_max - 1, 0), value=-2)
    windows = padded.unfold(1, n_max, 1)  # [R, W, n_max], a view
    eq = windows == suffix.flip(1).view(R, 1, n_max)
    match = eq.flip(2).cumprod(2).sum(2)  # run of equal tokens backwards from e, at most n_max
    e = torch.arange(W, device=dev)
    ok = (match >= n_min) & (e.view(1, W) <= length.view(R, 1) - 2)
    score = torch.where(ok, match * W + e, -1)  # longest match first, then the latest end
    best, end = score.max(1)
    pos = end.view(R, 1) + 1 + torch.arange(k, device=dev)
    valid = (best >= 0).view(R, 1) & (pos < length.view(R, 1))
    drafts = torch.where(valid, hist.gather(1, pos.clamp_max(W - 1)), -1)
    return drafts, valid.sum(1)


class DeviceHistory:
    """Every running sequence's tokens in one ``[slots, capacity]`` int64 buffer on ``device``
    (see the module doc). Grows by doubling; a slot is freed when its sequence leaves."""

    def __init__(self, device: torch.device, capacity: int = 1024, slots: int = 8):
        self.device = torch.device(device)
        self.buf = torch.full((slots, capacity), -1, dtype=torch.int64, device=self.device)
        self.slot: dict[int, int] = {}
        #: leading tokens of each sequence's row that hold its tokens
        self.known: dict[int, int] = {}
        self.free = list(range(slots - 1, -1, -1))

    def add(self, seq_id: int) -> None:
        if seq_id in self.slot:
            self.known[seq_id] = 0
            return
        if not self.free:
            S, C = self.buf.shape
            grown = torch.full((2 * S, C), -1, dtype=torch.int64, device=self.device)
            grown[:S] = self.buf
            self.buf = grown
            self.free = list(range(2 * S - 1, S - 1, -1))
        self.slot[seq_id] = self.free.pop()
        self.known[seq_id] = 0

    def remove(self, seq_id: int) -> None:
        slot = self.slot.pop(seq_id, None)
        self.known.pop(seq_id, None)
        if slot is not None:
            self.free.append(slot)

    def reserve(self, length: int) -> None:
        """Room for ``length`` tokens in every row."""
        S, C = self.buf.shape
        if length <= C:
            return
        while C < length:
            C *= 2
        grown = torch.full((S, C), -1, dtype=torch.int64, device=self.device)
        grown[:, : self.buf.shape[1]] = self.buf
        self.buf = grown

    def sync(self, seq_id: int, tokens: list[int], length: int) -> None:
        """Make the row hold ``tokens[:length]``: copies what the device has not seen."""
        have = min(self.known[seq_id], length)
        if have < length:
            self.buf[self.slot[seq_id], have:length] = on_device(tokens[have:length], self.device)
        self.known[seq_id] = length
