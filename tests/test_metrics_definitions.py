"""The speculation figures mean what vLLM means by them (pinned on a scripted proposer)."""

from __future__ import annotations

import pytest
import torch

from speculum import Draft, LLM, SamplingParams, hookimpl
from speculum.metrics import SpecDecodeMetrics
from speculum.testing import tiny_model_dir


def test_definitions_on_recorded_steps():
    m = SpecDecodeMetrics()
    # (drafted, accepted) per verify step; one step without a draft
    steps = [(4, 4), (4, 1), (0, 0), (2, 2), (3, 0)]
    for d, a in steps:
        m.record_step(d, a)
    assert m.num_steps == 5 and m.num_drafts == 4
    assert m.draft_acceptance_rate == 7 / 13
    assert m.mean_acceptance_length == 1 + 7 / 4          # per drafting step (vLLM)
    assert m.tokens_per_step == 1 + 7 / 5                 # per target forward
    # position i: accepted there / drafts that reached it
    assert m.drafts_per_position == [4, 4, 3, 2]
    assert m.accepted_per_position == [3, 2, 1, 1]
    assert m.acceptance_rate_per_position() == [3 / 4, 2 / 4, 1 / 3, 1 / 2]


def test_nothing_drafted_means_no_rate():
    m = SpecDecodeMetrics()
    m.record_step(0, 0)
    assert m.draft_acceptance_rate is None and m.mean_acceptance_length is None
    assert m.acceptance_rate_per_position() == [] and m.tokens_per_step == 1.0
    d = m.as_dict()
    assert d["draft_acceptance_rate"] is None and d["mean_acceptance_length"] is None


MAX_TOKENS = 40


class Scripted:
    """Drafts ``lengths[i]`` tokens at its i-th call (cycling): the target's own next tokens
    for the first ``good[i]``, then wrong ones. It logs (drafted, accepted) as the engine
    will see them (drafts past the request's room are cut by the loop)."""

    def __init__(self, lengths=(3, 1, 0, 2, 3), good=(2, 1, 0, 0, 3)):
        self.lengths, self.good, self.i = lengths, good, 0
        self.truth: dict = {}
        self.log: list[tuple[int, int]] = []

    def propose(self, batch):
        k = batch.num_speculative_tokens
        rows, lengths = [], []
        for s in batch.seqs:
            n, g = self.lengths[self.i % len(self.lengths)], self.good[self.i % len(self.good)]
            self.i += 1
            out = s.token_ids[s.num_prompt_tokens:]
            future = self.truth[tuple(out)]
            drafted = [future[j] if j < g else (future[j] + 1) % 512 for j in range(n)]
            room = MAX_TOKENS - len(out)
            n_eff = min(n, max(room - 1, 0))
            self.log.append((n_eff, min(g, n_eff)))
            rows.append(drafted + [-1] * (k - n))
            lengths.append(n)
        return Draft(token_ids=torch.tensor(rows, dtype=torch.int64), lengths=lengths)

    def observe(self, feedback):
        pass


def test_per_position_equals_accepted_over_drafts_reaching_it(tmp_path):
    target = tiny_model_dir(tmp_path / "t")
    prompt = {"prompt_token_ids": [5, 9, 11, 3]}
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ref = LLM(str(target), dtype="float32", device="cpu", seed=0).generate(prompt, params)[0].token_ids
    proposer = Scripted()
    proposer.truth = {tuple(ref[:i]): ref[i:] + [0] * 8 for i in range(len(ref))}

    class Plugin:
        @hookimpl
        def speculum_register_proposers(self, register):
            register("scripted", lambda ctx: proposer)

    llm = LLM(str(target), {"method": "scripted", "num_speculative_tokens": 3}, dtype="float32", device="cpu",
              plugins=[Plugin()])
    out = llm.generate(prompt, params)[0]
    assert out.token_ids == ref
    reached, accepted = [0, 0, 0], [0, 0, 0]
    for n, a in proposer.log:
        for i in range(n):
            reached[i] += 1
        for i in range(a):
            accepted[i] += 1
    m = out.metrics
    assert m.num_drafts == sum(1 for n, _ in proposer.log if n) == reached[0]
    assert m.drafts_per_position == reached and m.accepted_per_position == accepted
    assert m.acceptance_rate_per_position() == [a / r for a, r in zip(accepted, reached)]
    assert m.mean_acceptance_length == 1 + sum(accepted) / reached[0]
    assert m.tokens_per_step == 1 + sum(accepted) / len(proposer.log)
