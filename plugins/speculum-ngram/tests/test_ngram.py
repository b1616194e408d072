"""Unit tests of prompt lookup: find_ngram_draft, NgramProposer batching and defaults."""

from __future__ import annotations

import types

import pytest
import torch

from speculum.config import SpeculativeConfig
from speculum.interfaces import ProposeBatch, SequenceView
from speculum.sampling import SamplingBatch, SamplingParams
from speculum_ngram import NgramOptions, NgramProposer, find_ngram_draft
from speculum_ngram.proposer import DEFAULT_MAX, DEFAULT_MIN, SuffixIndex


def draft(tokens, n_min=1, n_max=5, k=3):
    return find_ngram_draft(torch.tensor(tokens, dtype=torch.int64), n_min, n_max, k)


# ------------------------------------------------------------------ find_ngram_draft
def test_longest_match_wins():
    # suffix [1, 2, 3] occurred at the start (followed by 10, 11); the shorter suffix
    # [2, 3] occurred more recently (followed by 20, 21): the longer match wins
    tokens = [1, 2, 3, 10, 11, 2, 3, 20, 21, 1, 2, 3]
    assert draft(tokens, n_max=3, k=2) == [10, 11]
    assert draft(tokens, n_max=2, k=2) == [20, 21]  # n_max bounds the match length


def test_most_recent_occurrence_wins():
    tokens = [5, 6, 1, 9, 5, 6, 2, 8, 5, 6]
    assert draft(tokens, n_min=2, n_max=2, k=2) == [2, 8]
    # also for single tokens
    assert draft([7, 1, 7, 2, 7], n_min=1, n_max=1, k=1) == [2]


def test_min_bound():
    tokens = [4, 9, 8, 7, 4]  # only the 1-gram [4] recurs
    assert draft(tokens, n_min=1, n_max=3, k=2) == [9, 8]
    assert draft(tokens, n_min=2, n_max=3, k=2) == []


def test_no_match():
    assert draft([1, 2, 3, 4, 5]) == []
    assert draft([]) == []
    assert draft([7]) == []  # nothing before the suffix
    assert draft([7, 7], n_min=2, n_max=2) == []  # the suffix itself is not a match


def test_k_truncated_at_end_of_context():
    # [1, 2] matched at the start: the continuation runs into the suffix and then ends
    assert draft([1, 2, 3, 1, 2], n_min=2, n_max=2, k=5) == [3, 1, 2]
    assert draft([1, 2, 3, 1, 2], n_min=2, n_max=2, k=2) == [3, 1]
    # overlapping match in a constant run: continuation is cut at the context end
    assert draft([7, 7, 7, 7], n_min=2, n_max=3, k=4) == [7]


def test_n_max_larger_than_context():
    assert draft([3, 4, 3], n_min=1, n_max=10, k=4) == [4, 3]


def test_k_zero():
    assert draft([1, 2, 1], k=0) == []


# ------------------------------------------------------------------ NgramProposer
def batch(rows, k):
    params = [SamplingParams(temperature=0)] * len(rows)
    views = [SequenceView(i, list(r), 1) for i, r in enumerate(rows)]
    return ProposeBatch(views, k, SamplingBatch.from_params(params, [None] * len(rows)))


def test_propose_pads_rows_with_minus_one():
    prop = NgramProposer(1, 3)
    rows = [
        [1, 2, 3, 4, 1, 2],      # match [1, 2] -> 3, 4, 1 (k=3)
        [9, 8, 7],               # no match
        [5, 6, 5],               # match [5] -> 6, 5 (context end)
    ]
    d = prop.propose(batch(rows, 3))
    assert d.probs is None
    assert d.token_ids.dtype == torch.int64
    assert d.token_ids.tolist() == [[3, 4, 1], [-1, -1, -1], [6, 5, -1]]
    assert d.num_tokens.tolist() == [3, 0, 2]


def test_propose_width_is_the_longest_draft():
    prop = NgramProposer(1, 3)
    d = prop.propose(batch([[5, 6, 5], [9, 8, 7]], 4))
    assert d.token_ids.shape == (2, 2)  # narrower than k
    assert d.token_ids.tolist() == [[6, 5], [-1, -1]]
    empty = prop.propose(batch([[1, 2, 3], [4, 5]], 4))
    assert empty.token_ids.shape == (2, 0)
    assert empty.num_tokens.tolist() == [0, 0]


def test_search_window():
    rows = [[1, 2, 9, 9, 9, 9, 1]]
    assert NgramProposer(1, 1).propose(batch(rows, 2)).token_ids.tolist() == [[2, 9]]
    # the old occurrence of 1 lies outside the last 4 tokens
    assert NgramProposer(1, 1, search_window=4).propose(batch(rows, 2)).token_ids.shape == (1, 0)


def test_observe_is_a_no_op():
    NgramProposer(1, 2).observe(None)


# ------------------------------------------------------------------ defaults from config
def from_config(**kw):
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=3, **kw)
    return NgramProposer.from_context(types.SimpleNamespace(config=cfg, options=None))


@pytest.mark.parametrize("given, expected", [
    ({}, (DEFAULT_MIN, DEFAULT_MAX)),
    ({"prompt_lookup_min": 3}, (3, 5)),
    ({"prompt_lookup_min": 7}, (7, 7)),
    ({"prompt_lookup_max": 4}, (2, 4)),
    ({"prompt_lookup_max": 1}, (1, 1)),
    ({"prompt_lookup_min": 1, "prompt_lookup_max": 9}, (1, 9)),
])
def test_lookup_bounds_from_config(given, expected):
    assert (DEFAULT_MIN, DEFAULT_MAX) == (2, 5)
    p = from_config(**given)
    assert (p.n_min, p.n_max) == expected
    assert p.search_window == 0


def test_options_from_context():
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    p = NgramProposer.from_context(types.SimpleNamespace(config=cfg, options=NgramOptions(search_window=64)))
    assert p.search_window == 64
    with pytest.raises(ValueError):
        NgramOptions(search_window=-1)


def test_registered_through_the_entry_point():
    from speculum.plugins import build_registry
    spec = build_registry().methods["ngram"]
    assert spec.factory == NgramProposer.from_context
    assert spec.options is NgramOptions and spec.backends == ("torch", "jax")


def _reference(tokens: torch.Tensor, n_min: int, n_max: int, k: int) -> list[int]:
    """The definition, one unfold per n (the implementation before the vectorised search)."""
    L = tokens.shape[0]
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n:]
        hits = (tokens[: L - 1].unfold(0, n, 1) == suffix).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return tokens[start: start + k].tolist()
    return []


@pytest.mark.parametrize("vocab", [3, 8, 50])
def test_vectorised_search_equals_the_definition(vocab):
    """2,000 random sequences (small vocabularies: many candidate matches, long runs)."""
    g = torch.Generator().manual_seed(vocab)
    for _ in range(2000):
        L = int(torch.randint(1, 60, (1,), generator=g))
        t = torch.randint(0, vocab, (L,), generator=g)
        n_min = int(torch.randint(1, 4, (1,), generator=g))
        n_max = n_min + int(torch.randint(0, 5, (1,), generator=g))
        k = int(torch.randint(1, 6, (1,), generator=g))
        want = _reference(t, n_min, n_max, k)
        assert find_ngram_draft(t, n_min, n_max, k) == want
        assert find_ngram_draft(t.tolist(), n_min, n_max, k) == want


@pytest.mark.parametrize("vocab", [3, 8, 50])
@pytest.mark.parametrize("n_min,n_max,window", [(1, 5, 0), (2, 5, 0), (3, 3, 0), (1, 4, 12), (2, 6, 20)])
def test_the_proposer_index_drafts_what_the_search_drafts(vocab, n_min, n_max, window):
    """The proposer indexes each sequence's n-grams as it grows (SuffixIndex); step by step
    (1-5 tokens appended between steps, as accepted drafts do) its drafts equal
    find_ngram_draft over the whole (or windowed) context, for 3 sequences at once."""
    g = torch.Generator().manual_seed(100 * vocab + n_min + n_max + window)
    p = NgramProposer(n_min, n_max, window)
    seqs = [SequenceView(i, torch.randint(0, vocab, (1 + 5 * i,), generator=g).tolist(), 1) for i in range(3)]
    params = [SamplingParams(temperature=0)] * 3
    checked = 0
    for step in range(120):
        k = 1 + step % 4
        got = p.propose(ProposeBatch(seqs, k, SamplingBatch.from_params(params, [None] * 3))).token_ids
        for b, s in enumerate(seqs):
            ctx = s.token_ids[-window:] if window else s.token_ids
            want = find_ngram_draft(ctx, n_min, n_max, k)
            row = [t for t in got[b].tolist() if t >= 0]
            assert row == want, (step, b)
            checked += bool(want)
            grow = 1 + int(torch.randint(0, 5, (1,), generator=g))
            if step % 2:  # half the time a piece of earlier text comes back (as in real answers)
                at = int(torch.randint(0, len(s.token_ids), (1,), generator=g))
                s.token_ids.extend(s.token_ids[at: at + 2 * grow + 2])
            else:
                s.token_ids.extend(torch.randint(0, vocab, (grow,), generator=g).tolist())
    assert checked > 40  # of 360 row-steps, those with a draft (the fewest: a window of 20, n >= 2, vocabulary 50)


@pytest.mark.parametrize("vocab", [3, 8, 50])
@pytest.mark.parametrize("n_min,n_max", [(1, 5), (2, 5), (3, 3)])
def test_indexing_many_windows_at_once_drafts_what_the_search_drafts(vocab, n_min, n_max):
    """A first draft over a long prompt, and gaps of up to 60 tokens between drafts, index
    many windows at once (the path that zips n-grams from shifted slices, taken above 16
    windows); the drafts still equal find_ngram_draft over the whole context. The test
    above grows by at most 12 tokens from short prompts, so it never takes that path."""
    g = torch.Generator().manual_seed(7 * vocab + n_min + n_max)
    checked = bulk = 0
    for trial in range(40):
        tokens = torch.randint(0, vocab, (int(torch.randint(17, 200, (1,), generator=g)),), generator=g).tolist()
        ix = SuffixIndex(tokens, n_min, n_max)
        for step in range(12):
            k = 1 + step % 4
            before = ix.done
            want = find_ngram_draft(tokens, n_min, n_max, k)
            assert ix.draft(k) == want, (trial, step)
            bulk += ix.done - before > 16
            checked += bool(want)
            grow = int(torch.randint(0, 60, (1,), generator=g))
            if step % 2:
                at = int(torch.randint(0, len(tokens), (1,), generator=g))
                tokens.extend(tokens[at: at + grow])
            else:
                tokens.extend(torch.randint(0, vocab, (grow,), generator=g).tolist())
    assert bulk > 100 and checked > 100


def test_an_index_is_never_used_for_another_sequence():
    """A seq_id that comes back with another token list (a new request) is indexed anew;
    indexes of sequences not seen for forget_after steps are dropped."""
    p = NgramProposer(1, 3)
    p.forget_after = 4
    params = [SamplingParams(temperature=0)]

    def one(view, k=2):
        return [t for t in p.propose(ProposeBatch([view], k, SamplingBatch.from_params(params, [None]))).token_ids[0].tolist()
                if t >= 0]

    assert one(SequenceView(0, [5, 6, 7, 5], 1)) == [6, 7]
    assert one(SequenceView(0, [9, 8, 9], 1)) == [8, 9]  # same id, another list: not [6, 7]
    for i in range(8):
        one(SequenceView(1, [1, 2, 1], 1))
    assert 0 not in p._index and 1 in p._index
