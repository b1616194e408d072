"""Batch-invariant mode on CUDA, bf16: no token may ever differ (runs on the GPU machine).

Each kernel gives a row the same bits alone and among others; the engine gives the same
tokens at batch 1 and 8, with and without speculation (n-gram, a draft model), greedy
and seeded sampled (exact-match verification), with CUDA graphs on. Random bf16 models
have many near-ties, so a kernel that depended on the batch would flip tokens here.
"""

from __future__ import annotations

import pytest
import torch

import os

from speculum import LLM, SamplingParams
from speculum.backends.torch.native import invariant, kernels
from speculum.testing import tiny_model_dir

CUDA = torch.cuda.is_available() and kernels.triton is not None
#: ``TRITON_INTERPRET=1 SPECULUM_TRITON_INTERPRET=1`` on a CPU with triton: the kernel-level
#: tests marked for it run through Triton's interpreter (fp32)
INTERPRET = os.environ.get("SPECULUM_TRITON_INTERPRET") == "1" and kernels.triton is not None
pytestmark = pytest.mark.skipif(not CUDA and not INTERPRET, reason="needs CUDA and Triton")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")

PROMPTS = [{"prompt_token_ids": p} for p in ([5], [7, 9, 7, 9, 7, 9], [30, 31, 32, 30, 31, 32, 30],
                                             [10, 11, 12, 13, 14] * 4, list(range(40, 90)),
                                             [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5] * 3, [100, 200] * 9, [8] * 20)]


@needs_cuda
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


@needs_cuda
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


def test_a_tree_query_is_the_same_as_its_decode_step(monkeypatch):
    """A token tree's query, reading its own slot table (``_tree_invariant_inputs``: context,
    root, then its ancestors by depth), gives the bits of a 1-token decode at its position
    over the path compacted into consecutive slots (what the next steps read after
    ``move_kv``). On the GPU in bf16; through the interpreter in fp32."""
    from speculum.backends.torch.native.runner import _tree_invariant_inputs
    from speculum.tree import TokenTree
    dev, dt = (torch.device("cuda"), torch.bfloat16) if CUDA else (torch.device("cpu"), torch.float32)
    if not CUDA:
        monkeypatch.setattr(invariant, "use_triton", lambda t, *others: True)
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, n_slots, Lc, base = 6, 2, 32, 600, 192, 130
    kp = torch.randn(n_slots, hkv, d, generator=g).to(dev, dt)
    vp = torch.randn(n_slots, hkv, d, generator=g).to(dev, dt)
    parents = torch.tensor([[-1, -1, 0, 0, 1, 2, 5, 3]])  # 8 nodes, depths 1 1 2 2 2 3 4 3
    tree = TokenTree(parents)
    q_len = parents.shape[1] + 1
    read = torch.randperm(n_slots, generator=g)[:Lc].view(1, Lc)
    pos = (base + torch.arange(q_len)).view(1, q_len)
    tpos, slots = _tree_invariant_inputs(pos, read, tree.depth, tree.ancestors)
    q = torch.randn(1, q_len, hq, d, generator=g).to(dev, dt)
    out = invariant.paged_attention(q, kp, vp, slots.to(dev), tpos.to(dev), d ** -0.5)
    anc, depth = tree.ancestors[0], tree.depth[0]
    for c in range(q_len):
        path = [] if c == 0 else sorted((j for j in range(c) if anc[c - 1, j]), key=lambda j: int(depth[j]))
        compact = read.clone()
        for e, j in enumerate(path, start=1):  # the path's keys moved to base + 1, base + 2, ...
            compact[0, base + e] = read[0, base + 1 + j]
        p = torch.tensor([[base + len(path)]])
        assert int(tpos[0, c]) == int(p)
        one = invariant.paged_attention(q[:, c:c + 1], kp, vp, compact.to(dev), p.to(dev), d ** -0.5)
        assert torch.equal(one[0, 0], out[0, c]), c


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("bi")
    return (tiny_model_dir(root / "t", "llama", seed=0, num_layers=4),
            tiny_model_dir(root / "d", "llama", seed=1, num_layers=1))


def _run(target, spec, params, batch):
    llm = LLM(str(target), spec, device="cuda", dtype="bfloat16", batch_invariant=True, max_num_seqs=batch)
    return [o.token_ids for o in llm.generate(PROMPTS, params)], llm


@needs_cuda
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


@needs_cuda
@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                                    SamplingParams(temperature=0.8, max_tokens=48, ignore_eos=True, seed=5)],
                         ids=["greedy", "seeded"])
def test_trees_never_change_a_token(models, params):
    """Token trees in batch-invariant mode, bf16, CUDA graphs: a tree oracle (its true
    branch alternating between the root's two children) gives plain decoding's tokens at
    batch 1 and 8."""
    from speculum.testing import TreeOracle, proposer_plugin, truth_table
    target, _ = models
    ref, _ = _run(target, None, params, 1)
    plugin = proposer_plugin("tree_oracle", TreeOracle(truth_table(PROMPTS, ref)))
    for batch in (1, 8):
        llm = LLM(str(target), {"method": "tree_oracle", "speculative_token_tree": TreeOracle.PATHS,
                                "acceptance_method": "exact_match"}, device="cuda", dtype="bfloat16",
                  batch_invariant=True, max_num_seqs=batch, plugins=[plugin])
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == ref, batch
        assert llm.stats.num_accepted_tokens > 50

