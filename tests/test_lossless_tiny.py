"""Greedy speculative decoding is token-identical to plain decoding (tiny random models).

Every speculative method must reproduce the baseline exactly at temperature 0, whatever
the draft proposes and however requests are batched: prompts of mixed lengths (1, 2, 7,
13, 20, 40 tokens), different ``max_tokens`` so sequences finish at different steps, and
``max_num_seqs`` both smaller than the number of prompts (requests join while others are
mid-flight) and large enough to run everything at once. The baseline itself is pinned
to transformers' own ``generate(do_sample=False)``.

All models are random, fp32, on CPU; the speculative runs go through both model runners
(the native Llama-family one and the transformers fallback). Every output's speculation
metrics are checked for internal consistency along the way.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from speculum import LLM, SamplingParams, testing

_rng = random.Random(1234)
_base10 = [_rng.randrange(3, 512) for _ in range(10)]
PROMPT_IDS = [
    [5],                                        # length 1
    [7, 9],                                     # length 2
    [30, 31, 32, 30, 31, 32, 30],               # length 7, repetitive
    [_rng.randrange(3, 512) for _ in range(13)],  # length 13, random
    _base10 * 2,                                # length 20, repeats itself
    [10, 11, 12, 13, 14] * 8,                   # length 40, periodic
]
PROMPTS = [{"prompt_token_ids": p} for p in PROMPT_IDS]
MAX_TOKENS = [40, 36, 40, 31, 40, 25]  # different lengths: sequences leave at different steps
GREEDY = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
BATCH_SIZES = [2, len(PROMPTS)]  # requests join mid-flight / all at once


pytestmark = pytest.mark.usefixtures("one_torch_thread")


RUNNERS = ["native", "hf"]  # the native Llama-family runner and the transformers fallback


def make_llm(model, spec=None, **kw) -> LLM:
    """fp32 on the CPU, a small KV budget (:func:`speculum.testing.make_llm`), room for every prompt."""
    kw.setdefault("max_num_seqs", len(PROMPTS))
    return testing.make_llm(model, spec, **kw)


def check_metrics(m, num_output_tokens: int) -> None:
    """Internal consistency of one request's SpecDecodeMetrics (for runs without stops)."""
    # nothing is cut by a stop, and drafts never run past max_tokens: every emitted token
    # is in the output (with a stop it is >=, see test_stops.py)
    assert m.num_emitted_tokens == num_output_tokens
    hist, per_pos = m.acceptance_histogram, m.accepted_per_position
    assert sum(hist) == m.num_steps
    assert sum(a * c for a, c in enumerate(hist)) == m.num_accepted_tokens
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos
    assert sum(per_pos) == m.num_accepted_tokens
    assert m.num_emitted_tokens == m.num_accepted_tokens + m.num_steps
    assert m.num_accepted_tokens <= m.num_draft_tokens
    assert m.num_drafts <= m.num_steps
    if m.num_draft_tokens:
        assert m.draft_acceptance_rate == m.num_accepted_tokens / m.num_draft_tokens
    else:
        assert m.draft_acceptance_rate is None
    assert m.tokens_per_step == pytest.approx(1 + m.num_accepted_tokens / m.num_steps)
    if m.num_drafts:
        assert m.mean_acceptance_length == pytest.approx(1 + m.num_accepted_tokens / m.num_drafts)
    else:
        assert m.mean_acceptance_length is None and m.acceptance_rate_per_position() == []
    assert sum(m.drafts_per_position) == m.num_draft_tokens


def check_engine_metrics(llm: LLM, outs) -> None:
    """The engine-wide totals are the sums of the per-request metrics."""
    for field in ("num_steps", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens"):
        assert getattr(llm.metrics, field) == sum(getattr(o.metrics, field) for o in outs), field


@pytest.fixture(scope="module")
def baseline(tiny_llama) -> list[list[int]]:
    llm = make_llm(tiny_llama)
    outs = llm.generate(PROMPTS, GREEDY)
    for o, n in zip(outs, MAX_TOKENS):
        assert len(o.token_ids) == n and o.finish_reason == "length"
        check_metrics(o.metrics, n)
        assert o.metrics.num_steps == n and o.metrics.num_draft_tokens == 0
    check_engine_metrics(llm, outs)
    return [o.token_ids for o in outs]


def hf_greedy(model_dir, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# ------------------------------------------------------------------------- the baseline
def test_baseline_matches_transformers_generate(tiny_llama, baseline):
    for i in (0, 2, 4):  # lengths 1, 7, 20
        assert baseline[i] == hf_greedy(tiny_llama, PROMPT_IDS[i], MAX_TOKENS[i]), f"prompt {i}"


@pytest.mark.parametrize("runner, max_num_seqs", [("native", 1), ("native", 2), ("hf", 2), ("hf", 6)])
def test_baseline_is_batch_and_runner_invariant(tiny_llama, baseline, runner, max_num_seqs):
    llm = make_llm(tiny_llama, max_num_seqs=max_num_seqs, runner=runner)
    assert type(llm.target).__name__ == {"native": "NativeRunner", "hf": "HFRunner"}[runner]
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == baseline


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_other_architectures(request, arch, runner):
    """Baseline == transformers generate == self-draft speculation, for Qwen2 and Qwen3."""
    model = request.getfixturevalue(f"tiny_{arch}")
    idx = [0, 2, 4]
    prompts, params = [PROMPTS[i] for i in idx], [GREEDY[i] for i in idx]
    base = [o.token_ids for o in make_llm(model, max_num_seqs=2, runner=runner).generate(prompts, params)]
    assert base[1] == hf_greedy(model, PROMPT_IDS[2], MAX_TOKENS[2])
    llm = make_llm(model, {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3},
                   max_num_seqs=2, runner=runner)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == base
    assert all(o.metrics.draft_acceptance_rate == 1.0 for o in outs)


# ------------------------------------------------------------------------ speculation
def spec_configs(tiny_llama, tiny_llama_draft) -> dict[str, dict]:
    return {
        # prompt lookup, matching even single tokens so it drafts often
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
        # a different random model: its drafts are almost always rejected
        "draft_model": {"model": str(tiny_llama_draft), "num_speculative_tokens": 3},
        # the target drafting for itself: every draft is accepted
        "self_draft": {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 4},
        # the target's first layer as draft: partial acceptance
        "self_draft_1_layer": {"model": str(tiny_llama), "num_speculative_tokens": 3, "options": {"num_layers": 1}},
    }


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("max_num_seqs", BATCH_SIZES, ids=["joins-mid-flight", "all-at-once"])
@pytest.mark.parametrize("method", ["ngram", "draft_model", "self_draft", "self_draft_1_layer"])
def test_greedy_speculation_is_lossless(tiny_llama, tiny_llama_draft, baseline, method, max_num_seqs, runner):
    spec = spec_configs(tiny_llama, tiny_llama_draft)[method]
    llm = make_llm(tiny_llama, spec, max_num_seqs=max_num_seqs, runner=runner)
    outs = llm.generate(PROMPTS, GREEDY)
    for i, (o, want) in enumerate(zip(outs, baseline)):
        assert o.token_ids == want, f"{method}: prompt {i} (length {len(PROMPT_IDS[i])}) differs from the baseline"
        assert o.finish_reason == "length"
        check_metrics(o.metrics, len(want))
    check_engine_metrics(llm, outs)
    total = llm.metrics
    k = llm.speculative_config.num_speculative_tokens
    assert total.num_drafts > 0, "the proposer never drafted: the test would be vacuous"
    if method == "ngram":
        assert llm.speculative_config.method == "ngram"
        assert total.num_accepted_tokens > 0, "no n-gram draft was ever accepted: the test would be vacuous"
    elif method == "draft_model":
        assert llm.speculative_config.method == "draft_model"  # detected from the checkpoint
    elif method == "self_draft":
        # identical draft and target: 100% acceptance; only a request's last step may
        # draft fewer than k (capped by max_tokens)
        for o, n in zip(outs, MAX_TOKENS):
            m = o.metrics
            assert m.draft_acceptance_rate == 1.0
            assert m.num_steps == math.ceil(n / (k + 1))
            assert m.acceptance_histogram[k] >= m.num_steps - 1
        assert total.mean_acceptance_length > k
    elif method == "self_draft_1_layer":
        assert llm.proposer.runner.num_layers == 1 and llm.target.num_layers == 2


@pytest.mark.parametrize("runner", RUNNERS)
def test_staggered_arrivals(tiny_llama, baseline, runner):
    """Requests added between steps (via add_request/step) still match the baseline."""
    llm = make_llm(tiny_llama, {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3,
                                "options": {"num_layers": 1}}, max_num_seqs=3, runner=runner)
    pending = list(range(len(PROMPTS)))[::-1]
    results, steps = {}, 0
    while pending or llm.has_unfinished_requests():
        if pending and steps % 2 == 0:
            i = pending.pop()
            llm.add_request(f"r{i}", PROMPTS[i], GREEDY[i])
        for out in llm.step():  # an output for every request that advanced
            if out.finished:
                assert out.request_id not in results
                results[out.request_id] = out.token_ids
        steps += 1
        assert steps < 1000
    assert [results[f"r{i}"] for i in range(len(PROMPTS))] == baseline


# --------------------------------------------------------------------- sampled requests
@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_sampled_speculation_is_deterministic_per_seed(tiny_llama, tiny_llama_draft, method):
    spec = spec_configs(tiny_llama, tiny_llama_draft)[method]
    llm = make_llm(tiny_llama, spec)
    prompts = [PROMPTS[2], PROMPTS[5]]

    def run(seed):
        outs = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=30, seed=seed, ignore_eos=True))
        for o in outs:
            assert len(o.token_ids) == 30
            check_metrics(o.metrics, 30)
        return [o.token_ids for o in outs]

    first = run(7)
    assert run(7) == first
    assert run(8) != first
    assert llm.metrics.num_draft_tokens > 0
