"""Token trees on CUDA: the graphed tree verify forward and the graphed tree drafting.

Runs only where CUDA exists (the GPU machine). On the CPU the same functions run eagerly
and are checked by ``tests/test_tree.py`` and the plugins' tree tests; here the CUDA
graphs (captured per node budget, replayed with each row's own tree) must compute what
the eager path computes, and output must stay identical to decoding without speculation.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from speculum import LLM, SamplingParams
from speculum.testing import TREE_CONFIGS, record_trees, tiny_model_dir, train_tiny
from speculum.tree import TokenTree

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("speculum_eagle") is None, reason="needs speculum-eagle"),
]

PROMPTS = [{"prompt_token_ids": p} for p in ([5], [7, 9], [30, 31, 32, 30, 31, 32, 30], [10, 11, 12, 13, 14] * 4)]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
TREES = {**TREE_CONFIGS, "wide": {"tree_topk": 4, "tree_depth": 4, "num_draft_tokens": 16}}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("target"), "llama", seed=0, num_layers=4)


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    work = tmp_path_factory.mktemp("train")
    return {"eagle": train_tiny("eagle", target, work), "eagle3": train_tiny("eagle3", target, work,
                                                                           extra=("--draft-vocab", "384")),
            "mtp": train_tiny("mtp", target, work),
            "medusa": train_tiny("medusa", target, work, extra=("--num-heads", "4"))}


def runner_of(target, graphs: bool):
    from speculum.backends.torch.backend import TorchBackend
    backend = TorchBackend(device="cuda", dtype="float32", kv_cache_memory=16 << 20, cuda_graphs=graphs)
    runner = backend.load_model(target, role="target")
    backend.plan_memory(512)
    return runner


def test_graphed_tree_verify_equals_eager(target):
    """Rows with their own trees and node counts, through a captured graph and eagerly."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (7, 2, 13)]
    parents = torch.tensor([[-1, -1, 0, 0, 1, 3, -1, 5], [-1, 0, 1, 2, 3, 4, 5, 6], [-1, 0, 0, 2, 2, 4, 1, 1]])
    nodes = torch.randint(3, 500, (3, 8), generator=g)
    counts = [8, 3, 6]
    outs = {}
    for graphs in (False, True):
        runner = runner_of(target, graphs)
        assert runner.cuda_graphs == graphs
        runner.add_many([0, 1, 2], [p[:-1] for p in prompts])
        inputs = torch.cat([torch.tensor([[p[-1]] for p in prompts]), nodes], dim=1).cuda()
        tree = TokenTree(parents.cuda())
        res = []
        for _ in range(3):  # replayed several times, with a rollback in between
            res.append(runner.forward([0, 1, 2], inputs, [n + 1 for n in counts], tree=tree).logits.clone())
            for sid, p in enumerate(prompts):
                runner.truncate(sid, len(p) - 1)
        if graphs:
            assert any(k[-1] for k in runner._graphs), "no tree graph was captured"
        outs[graphs] = res
    for a, b in zip(outs[False], outs[True]):
        for r, n in enumerate(counts):
            assert (a[r, : n + 1] - b[r, : n + 1]).abs().max().item() < 1e-3


@pytest.mark.parametrize("tree", ["dynamic", "static", "wide"])
@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp", "medusa"])
def test_graphed_tree_drafting_is_lossless_and_matches_eager(target, heads, method, tree):
    spec = {"method": method, "model": str(heads[method]), **TREES[tree]}
    ref = LLM(str(target), device="cuda", dtype="float32", max_num_seqs=4).generate(PROMPTS, GREEDY)
    runs = {}
    for graphs in (False, True):
        llm = LLM(str(target), spec, device="cuda", dtype="float32", max_num_seqs=4, cuda_graphs=graphs)
        seen = record_trees(llm)
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
        assert llm.metrics.num_tree_steps > 0
        runs[graphs] = seen
        if graphs:
            assert llm.proposer.graphs._graphs, "no tree draft graph was captured"
            # overlap is on by default on CUDA: the next trees start from the verdict on the device
            assert llm.loop.drafted_from_verdict > 0
            if method != "medusa":  # (Medusa's tree function takes a state: one graph for both)
                assert any(k[-1] == "device" for k in llm.proposer.graphs._graphs), "no graph drafts from the device"
    assert len(runs[False]) == len(runs[True])
    same = sum(a[1] == b[1] and a[2] == b[2] for a, b in zip(runs[False], runs[True]))
    assert same >= 0.95 * len(runs[True])  # fp32 on GPU: padded shapes may flip a rare near-tie


def test_bf16_trees_run_graphed(target, heads):
    """bf16 with graphs: trees are verified and accepted (identity is an fp32 property)."""
    llm = LLM(str(target), {"method": "eagle", "model": str(heads["eagle"]), **TREES["wide"]}, device="cuda",
              dtype="bfloat16", max_num_seqs=4)
    outs = llm.generate(PROMPTS, GREEDY)
    assert all(len(o.token_ids) == 40 for o in outs)
    assert llm.metrics.num_tree_steps > 0 and llm.metrics.num_accepted_tokens > 0


def test_greedy_tree_verification_takes_the_fused_kernel():
    """On CUDA the greedy tree verifier runs the fused kernel (its agreement with the
    eager function: tests/test_kernels_cuda.py): same verdicts either way."""
    from speculum.interfaces import Verdict
    from speculum.verifiers import tree as vt
    g = torch.Generator().manual_seed(5)
    N, V = 16, 64
    for B in (1, 3, 4):
        parents = torch.full((B, N), -1, dtype=torch.int64)
        for i in range(1, N):
            parents[:, i] = torch.randint(-1, i, (B,), generator=g)
        tree = TokenTree(parents.cuda())
        am = torch.randint(0, V, (B, N + 1), generator=g).cuda()
        tokens = torch.where(torch.rand(B, N, generator=g) < 0.6, am.cpu().gather(1, parents + 1),
                             torch.randint(0, V, (B, N), generator=g)).cuda()
        args = (am, tokens, tree.parents, tree.ancestors, tree.depth)
        rows = vt._fused(*args)  # [count | tokens | path]
        assert rows is not None
        fused = Verdict.from_rows(rows, path_width=N)
        logits = torch.nn.functional.one_hot(am, V).float()
        verdict = vt.tree_greedy_verify(logits, tokens, tree)
        for a, b in zip((fused.token_ids, fused.num_accepted, fused.path), vt.greedy_path(*args)):
            assert torch.equal(a, b)
        assert torch.equal(verdict.path, fused.path) and torch.equal(verdict.num_accepted, fused.num_accepted)
        assert verdict.packed() is verdict.rows  # one tensor for the copy to the host
