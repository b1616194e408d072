"""Hidden-state heads on CUDA: graphed greedy drafting is lossless and drafts like eager.

Runs only where CUDA exists (the GPU machine); on the CPU the same static draft function
is checked against the eager loop by the plugins' tests
(``test_static_draft_function_drafts_like_the_eager_loop``).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from speculum import SamplingParams
from speculum.testing import graphed_vs_eager_drafts, tiny_model_dir, train_tiny

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
    llms, same = graphed_vs_eager_drafts(target, spec, PROMPTS, GREEDY)
    assert all((llms[g].proposer.graphs is not None) == g for g in (False, True))
    assert sum(same) >= 0.95 * len(same)  # fp32 on GPU: padded shapes may flip a rare near-tie
    # overlap is on by default on CUDA: the graphed chains start from the verdict on the device
    assert llms[True].loop.drafted_from_verdict > 0 and llms[False].loop.drafted_from_verdict == 0
    assert any(k[-1] == "device" for k in llms[True].proposer.graphs._graphs), "no graph drafts from the device"


@pytest.mark.skipif(importlib.util.find_spec("speculum_medusa") is None, reason="needs speculum-medusa")
@pytest.mark.parametrize("token", [(), ("--token-input",), ("--sequential",)],
                         ids=["medusa-1", "token-aware", "sequential"])
@pytest.mark.parametrize("tree", [None, "dynamic", "static"])
def test_graphed_medusa_drafting_is_lossless_and_matches_eager(target, tmp_path_factory, tree, token):
    """Medusa's greedy chain and tree drafting as CUDA graphs (token-aware heads: the last
    token a second static input, gathered from the verdict on the device; sequential heads: a
    loop over the heads inside the graph): outputs identical to plain decoding, drafts step by
    step as the same static function run eagerly."""
    from speculum.testing import TREE_CONFIGS
    head = train_tiny("medusa", target, tmp_path_factory.mktemp("medusa"),
                      extra=("--num-heads", "3") + token)
    spec = {"method": "medusa", "model": str(head), **(TREE_CONFIGS[tree] if tree else {"num_speculative_tokens": 3})}
    llms, same = graphed_vs_eager_drafts(target, spec, PROMPTS, GREEDY)
    assert all(llms[g].proposer.graphs.use_graphs == g for g in (False, True))
    assert sum(same) >= 0.95 * len(same)
    assert all(llms[g].loop.drafted_from_verdict > 0 for g in (False, True))  # chains and trees, from the verdict


@pytest.mark.parametrize("shape", [{"num_speculative_tokens": 3},
                                   {"tree_topk": 3, "tree_depth": 3, "num_draft_tokens": 8}], ids=["chain", "tree"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_graphed_forward_from_the_verdict_is_lossless(target, heads, method, shape):
    """``from_verdict: "forward"``: the next verify forward (a chain's or a tree's) is a
    CUDA graph of its own, launched from the device verdict (a tree's accepted path moved,
    positions and write slots from the accepted count); outputs equal plain decoding and
    such forwards ran."""
    from speculum import LLM
    spec = {"method": method, "model": str(heads[method]), "from_verdict": "forward", **shape}
    ref = LLM(str(target), device="cuda", dtype="float32", max_num_seqs=4).generate(PROMPTS, GREEDY)
    llm = LLM(str(target), spec, device="cuda", dtype="float32", max_num_seqs=4)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [r.token_ids for r in ref]
    assert llm.loop.forwards_from_verdict > 0 and llm.loop.drafted_from_verdict > 0
    assert any(k[-1] == "verdict" for k in llm.loop.target._graphs), "no graph launched from the verdict"


@pytest.mark.skipif(importlib.util.find_spec("speculum_draft_model") is None, reason="needs speculum-draft-model")
@pytest.mark.parametrize("from_verdict", ["draft", "forward"])
def test_draft_model_chains_from_the_verdict_on_cuda(target, from_verdict):
    """A draft model's greedy chains launched from the device verdict (its runner's own CUDA
    graph of a whole chain from the verdict: a 2-token forward rewriting the last accepted
    position and appending the new token, then one forward a draft), and with ``"forward"`` the target's next
    verify forward too: outputs equal plain decoding, the drafts equal those drafted after the
    verdict's copy (``"off"``) in at least 95% of steps (fp32 on the GPU: a different forward
    shape may flip a rare near-tie), and the draft's graphs from the verdict ran."""
    from speculum import LLM
    spec = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3, "options": {"num_layers": 1}}
    ref = LLM(str(target), device="cuda", dtype="float32", max_num_seqs=4).generate(PROMPTS, GREEDY)
    runs = {}
    for fv in (from_verdict, "off"):
        llm = LLM(str(target), {**spec, "from_verdict": fv}, device="cuda", dtype="float32", max_num_seqs=4)
        seen, inner = [], llm.proposer.propose
        llm.proposer.propose = lambda b, inner=inner, seen=seen: (lambda d: (seen.append(d.token_ids.tolist()), d)[1])(inner(b))
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [r.token_ids for r in ref]
        runs[fv] = (llm, seen)
    llm, seen = runs[from_verdict]
    assert llm.loop.drafted_from_verdict > 10 and runs["off"][0].loop.drafted_from_verdict == 0
    assert any(k[-1] == "chain" for k in llm.proposer.runner._graphs), "no draft chain graphed from the verdict"
    if from_verdict == "forward":
        assert llm.loop.forwards_from_verdict > 0
    same = [a == b for a, b in zip(seen, runs["off"][1])]
    assert len(seen) == len(runs["off"][1]) and sum(same) >= 0.95 * len(same)


@pytest.mark.skipif(importlib.util.find_spec("speculum_medusa") is None, reason="needs speculum-medusa")
@pytest.mark.parametrize("tree", [None, "dynamic"])
def test_medusa_prefix_layer_on_cuda(target, tmp_path_factory, tree):
    """Sequential Medusa heads with a prefix layer on CUDA: the layer fed over its paged cache
    from the device verdict (overlap is on; a CUDA graph of the feed in the graphed engine), then
    the heads' graphed drafting from its output: outputs identical to plain decoding, drafts as
    the same functions run eagerly."""
    from speculum.testing import TREE_CONFIGS
    head = train_tiny("medusa", target, tmp_path_factory.mktemp("medusa_prefix"),
                      extra=("--num-heads", "3", "--sequential", "--prefix-layer"))
    spec = {"method": "medusa", "model": str(head), **(TREE_CONFIGS[tree] if tree else {"num_speculative_tokens": 3})}
    llms, same = graphed_vs_eager_drafts(target, spec, PROMPTS, GREEDY)
    assert all(llms[g].proposer.prefix is not None for g in (False, True))
    assert llms[True].proposer.prefix.feed._graphs and not llms[False].proposer.prefix.feed._graphs
    assert sum(same) >= 0.95 * len(same)
    assert all(llms[g].loop.drafted_from_verdict > 0 for g in (False, True))  # the layer fed from the verdict
