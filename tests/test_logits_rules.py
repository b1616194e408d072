"""Token-dependent logits processing, position by position (speculum.logits_process).

The claim that keeps rejection sampling exact with penalties: in a verify step, the
processed target logits at position ``t`` equal what plain decoding would compute after
emitting the drafts ``d_1 .. d_t`` (:meth:`LogitsRules.apply` with the drafts as
``new_tokens``). These tests check that identity against a one-position-at-a-time
reference written here from the definitions (OpenAI's presence / frequency penalties
over the output, the repetition penalty over prompt and output, logit_bias, min_tokens,
bad words, min_p), and that a proposer's i-th draft step (``offset = i``) sees the same.
"""

from __future__ import annotations

import math

import pytest
import torch

from speculum.logits_process import LogitsRules, TokenRules
from speculum.sampling import SamplingBatch, SamplingParams

V = 11


def reference(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams,
              rules: TokenRules) -> torch.Tensor:
    """One position's processed logits [V], from the definitions, in float64."""
    l = logits.double().clone()
    for w in rules.bad_words:
        if len(w) == 1 or output[len(output) - len(w) + 1:] == list(w[:-1]) and len(output) >= len(w) - 1:
            l[w[-1]] = -math.inf
    if len(output) < p.min_tokens:
        for t in rules.min_tokens_stop_ids:
            l[t] = -math.inf
    for tok, b in p.logit_bias:
        l[tok] += b
    for tok in set(prompt) | set(output):
        if p.repetition_penalty != 1.0:
            l[tok] = l[tok] / p.repetition_penalty if l[tok] > 0 else l[tok] * p.repetition_penalty
    for tok in set(output):
        l[tok] -= p.frequency_penalty * output.count(tok) + p.presence_penalty
    if p.min_p > 0 and p.temperature > 0:
        probs = (l / p.temperature).softmax(-1)
        l[probs < p.min_p * probs.max()] = -math.inf
    return l


CASES = [
    SamplingParams(temperature=1.0, presence_penalty=1.2, frequency_penalty=0.7),
    SamplingParams(temperature=0.7, repetition_penalty=1.8),
    SamplingParams(temperature=0.0, frequency_penalty=-0.5, repetition_penalty=0.6),
    SamplingParams(temperature=1.3, logit_bias={3: 5.0, 4: -100}, min_p=0.15),
    SamplingParams(temperature=1.0, min_tokens=6, stop_token_ids=[2]),
    SamplingParams(temperature=1.0, bad_words=["x"]),  # rules carry the token ids below
]
RULES = [TokenRules(), TokenRules(), TokenRules(), TokenRules(), TokenRules(min_tokens_stop_ids=(0, 2)),
         TokenRules(bad_words=((5,), (6, 7), (7, 8, 9)))]


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, T = len(CASES), 4
    prompts = [torch.randint(0, V, (5,), generator=g).tolist() for _ in range(B)]
    outputs = [torch.randint(0, V, (3,), generator=g).tolist() for _ in range(B)]
    outputs[5] = [1, 6]  # the bad word (6, 7) is armed at position 0
    drafts = torch.randint(0, V, (B, T - 1), generator=g)
    drafts[5] = torch.tensor([7, 8, 1])  # (7, 8, 9) armed at position 2
    drafts[0, 2] = -1  # a row with 2 valid drafts: its position 3 is never used
    logits = torch.randn(B, T, V, generator=g) * 3
    histories = [(pr + out, len(pr)) for pr, out in zip(prompts, outputs)]
    return prompts, outputs, drafts, logits, histories


def test_every_verify_position_sees_the_drafts_before_it():
    prompts, outputs, drafts, logits, histories = _batch()
    got = LogitsRules(CASES, histories, RULES, "cpu").apply(logits, drafts)
    for b, p in enumerate(CASES):
        valid = drafts[b].tolist()
        n_valid = valid.index(-1) if -1 in valid else len(valid)
        for t in range(n_valid + 1):
            want = reference(logits[b, t], prompts[b], outputs[b] + valid[:t], p, RULES[b])
            assert torch.equal(torch.isinf(got[b, t]), torch.isinf(want)), (b, t)
            fin = torch.isfinite(want)
            assert torch.allclose(got[b, t][fin].double(), want[fin], atol=1e-5), (b, t)


def test_a_proposers_ith_draft_step_matches_the_verify_position():
    """Draft step i (offset i, one position) equals verify position i for every row."""
    _prompts, _outputs, drafts, logits, histories = _batch(1)
    rules = LogitsRules(CASES, histories, RULES, "cpu")
    full = rules.apply(logits, drafts)
    for i in range(drafts.shape[1] + 1):
        one = rules.apply(logits[:, i: i + 1], drafts[:, :i], offset=i)
        for b in range(len(CASES)):
            if (drafts[b, :i] < 0).any():
                continue
            assert torch.equal(one[b, 0], full[b, i]), (b, i)


def test_a_subset_of_rows_is_processed_with_its_own_settings():
    _prompts, _outputs, drafts, logits, histories = _batch(2)
    rules = LogitsRules(CASES, histories, RULES, "cpu")
    full = rules.apply(logits, drafts)
    rows = [4, 1, 5]
    sub = rules.apply(logits[rows], drafts[rows], rows=rows)
    assert torch.equal(sub, full[rows])


def test_the_wrong_variant_counting_no_drafts_differs():
    """What the per-position counting prevents: the same penalties at every position."""
    prompts, outputs, drafts, logits, histories = _batch()
    rules = LogitsRules(CASES[:1], histories[:1], RULES[:1], "cpu")
    right = rules.apply(logits[:1], drafts[:1])
    wrong = torch.stack([rules.apply(logits[:1, t: t + 1])[0, 0] for t in range(logits.shape[1])]).unsqueeze(0)
    assert torch.equal(right[:, 0], wrong[:, 0])  # position 0 follows no draft
    assert not torch.allclose(right[:, 1:3], wrong[:, 1:3])


def test_sampling_batch_skips_processing_when_no_row_asks():
    sb = SamplingBatch.from_params([SamplingParams(temperature=1.0)] * 2, [None] * 2)
    logits = torch.randn(2, 3, V)
    assert not sb.needs_processing
    assert sb.process_logits(logits) is logits


def test_sampling_batch_without_histories_says_what_is_missing():
    sb = SamplingBatch.from_params([SamplingParams(presence_penalty=1.0)], [None])
    with pytest.raises(ValueError, match="histories"):
        sb.process_logits(torch.randn(1, 1, V))


@pytest.mark.parametrize("bad", [dict(presence_penalty=3.0), dict(min_p=1.5), dict(repetition_penalty=0.0),
                                 dict(logit_bias={1: 200}), dict(n=0), dict(n=3, best_of=2), dict(logprobs=-1),
                                 dict(min_tokens=-1), dict(num_speculative_tokens=-2)])
def test_out_of_range_sampling_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
