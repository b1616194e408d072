"""Prompt lookup decoding (Saxena 2023): draft the tokens that followed an earlier
occurrence of the sequence's current suffix, in the prompt or the output so far.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``: take the last n tokens,
find their most recent earlier occurrence, and propose the (up to k) tokens after it.
The longest matching n wins. No model, so ``probs`` is None (one-hot drafts).
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from speculum.interfaces import Draft, ProposeBatch, StepFeedback

DEFAULT_MIN, DEFAULT_MAX = 2, 5


@attrs.frozen
class NgramOptions:
    """Plugin options (``"options": {...}`` in the speculative config).

    ``search_window``: only the last this-many tokens are searched (0 = all).
    """

    search_window: int = attrs.field(default=0, validator=attrs.validators.ge(0))


def find_ngram_draft(tokens, n_min: int, n_max: int, k: int) -> list[int]:
    """Draft up to ``k`` tokens for ``tokens`` (a 1-D int64 tensor, numpy array or list;
    empty list when no match): for n from ``n_max`` down to ``n_min``, the tokens after
    the most recent earlier occurrence of the last n tokens.

    One vectorised pass: the candidate ends are the earlier positions holding the last
    token; each one's backward match length (up to ``n_max``) is grown one position at a
    time over all candidates together. A step costs tens of microseconds at thousands of
    tokens (the host work of every n-gram step; a torch ``unfold`` per n cost ~100 us).
    """
    arr = tokens.numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens, dtype=np.int64)
    L = arr.shape[0]
    hi = min(n_max, L - 1)
    if hi < n_min or hi < 1:
        return []
    ends = np.flatnonzero(arr[: L - 1] == arr[L - 1])  # windows end at 0..L-2, before the suffix
    if ends.size == 0:
        return []
    match = np.ones(ends.size, dtype=np.int64)  # backward match length of each candidate end
    alive = np.ones(ends.size, dtype=bool)
    for j in range(1, hi):
        idx = ends - j
        ok = alive & (idx >= 0)
        ok[ok] = arr[idx[ok]] == arr[L - 1 - j]
        alive = ok
        match += alive
        if not alive.any():
            break
    for n in range(hi, n_min - 1, -1):
        hit = np.flatnonzero(match >= n)
        if hit.size:
            start = int(ends[hit[-1]]) + 1  # most recent occurrence (ends ascend)
            return arr[start: start + k].tolist()
    return []


class NgramProposer:
    """Proposes continuations by looking up the current suffix in the context."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, search_window: int = 0):
        self.n_min = prompt_lookup_min
        self.n_max = prompt_lookup_max
        self.search_window = search_window

    @classmethod
    def from_context(cls, ctx) -> "NgramProposer":
        cfg = ctx.config
        lo, hi = cfg.prompt_lookup_min, cfg.prompt_lookup_max
        if lo is None and hi is None:
            lo, hi = DEFAULT_MIN, DEFAULT_MAX
        elif lo is None:
            lo = min(DEFAULT_MIN, hi)
        elif hi is None:
            hi = max(DEFAULT_MAX, lo)
        opts = ctx.options or NgramOptions()
        return cls(lo, hi, opts.search_window)

    def propose(self, batch: ProposeBatch) -> Draft:
        k = batch.num_speculative_tokens
        rows = []
        for seq in batch.seqs:
            toks = seq.token_ids[-self.search_window:] if self.search_window else seq.token_ids
            rows.append(find_ngram_draft(np.fromiter(toks, dtype=np.int64, count=len(toks)), self.n_min,
                                         self.n_max, k))
        width = max((len(r) for r in rows), default=0)
        out = torch.full((len(rows), width), -1, dtype=torch.int64)
        for i, r in enumerate(rows):
            if r:
                out[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
        return Draft(token_ids=out, probs=None)

    def observe(self, feedback: StepFeedback) -> None:
        """Stateless: nothing to roll back."""
