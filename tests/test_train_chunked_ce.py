"""The whole-vocabulary soft cross-entropy in row chunks (speculum.train.base.scored_ce).

Above ``chunk_elements`` logits, the trainers' loss goes in row chunks recomputed in the
backward pass, so autograd keeps the draft's states instead of [rows x vocabulary] floats
(one trainer took 74 GB of the H200 that way and the next beside it ran out of memory). The
chunked loss must be the same loss: value, gradients and argmax as the one-shot one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from speculum.train.base import scored_ce, soft_ce


def _case(n=37, h=16, v=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(n, h, generator=g, requires_grad=True)
    w = torch.randn(v, h, generator=g, requires_grad=True)
    probs = torch.softmax(torch.randn(n + 5, v, generator=g) * 3, dim=-1)
    rows = torch.randperm(n + 5, generator=g)[:n]
    return o, w, probs, rows


def test_chunked_loss_gradients_and_argmax_equal_the_one_shot_ones():
    o, w, probs, rows = _case()
    want = soft_ce(F.linear(o, w), probs[rows])
    want_pred = F.linear(o, w).argmax(-1)
    gw = torch.autograd.grad(want, (o, w))
    for chunk in (101, 5 * 101, 10 * 101 + 7, 37 * 101):  # 1, 5, 10 rows a chunk; the one-shot path
        got, pred = scored_ce(lambda x: F.linear(x, w), o, probs, rows, chunk_elements=chunk)
        gg = torch.autograd.grad(got, (o, w))
        torch.testing.assert_close(got, want)
        assert torch.equal(pred, want_pred)
        for a, b in zip(gg, gw):
            torch.testing.assert_close(a, b)


def test_chunks_keep_no_rows_by_vocabulary_tensor_for_backward():
    """What autograd saves in the forward pass: with chunks, no [rows x vocabulary] tensor of its
    own (the target's probabilities, shared and already in memory, may be referenced); in one
    shot, several."""
    o, w, probs, rows = _case(n=64, v=512)
    big = 64 * 512

    def saved(chunk):
        new = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: new.append(t) or t if t.numel() >= big and t.data_ptr() != probs.data_ptr() else t,
                lambda t: t):
            loss, _ = scored_ce(lambda x: F.linear(x, w), o, probs, rows, chunk_elements=chunk)
        loss.backward()
        return new

    assert len(saved(1 << 30)) >= 2  # the log-softmax output and the gathered probabilities, at least
    assert saved(8 * 512) == []


def test_no_grad_and_empty_rows():
    o, w, probs, rows = _case()
    with torch.no_grad():
        got, pred = scored_ce(lambda x: F.linear(x, w), o, probs, rows, chunk_elements=202)
    torch.testing.assert_close(got, soft_ce(F.linear(o, w), probs[rows]).detach())
    assert pred.shape == (37,)
    empty, pred = scored_ce(lambda x: F.linear(x, w), o[:0], probs, rows[:0], chunk_elements=202)
    assert float(empty.detach()) == 0.0 and pred.shape == (0,)


def test_target_distribution_in_chunks_equals_one_shot(monkeypatch):
    """TargetDist fills the target's probabilities and top tokens chunk by chunk: the same as
    from the whole [rows x vocabulary] logits, over the whole vocabulary, within a
    sub-vocabulary, and with the whole vocabulary's top token for validation (``full``)."""
    import speculum.train.base as base
    from speculum.train.data import Batch

    g = torch.Generator().manual_seed(1)
    B, T, H, V = 2, 9, 8, 50
    hidden = torch.randn(B, T, H, generator=g)
    lm_head = torch.randn(V, H, generator=g)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, 6:] = False
    batch = Batch(tokens=torch.zeros(B, T, dtype=torch.int64), hidden={-1: hidden}, valid=valid,
                  answer_next=torch.ones(B, T, dtype=torch.bool))
    vocab = torch.tensor([1, 4, 7, 20, 33, 41])
    feats = hidden[batch.target_mask(0)]
    for sub, full in ((None, False), (vocab, False), (vocab, True)):
        monkeypatch.setattr(base, "CE_CHUNK_ELEMENTS", 1 << 30)
        one = base.TargetDist(batch, lm_head, vocab=sub, full=full)
        monkeypatch.setattr(base, "CE_CHUNK_ELEMENTS", 2 * V)  # two rows a chunk
        assert len(base.row_chunks(len(feats), V)) == (len(feats) + 1) // 2
        chunked = base.TargetDist(batch, lm_head, vocab=sub, full=full)
        torch.testing.assert_close(chunked.probs, one.probs)
        assert torch.equal(chunked.argmax, one.argmax)
        logits = feats @ (lm_head if sub is None else lm_head[sub]).T
        torch.testing.assert_close(one.probs, logits.softmax(-1))
        want = (feats @ lm_head.T).argmax(-1) if full or sub is None else sub[logits.argmax(-1)]
        assert torch.equal(one.argmax, want)
