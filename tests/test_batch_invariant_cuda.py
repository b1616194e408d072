"""Batch-invariant mode on CUDA, bf16: no token may ever differ (runs on the GPU machine).

Each kernel gives a row the same bits alone and among others; the engine gives the same
tokens at batch 1 and 8, with and without speculation (n-gram, a draft model), greedy
and seeded sampled (exact-match verification), with CUDA graphs on. Random bf16 models
have many near-ties, so a kernel that depended on the batch would flip tokens here.
"""

from __future__ import annotations

import pytest
import torch

from speculum import LLM, SamplingParams
from speculum.backends.torch.native import invariant, kernels
from speculum.testing import tiny_model_dir

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or kernels.triton is None,
                                reason="needs CUDA and Triton")

PROMPTS = [{"prompt_token_ids": p} for p in ([5], [7, 9, 7, 9, 7, 9], [30, 31, 32, 30, 31, 32, 30],
                                             [10, 11, 12, 13, 14] * 4, list(range(40, 90)),
                                             [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5] * 3, [100, 200] * 9, [8] * 20)]


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (49152, 576), (100, 64)])
def test_linear_rows_are_the_same_in_any_batch(n, k):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    x = torch.randn(333, k, device="cuda", generator=g).bfloat16()
    ref = torch.cat([invariant.linear(x[i:i + 1], w) for i in range(0, 333, 37)])
    for m in (5, 37, 64, 333):
        y = invariant.linear(x[:m], w)
        assert torch.equal(y[::37], ref[: len(y[::37])]), m
    assert torch.allclose(invariant.linear(x, w).float(), (x.float() @ w.float().T), atol=0.05, rtol=0.02)


def test_attention_query_is_the_same_alone_in_a_chain_and_in_a_batch():
    g = torch.Generator(device="cuda").manual_seed(1)
    hq, hkv, d, n_slots = 9, 3, 64, 4096
    kp = torch.randn(n_slots, hkv, d, device="cuda", generator=g).bfloat16()
    vp = torch.randn(n_slots, hkv, d, device="cuda", generator=g).bfloat16()
    slots = torch.randperm(n_slots, device="cuda", generator=g)[:1024].view(1, 1024)
    q = torch.randn(1, 5, hq, d, device="cuda", generator=g).bfloat16()
    pos = torch.arange(700, 705, device="cuda").view(1, 5)
    chain = invariant.paged_attention(q, kp, vp, slots, pos, d ** -0.5)
    for t in range(5):  # decode of one token, with a context bucket that is just long enough
        one = invariant.paged_attention(q[:, t:t + 1], kp, vp, slots[:, :720], pos[:, t:t + 1], d ** -0.5)
        assert torch.equal(one[0, 0], chain[0, t])
    other = torch.randperm(n_slots, device="cuda", generator=g)[:1024].view(1, 1024)
    qb = torch.cat([torch.randn(1, 5, hq, d, device="cuda", generator=g).bfloat16(), q])
    batch = invariant.paged_attention(qb, kp, vp, torch.cat([other, slots]),
                                      torch.cat([torch.arange(5, device="cuda").view(1, 5), pos]), d ** -0.5)
    assert torch.equal(batch[1], chain[0])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("bi")
    return (tiny_model_dir(root / "t", "llama", seed=0, num_layers=4),
            tiny_model_dir(root / "d", "llama", seed=1, num_layers=1))


def _run(target, spec, params, batch):
    llm = LLM(str(target), spec, device="cuda", dtype="bfloat16", batch_invariant=True, max_num_seqs=batch)
    return [o.token_ids for o in llm.generate(PROMPTS, params)], llm


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                                    SamplingParams(temperature=0.8, max_tokens=48, ignore_eos=True, seed=5)],
                         ids=["greedy", "seeded"])
def test_engine_never_changes_a_token(models, params):
    target, draft = models
    ref, base = _run(target, None, params, 1)
    assert base.target.cuda_graphs
    runs = {"batch 8": _run(target, None, params, 8)}
    for spec in ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
                 {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}):
        spec = dict(spec, acceptance_method="exact_match")
        for batch in (1, 8):
            runs[f"{spec['method']} batch {batch}"] = _run(target, spec, params, batch)
    for name, (out, llm) in runs.items():
        assert out == ref, name
        if llm.k:
            assert llm.stats.num_drafts > 0, name
