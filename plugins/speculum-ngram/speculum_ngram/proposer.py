"""Prompt lookup decoding (Saxena 2023): draft the tokens that followed an earlier
occurrence of the sequence's current suffix, in the prompt or the output so far.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``: take the last n tokens,
find their most recent earlier occurrence, and propose the (up to k) tokens after it.
The longest matching n wins. No model, so ``probs`` is None (one-hot drafts).

With a token tree in the speculative config (``tree_topk`` M, ``tree_depth`` D,
``num_draft_tokens``: a budget of ``num_draft_tokens - 1`` nodes, the root not counted)
a step drafts up to M *distinct* continuations of up to D tokens instead of one: for n
from ``prompt_lookup_max`` down, the tokens after each earlier occurrence of the last n
tokens, the most recent first (only the latest M occurrences of each n-gram are kept,
:class:`TreeSuffixIndex`), merged into a trie (:func:`continuation_trie`); a candidate
that would take the trie past the budget is skipped. ``scripts/ngram_ceiling.py
--trees`` replays exactly this rule.

Chains can also be drafted on the device from a verdict the host has not read yet
(:class:`~speculum.interfaces.VerdictDrafter`, :mod:`speculum_ngram.device`): the same
drafts, so that the loop may launch the next verify forward without a host round trip.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import numpy as np
import torch

from speculum.errors import ConfigError
from speculum.interfaces import Draft, ProposeBatch, StepFeedback, Verdict
from speculum.tree import TokenTree, TreeSpec

if TYPE_CHECKING:  # imported where used: `python -m speculum_ngram.corpus` runs that module as __main__
    from speculum_ngram.corpus import Corpus

DEFAULT_MIN, DEFAULT_MAX = 2, 5


@attrs.frozen
class NgramOptions:
    """Plugin options (``"options": {...}`` in the speculative config).

    ``search_window``: only the last this-many tokens are searched (0 = all).
    ``corpus``: a corpus file of the target's earlier answers (``python -m
    speculum_ngram.corpus build``) searched when the request itself has no match (chains);
    ``"shipped"``: the one shipped for the target's tokenizer (the default model's).
    """

    search_window: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    corpus: str | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.instance_of(str)))


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


class TreeSuffixIndex(SuffixIndex):
    """A :class:`SuffixIndex` that gives the latest ``keep`` end positions of every n-gram
    (0 = all of them), for drafting several continuations (:meth:`continuations`).

    Besides the latest end of each n-gram (``last``, as the chain index), each window end
    links to the previous end of the same n-gram (``prev[n - n_min][e]``, -1 = none): the
    ends of an n-gram, most recent first, are a walk down these links, cut after ``keep``.
    Indexing costs one dict read and write per window and n-gram length, no container
    per key. A separate class, so the chain path is untouched; a step still indexes only
    the tokens appended since the last one.
    """

    __slots__ = ("keep", "prev")

    def __init__(self, tokens: list[int], n_min: int, n_max: int, keep: int):
        super().__init__(tokens, n_min, n_max)
        self.keep = keep
        #: per n-gram length, per window end e: the previous end of the n-gram ending at e
        self.prev: list[list[int]] = [[] for _ in range(self.n_min, n_max + 1)]

    def _index_to(self, stop: int) -> None:
        """Index the windows ending before ``stop`` not indexed yet."""
        t, last, start = self.tokens, self.last, self.done
        if start >= stop:
            return
        for n, prev in zip(range(self.n_min, self.n_max + 1), self.prev):
            lo = max(start, n - 1)
            prev.extend([-1] * (lo - len(prev)))  # windows too short for n: no n-gram ends there
            if lo >= stop:
                continue
            cols = [t[lo - n + 1 + i: stop - n + 1 + i] for i in range(n)]
            get, add = last.get, prev.append
            for key, e in zip(zip(*cols), range(lo, stop)):
                add(get(key, -1))
                last[key] = e
        self.done = stop

    def draft(self, k: int, window: int = 0) -> list[int]:
        """The chain draft (the first continuation), for completeness."""
        c = self.continuations(k, 1, window) if k > 0 else []
        return list(c[0]) if c else []

    def continuations(self, depth: int, m: int, window: int = 0) -> list[tuple[int, ...]]:
        """Up to ``m`` distinct continuations of at most ``depth`` tokens of the suffix: for
        n from ``n_max`` down to ``n_min``, the tokens after each kept earlier occurrence
        of the last n tokens, the most recent first (``window``: as :meth:`SuffixIndex.draft`)."""
        t, last = self.tokens, self.last
        L = len(t)
        self._index_to(L - 1)  # windows end before the suffix's last token
        hi = min(self.n_max, (min(L, window) if window else L) - 1)
        out: list[tuple[int, ...]] = []
        keep = self.keep or L
        for n in range(hi, self.n_min - 1, -1):
            e, prev = last.get(tuple(t[L - n:]), -1), self.prev[n - self.n_min]
            for _ in range(keep):
                if e < 0 or (window and e - n + 1 < L - window):
                    break  # no more ends (older ones start even earlier)
                c = tuple(t[e + 1: e + 1 + depth])
                if c not in out:
                    out.append(c)
                    if len(out) == m:
                        return out
                e = prev[e]
        return out


def continuation_trie(paths: list[tuple[int, ...]], budget: int) -> tuple[list[int], list[int]]:
    """Merge token ``paths`` into a trie of at most ``budget`` nodes: (tokens, parents), one
    entry per node, -1 = the root, parents before their children. Paths are taken in
    order; one whose new nodes would exceed the budget is skipped (a later, shorter or
    more shared one may still fit)."""
    tokens: list[int] = []
    parents: list[int] = []
    node: dict[tuple[int, ...], int] = {}
    for path in paths:
        new = sum(1 for i in range(1, len(path) + 1) if path[:i] not in node)
        if len(tokens) + new > budget:
            continue
        for i in range(1, len(path) + 1):
            if path[:i] not in node:
                node[path[:i]] = len(tokens)
                tokens.append(path[i - 1])
                parents.append(node[path[:i - 1]] if i > 1 else -1)
    return tokens, parents


@attrs.define(eq=False)
class _Launched:
    """Chain drafts launched on the device from a verdict (:meth:`NgramProposer.draft_from_verdict`)."""

    seq_ids: tuple[int, ...]
    draft: Draft
    #: sequences whose new length observe() has recorded
    observed: set[int] = attrs.field(factory=set)


class NgramProposer:
    """Proposes continuations by looking up the current suffix in the context (each
    sequence's n-grams indexed once, :class:`SuffixIndex`); with ``tree`` set, a trie of
    several continuations per step (see the module doc). Chains may also be drafted from
    a verdict still on the device (:meth:`draft_from_verdict`): each sequence's tokens are
    then kept on the device as well (from the first such call on)."""

    #: drafts token trees when the config asks for a dynamic tree (``tree_topk`` etc.)
    supports_trees = True
    #: no KV cache of its own: nothing beyond the tree's nodes to reserve
    kv_lookahead = 0
    #: drafting from the verdict launches the next verify forward too unless the config says
    #: otherwise (the device lookup is one kernel: the forward need not wait for the host;
    #: H200, MT-bench, k = 4: 1.49x autoregressive against 1.35x for "draft", 1.36x for "off")
    from_verdict_default = "forward"
    #: the per-request hooks only free the device copy of a sequence's tokens, which only
    #: drafting from the verdict makes: a composite's first part ("ngram+eagle3"), whose hooks
    #: are not called and which never drafts from the verdict, keeps nothing that needs them
    hooks_optional = True

    #: steps after which the index of a sequence not seen since is dropped (finished
    #: requests; one that comes back after a pause is simply indexed again)
    forget_after = 256

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, search_window: int = 0,
                 tree: TreeSpec | None = None, corpus: Corpus | None = None):
        self.n_min = prompt_lookup_min
        self.n_max = prompt_lookup_max
        self.search_window = search_window
        #: the target's earlier answers, searched when the request has no match (None: off)
        self.corpus = corpus
        #: the tree drafted each step (dynamic: ``topk`` continuations of ``depth`` tokens,
        #: ``num_nodes`` nodes at most); None = chains
        self.tree = tree
        self._index: dict[int, SuffixIndex] = {}
        self._calls = 0
        #: each sequence's tokens on the device (made by the first draft_from_verdict call)
        self._history = None
        self._launched: _Launched | None = None

    def _index_of(self, seq) -> SuffixIndex:
        index = self._index.get(seq.seq_id)
        if index is None or index.tokens is not seq.token_ids or index.done > len(seq.token_ids):
            index = self._index[seq.seq_id] = (
                SuffixIndex(seq.token_ids, self.n_min, self.n_max) if self.tree is None
                else TreeSuffixIndex(seq.token_ids, self.n_min, self.n_max, keep=self.tree.topk))
        index.seen = self._calls
        return index

    def _draft(self, seq, k: int) -> list[int]:
        d = self._index_of(seq).draft(k, self.search_window)
        if not d and self.corpus is not None:
            d = self.corpus.draft(seq.token_ids, k)
        return d

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
        tree = cfg.tree
        if tree is not None and tree.is_static:
            raise ConfigError(
                "n-gram lookup has no ranked candidates per node, so a static speculative_token_tree means "
                "nothing to it; ask for a tree of continuations instead: tree_topk (distinct continuations), "
                "tree_depth (their length) and num_draft_tokens (nodes + 1), e.g. "
                '{"method": "ngram", "tree_topk": 8, "tree_depth": 4, "num_draft_tokens": 33}')
        if tree is not None and tree.num_nodes > tree.topk * tree.depth:
            raise ConfigError(
                f"num_draft_tokens={tree.num_draft_tokens} asks for {tree.num_nodes} nodes, but n-gram lookup "
                f"drafts at most tree_topk x tree_depth = {tree.topk * tree.depth} (tree_topk={tree.topk} "
                f"continuations of tree_depth={tree.depth} tokens); the rest would be padding verified every "
                f"step: set num_draft_tokens <= {tree.topk * tree.depth + 1}")
        if opts.corpus and tree is not None:
            raise ConfigError("options.corpus drafts chains: leave the tree out (tree_topk, tree_depth, "
                              "num_draft_tokens) or the corpus")
        corpus = None
        if opts.corpus:
            from speculum_ngram.corpus import load_corpus, shipped_corpus
            path = shipped_corpus(ctx.tokenizer, ctx.vocab_size) if opts.corpus == "shipped" else opts.corpus
            corpus = load_corpus(path, lo, hi, depth=max(cfg.num_speculative_tokens or 0, 1))
        return cls(lo, hi, opts.search_window, tree=tree, corpus=corpus)

    def propose(self, batch: ProposeBatch) -> Draft:
        k = batch.num_speculative_tokens
        launched = self._take_launched(batch.seqs)
        if launched is not None and k <= launched.token_ids.shape[1]:  # drafted from the verdict already
            return launched if k == launched.token_ids.shape[1] else Draft(
                token_ids=launched.token_ids[:, :k], lengths=[k] * len(batch.seqs), counts=launched.counts.clamp_max(k))
        if self._history is not None:
            self._history.sync(batch.seqs)
        self._calls += 1
        if self._calls % self.forget_after == 0:
            old = self._calls - self.forget_after
            self._index = {sid: ix for sid, ix in self._index.items() if ix.seen > old}
        if self.tree is not None and k > 0:
            return self._propose_tree(batch)
        rows = [self._draft(seq, k) if k > 0 else [] for seq in batch.seqs]
        lengths = [len(r) for r in rows]
        width = max(lengths, default=0)
        out = torch.tensor([r + [-1] * (width - n) for r, n in zip(rows, lengths)], dtype=torch.int64) \
            if width else torch.full((len(rows), 0), -1, dtype=torch.int64)
        return Draft(token_ids=out, probs=None, lengths=lengths)

    def _propose_tree(self, batch: ProposeBatch) -> Draft:
        """A trie of continuations per row (:func:`continuation_trie`), padded to the tree's
        fixed node count with token -1 under the root (such nodes are never accepted)."""
        spec = self.tree
        N, D, M = spec.num_nodes, spec.depth, spec.topk
        tokens, parents, lengths = [], [], []
        for seq in batch.seqs:
            paths = self._index_of(seq).continuations(D, M, self.search_window)
            tok, par = continuation_trie(paths, N)
            pad = [-1] * (N - len(tok))
            tokens.append(tok + pad)
            parents.append(par + pad)
            lengths.append(len(tok))
        # at most M distinct continuations, so no node has more than M children (padding, token
        # -1, does not count: the sampled verifier then loops depth x M times, not depth x N)
        tree = TokenTree(torch.tensor(parents, dtype=torch.int64), max_depth=D, max_children=min(M, N))
        return Draft(token_ids=torch.tensor(tokens, dtype=torch.int64), probs=None, lengths=lengths, tree=tree)

    def observe(self, feedback: StepFeedback) -> None:
        """Rows drafted from their verdict: their tokens on the device now reach the new length."""
        launched = self._launched
        if launched is None:
            return
        for sid, n in zip(feedback.seq_ids, feedback.new_lengths):
            if sid in launched.seq_ids and sid not in launched.observed:
                self._history.known[sid] = n
                launched.observed.add(sid)

    # -- drafting from a verdict still on the device (VerdictDrafter) ------------------------
    def add_request(self, seq) -> None:
        """Nothing to set up: a sequence's index and device tokens are made when first drafted for."""

    def remove_request(self, seq_id: int) -> None:
        self._index.pop(seq_id, None)
        if self._history is not None:
            self._history.release(seq_id)

    def rewind(self, seq_ids) -> None:
        """Drop drafts launched from a verdict (the tokens appended on the device are the
        sequences' own: they stay)."""
        self._launched = None

    def _take_launched(self, seqs) -> Draft | None:
        launched, self._launched = self._launched, None
        if (launched is not None and tuple(s.seq_id for s in seqs) == launched.seq_ids
                and launched.observed == set(launched.seq_ids)):
            return launched.draft
        return None

    def draft_from_verdict(self, seq_ids, lengths, verdict: Verdict, hidden_states) -> Draft | None:
        """The next chain drafts of ``seq_ids`` (``lengths``: their token counts before this
        step's tokens), looked up on the device after appending the verdict's tokens there
        (:mod:`speculum_ngram.device`): what :meth:`propose` would draft once the host has
        appended them. None for trees, and on the first call (which starts keeping the
        sequences' tokens on the device) or for a sequence whose device tokens are behind."""
        from speculum_ngram import kernels
        from speculum_ngram.device import DeviceHistory, suffix_match
        if self.tree is not None or verdict.path is not None:
            return None
        self._launched = None
        dev = verdict.token_ids.device
        h = self._history
        if h is None or h.device != dev:
            self._history = DeviceHistory(dev)
            return None
        if any(h.known.get(sid) != n for sid, n in zip(seq_ids, lengths)):
            return None
        R, q = verdict.token_ids.shape
        k = q - 1
        rows, base = torch.tensor([h.rows_of(seq_ids), list(lengths)], dtype=torch.int64).to(dev, non_blocking=True)
        corpus = self.corpus.on(dev) if self.corpus is not None else None
        if kernels.available(h.buf):  # one launch
            h.reserve(max(lengths) + q + 1)  # (the kernel appends the verdict's q tokens; append() reserves its own)
            draft, counts = kernels.ngram_draft(h.buf, rows, base, verdict.as_rows()[:, : 1 + q], self.n_min,
                                                self.n_max, k, self.search_window, corpus)
        else:  # the same as torch ops
            h.append(rows, base, verdict.token_ids, max(lengths))
            L = base + verdict.num_accepted.to(dev, torch.int64) + 1
            hist = h.buf[rows, : max(lengths) + q]
            draft, found, suffix = suffix_match(hist, L, self.n_min, self.n_max, k, self.search_window)
            if corpus is not None:
                cd, _ = corpus.lookup(suffix, L, k)
                draft = torch.where(found.view(R, 1), draft, cd)
            counts = (draft >= 0).sum(1)  # (valid drafts come first)
        # every row verifies k as far as the host knows; the loop reads the counts with the verdict
        launched = Draft(token_ids=draft, probs=None, lengths=[k] * R, counts=counts)
        self._launched = _Launched(tuple(seq_ids), launched)
        return launched
