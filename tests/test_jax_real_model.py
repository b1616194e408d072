"""The JAX backend on the real default model (SmolLM2-135M-Instruct, fp32, CPU).

Greedy output of ``LLM(backend="jax")`` is token-identical to ``LLM(backend="torch")`` on
the first 10 MT-bench questions (32 new tokens each), without speculation and with the
unchanged ngram and draft_model plugins running on the JAX runner.
"""

from __future__ import annotations

import pytest

pytest.importorskip("jax")

from speculum import LLM, SamplingParams  # noqa: E402
from speculum.testing import mt_bench_prompts  # noqa: E402

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("one_torch_thread")]

NUM_PROMPTS, MAX_TOKENS = 10, 32
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
KW = dict(dtype="float32", device="cpu", max_num_seqs=NUM_PROMPTS)


@pytest.fixture(scope="module")
def prompts():
    return [[{"role": "user", "content": r["turns"][0]}] for r in mt_bench_prompts(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def torch_outputs(prompts):
    return LLM(backend="torch", **KW).generate(prompts, PARAMS)


@pytest.mark.parametrize("spec", [
    None,
    {"method": "ngram", "num_speculative_tokens": 4},
    {"model": "SmolLM2-135M-Instruct", "num_speculative_tokens": 3, "options": {"num_layers": 10}},
], ids=["no-speculation", "ngram-k4", "draft_model-10layers"])
def test_jax_greedy_identical_to_torch_on_default_model(prompts, torch_outputs, spec):
    llm = LLM(backend="jax", speculative_config=spec, **KW)
    outs = llm.generate(prompts, PARAMS)
    assert len(outs) == NUM_PROMPTS
    for i, (t, j) in enumerate(zip(torch_outputs, outs)):
        assert j.token_ids == t.token_ids, f"prompt {i}: jax output differs from torch"
        assert j.text == t.text
    m = llm.metrics
    assert m.num_emitted_tokens == NUM_PROMPTS * MAX_TOKENS
    if spec is not None:
        assert m.num_draft_tokens > 0 and m.num_accepted_tokens > 0, "speculation never helped: vacuous"
