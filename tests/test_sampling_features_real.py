"""Sampling features on the real default model (SmolLM2-135M-Instruct, fp32, CPU) with
n-gram speculation: logprobs equal to those without speculation (prompt logprobs
exactly; generated tokens within 1e-4: measured 5.2e-5 at worst over 96 tokens, 2e-5 on
average, with the GEMMs through oneDNN's prepacked weights, and 4.4e-5 / 1.2e-5 through
F.linear (SPECULUM_GEMM_TUNE=0), 2026-12-06; 1.3e-5 at worst when the test was written;
the difference is in the target's fp32 logits themselves, a verify forward of
k+1 tokens summing in another order than k+1 single-token forwards, and it grows with
the position as the KV written by either path differs in the last bits; a logprob of
the wrong position, temperature or distribution is off by 0.1 or more; on the tiny
model, tests/test_sampling_features.py, it stays within 1e-5), bad_words
(which need the tokenizer) never generated and the output identical with and without
speculation, penalties identical in greedy decoding.
"""

from __future__ import annotations

import pytest

from speculum import LLM, SamplingParams

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("one_torch_thread")]

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
PROMPTS = [[{"role": "user", "content": "List the days of the week, one per line, then list them again."}],
           [{"role": "user", "content": "Write a Python function that returns the sum of a list, and explain it."}]]


@pytest.fixture(scope="module")
def engines():
    return (LLM(dtype="float32", device="cpu", max_num_seqs=4),
            LLM(speculative_config=SPEC, dtype="float32", device="cpu", max_num_seqs=4))


def test_logprobs_equal_with_and_without_speculation(engines):
    base, spec = engines
    p = SamplingParams(temperature=0, max_tokens=48, logprobs=5, prompt_logprobs=2)
    want, got = base.generate(PROMPTS, p), spec.generate(PROMPTS, p)
    assert spec.metrics.num_accepted_tokens > 0
    worst = 0.0
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert list(x) == list(y)
            worst = max(worst, *(abs(x[t].logprob - y[t].logprob) for t in x))
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            worst = max(worst, *(abs(x[t].logprob - y[t].logprob) for t in x))
        assert b.outputs[0].logprobs[0][b.token_ids[0]].decoded_token is not None
    assert worst <= 1e-4, worst


def test_bad_words_are_never_generated(engines):
    base, spec = engines
    free = base.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=40))[0]
    assert "Monday" in free.text, "the prompt must make the model say the word"
    p = SamplingParams(temperature=0, max_tokens=40, bad_words=["Monday", "Tuesday"])
    a, b = base.generate(PROMPTS[:1], p)[0], spec.generate(PROMPTS[:1], p)[0]
    assert a.token_ids == b.token_ids
    assert "Monday" not in b.text and "Tuesday" not in b.text


def test_penalties_greedy_identical(engines):
    base, spec = engines
    p = SamplingParams(temperature=0, max_tokens=48, presence_penalty=0.5, frequency_penalty=0.3,
                       repetition_penalty=1.1)
    a, b = base.generate(PROMPTS, p), spec.generate(PROMPTS, p)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
