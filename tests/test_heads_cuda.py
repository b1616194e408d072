"""Hidden-state heads on CUDA: graphed greedy drafting is lossless and drafts like eager.

Runs only where CUDA exists (the GPU machine); on the CPU the same static draft function
is checked against the eager loop by the plugins' tests
(``test_static_draft_function_drafts_like_the_eager_loop``).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from speculum import LLM, SamplingParams
from speculum.testing import record_drafts, tiny_model_dir, train_tiny

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("speculum_eagle") is None, reason="needs speculum-eagle"),
]

PROMPTS = [{"prompt_token_ids": p} for p in ([5], [7, 9], [30, 31, 32, 30, 31, 32, 30], [10, 11, 12, 13, 14] * 4)]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("target"), "llama", seed=0, num_layers=4)


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    work = tmp_path_factory.mktemp("train")
    return {"eagle": train_tiny("eagle", target, work),
            "eagle3": train_tiny("eagle3", target, work, extra=("--draft-vocab", "384"))}


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_graphed_drafting_is_lossless_and_matches_eager(target, heads, method):
    spec = {"method": method, "model": str(heads[method]), "num_speculative_tokens": 3}
    ref = LLM(str(target), device="cuda", dtype="float32", max_num_seqs=4).generate(PROMPTS, GREEDY)
    runs = {}
    for graphs in (False, True):
        llm = LLM(str(target), spec, device="cuda", dtype="float32", max_num_seqs=4, cuda_graphs=graphs)
        assert (llm.proposer.graphs is not None) == graphs
        seen = record_drafts(llm)
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
        runs[graphs] = seen
        if graphs:
            assert llm.proposer.graphs._graphs, "no draft graph was captured"
    assert len(runs[False]) == len(runs[True])
    same = sum(torch.equal(a[1].cpu(), b[1].cpu()) for a, b in zip(runs[False], runs[True]))
    assert same >= 0.95 * len(runs[True])  # fp32 on GPU: padded shapes may flip a rare near-tie


@pytest.mark.skipif(importlib.util.find_spec("speculum_medusa") is None, reason="needs speculum-medusa")
@pytest.mark.parametrize("tree", [None, "dynamic", "static"])
def test_graphed_medusa_drafting_is_lossless_and_matches_eager(target, tmp_path_factory, tree):
    """Medusa's greedy chain and tree drafting as CUDA graphs: outputs identical to plain
    decoding, drafts step by step as the same static function run eagerly."""
    from speculum.testing import TREE_CONFIGS
    head = train_tiny("medusa", target, tmp_path_factory.mktemp("medusa"), extra=("--num-heads", "3"))
    spec = {"method": "medusa", "model": str(head), **(TREE_CONFIGS[tree] if tree else {"num_speculative_tokens": 3})}
    ref = LLM(str(target), device="cuda", dtype="float32", max_num_seqs=4).generate(PROMPTS, GREEDY)
    runs = {}
    for graphs in (False, True):
        llm = LLM(str(target), spec, device="cuda", dtype="float32", max_num_seqs=4, cuda_graphs=graphs)
        assert llm.proposer.graphs.use_graphs == graphs
        seen = record_drafts(llm)
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
        if graphs:
            assert llm.proposer.graphs._graphs, "no draft graph was captured"
        runs[graphs] = seen
    assert len(runs[False]) == len(runs[True])
    same = sum(torch.equal(a[1].cpu(), b[1].cpu()) for a, b in zip(runs[False], runs[True]))
    assert same >= 0.95 * len(runs[True])
