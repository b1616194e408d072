"""Losslessness on the real default model (SmolLM2-135M-Instruct, fp32, CPU).

Greedy output with ngram and draft_model speculation must be token-identical to the
non-speculative output on MT-bench prompts (5 prompts, 64 new tokens each).
"""

from __future__ import annotations

import pytest

from speculum import LLM, SamplingParams
from speculum.testing import mt_bench_prompts

pytestmark = pytest.mark.real_model

NUM_PROMPTS, MAX_TOKENS = 5, 64


@pytest.fixture(scope="module")
def prompts():
    # one prompt from each of the first categories, as chat messages
    rows, seen = [], set()
    for r in mt_bench_prompts():
        if r["category"] not in seen:
            seen.add(r["category"])
            rows.append([{"role": "user", "content": r["turns"][0]}])
    return rows[:NUM_PROMPTS]


@pytest.fixture(scope="module")
def baseline(prompts):
    llm = LLM(dtype="float32", device="cpu", max_num_seqs=NUM_PROMPTS)
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4},
    {"model": "[ngram]", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    {"model": "SmolLM2-135M-Instruct", "num_speculative_tokens": 3, "options": {"num_layers": 10}},
], ids=["ngram-k4", "ngram-k6-min1", "draft_model-10layers"])
def test_greedy_identical_on_real_model(prompts, baseline, spec):
    llm = LLM(speculative_config=spec, dtype="float32", device="cpu", max_num_seqs=NUM_PROMPTS)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    for b, o in zip(baseline, outs):
        assert len(o.token_ids) == MAX_TOKENS
        assert o.token_ids == b.token_ids
        assert o.text == b.text
    m = llm.metrics
    assert m.num_draft_tokens > 0, "speculation never drafted: the comparison would be vacuous"
    assert m.num_accepted_tokens > 0
    assert m.num_emitted_tokens == NUM_PROMPTS * MAX_TOKENS


def test_default_model_answers_chat_and_text(baseline):
    # the baseline itself is sane: real English text from the chat template
    assert all(o.text.strip() for o in baseline)
    assert len(baseline[0].text.split()) > 20  # the writing prompt gets prose
    assert baseline[0].prompt_token_ids[:1] == [1]  # SmolLM2 chat template starts with <|im_start|>
