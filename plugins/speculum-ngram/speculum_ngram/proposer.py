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

    One vectorised pass over the whole context: the candidate ends are the earlier
    positions holding the last token; each one's backward match length (up to ``n_max``)
    is grown one position at a time over all candidates together. For a one-off lookup;
    the proposer keeps an index per sequence instead (:class:`SuffixIndex`, tested to
    draft exactly this).
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


class SuffixIndex:
    """The latest end position of every n-gram (``n_min <= n <= n_max``) of one sequence,
    kept up to date as the sequence grows: a step indexes only the tokens appended since
    the last one, then looks the suffix up in a dict per n. It drafts exactly what
    :func:`find_ngram_draft` drafts (the latest earlier occurrence of the longest
    matching suffix), at a few microseconds a row instead of a vectorised pass over the
    whole context each step (tens of microseconds a row: a millisecond of host time a
    step at 40 rows, which served requests wait for).

    ``tokens`` is the sequence's own list, which only grows (a step appends, nothing
    rewrites it); an index built for another list is never used for it. The n-gram
    lengths are fixed at construction: what is indexed depends on them.
    """

    __slots__ = ("tokens", "n_min", "n_max", "done", "last", "seen")

    def __init__(self, tokens: list[int], n_min: int, n_max: int):
        self.tokens = tokens
        self.n_min, self.n_max = max(n_min, 1), n_max
        self.done = 0  # window ends 0 .. done - 1 are indexed
        self.last: dict[tuple[int, ...], int] = {}
        self.seen = 0

    def draft(self, k: int, window: int = 0) -> list[int]:
        t, last, n_min, n_max = self.tokens, self.last, self.n_min, self.n_max
        L = len(t)
        if L - 1 - self.done > 16:  # a first draft: a whole context at once
            self._index_many(self.done, L - 1)
        else:  # a step's few new tokens: a tuple each is cheaper than slicing
            for e in range(self.done, L - 1):  # windows end before the suffix's last token
                for n in range(n_min, min(n_max, e + 1) + 1):
                    last[tuple(t[e - n + 1: e + 1])] = e
        self.done = max(self.done, L - 1)
        hi = min(n_max, (min(L, window) if window else L) - 1)
        for n in range(hi, n_min - 1, -1):
            e = last.get(tuple(t[L - n:]))
            if e is not None and (not window or e - n + 1 >= L - window):
                return t[e + 1: e + 1 + k]
        return []

    def _index_many(self, start: int, stop: int) -> None:
        """Index the windows ending at ``start .. stop - 1``: per n, the n-grams are zipped
        from n shifted slices in C (a first draft indexes a whole prompt: hundreds of
        windows; faster than a tuple per window in Python), each key keeping its latest
        end (ends ascend within an n; later calls only index later ends)."""
        t, last = self.tokens, self.last
        for n in range(self.n_min, self.n_max + 1):
            lo = max(start, n - 1)
            if lo >= stop:
                continue
            cols = [t[lo - n + 1 + i: stop - n + 1 + i] for i in range(n)]
            last.update(zip(zip(*cols), range(lo, stop)))


class NgramProposer:
    """Proposes continuations by looking up the current suffix in the context (each
    sequence's n-grams indexed once, :class:`SuffixIndex`)."""

    #: steps after which the index of a sequence not seen since is dropped (finished
    #: requests; one that comes back after a pause is simply indexed again)
    forget_after = 256

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, search_window: int = 0):
        self.n_min = prompt_lookup_min
        self.n_max = prompt_lookup_max
        self.search_window = search_window
        self._index: dict[int, SuffixIndex] = {}
        self._calls = 0

    def _draft(self, seq, k: int) -> list[int]:
        index = self._index.get(seq.seq_id)
        if index is None or index.tokens is not seq.token_ids or index.done > len(seq.token_ids):
            index = self._index[seq.seq_id] = SuffixIndex(seq.token_ids, self.n_min, self.n_max)
        index.seen = self._calls
        return index.draft(k, self.search_window)

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
        self._calls += 1
        if self._calls % self.forget_after == 0:
            old = self._calls - self.forget_after
            self._index = {sid: ix for sid, ix in self._index.items() if ix.seen > old}
        rows = [self._draft(seq, k) if k > 0 else [] for seq in batch.seqs]
        lengths = [len(r) for r in rows]
        width = max(lengths, default=0)
        out = torch.tensor([r + [-1] * (width - n) for r, n in zip(rows, lengths)], dtype=torch.int64) \
            if width else torch.full((len(rows), 0), -1, dtype=torch.int64)
        return Draft(token_ids=out, probs=None, lengths=lengths)

    def observe(self, feedback: StepFeedback) -> None:
        """Stateless: nothing to roll back."""
