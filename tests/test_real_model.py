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


def test_native_logits_match_transformers_on_default_model():
    """The native runner computes the default model's logits as transformers does (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from speculum.backends.torch.backend import TorchBackend
    from speculum.model_source import resolve_model_path

    path = resolve_model_path(None)
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 30, 2, 198, 1, 4093, 198, 19556, 28, 638, 357, 30]
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    be = TorchBackend(device="cpu", dtype="float32", runner="native", kv_cache_memory=64 << 20)
    runner = be.load_model(path, "target", max_model_len=256)
    be.plan_memory(256)
    runner.add(0, ids[:12])
    got = torch.cat([runner.forward([0], torch.tensor([ids[12:17]]), [5]).logits[0]] +
                    [runner.forward([0], torch.tensor([[t]]), [1]).logits[0] for t in ids[17:]])
    diff = (got - want[12:]).abs().max().item()
    print(f"max abs logit diff native vs transformers: {diff:.2e}")
    assert diff < 1e-3, f"max abs diff {diff} (logits are O(10); fp32 rounding is ~1e-5)"
    assert torch.equal(got.argmax(-1), want[12:].argmax(-1))
