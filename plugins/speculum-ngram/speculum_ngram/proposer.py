"""Prompt lookup decoding (Saxena 2023): draft the tokens that followed an earlier
occurrence of the sequence's current suffix, in the prompt or the output so far.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``: take the last n tokens,
find their most recent earlier occurrence, and propose the (up to k) tokens after it.
The longest matching n wins. No model, so ``probs`` is None (one-hot drafts).
"""

from __future__ import annotations

import attrs
import torch

from speculum.interfaces import Draft, ProposeBatch, StepFeedback

DEFAULT_MIN, DEFAULT_MAX = 2, 5


@attrs.frozen
class NgramOptions:
    """Plugin options (``"options": {...}`` in the speculative config).

    ``search_window``: only the last this-many tokens are searched (0 = all).
    """

    search_window: int = attrs.field(default=0, validator=attrs.validators.ge(0))


def find_ngram_draft(tokens: torch.Tensor, n_min: int, n_max: int, k: int) -> list[int]:
    """Draft up to ``k`` tokens for the 1-D int64 ``tokens`` (empty list when no match)."""
    L = tokens.shape[0]
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n:]
        # windows starting at 0..L-n-1 (exclude the suffix itself)
        windows = tokens[: L - 1].unfold(0, n, 1)
        hits = (windows == suffix).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n  # most recent occurrence
            return tokens[start: start + k].tolist()
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
            rows.append(find_ngram_draft(torch.tensor(toks, dtype=torch.int64), self.n_min, self.n_max, k))
        width = max((len(r) for r in rows), default=0)
        out = torch.full((len(rows), width), -1, dtype=torch.int64)
        for i, r in enumerate(rows):
            if r:
                out[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
        return Draft(token_ids=out, probs=None)

    def observe(self, feedback: StepFeedback) -> None:
        """Stateless: nothing to roll back."""
