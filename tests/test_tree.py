"""Token trees: the config keys, the tree type, the builders and the tree verify forward.

The verify forward is checked against plain chains: a tree forward's logits at every
node equal a causal forward over that node's path (both runners, fp32), and after the
accepted path's K/V is moved into place the cache continues exactly like a chain's.
The builders are checked against plain-Python references of static trees and of
EAGLE-2's expand-and-rerank on a synthetic draft.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
import torch

from speculum import LLM, SamplingParams
from speculum.config import SpeculativeConfig
from speculum.errors import ConfigError
from speculum.proposers.tree import StaticPlan, draft_tree, dynamic_tree, region_size
from speculum.testing import reference_tree_paths, tree_token_paths
from speculum.tree import TokenTree, TreeSpec, column_tree, gather_path, path_moves, tree_attention_mask

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------------------ config
def test_config_keys_follow_vllm_and_sglang():
    c = SpeculativeConfig.from_dict({"method": "eagle", "tree_topk": 4, "tree_depth": 5, "num_draft_tokens": 16})
    assert c.tree == TreeSpec(num_nodes=15, depth=5, topk=4) and c.num_speculative_tokens == 15
    # vLLM's string form of a static tree, sorted breadth first; num_speculative_tokens = nodes
    c = SpeculativeConfig.from_dict({"method": "medusa", "speculative_token_tree": "[(1,), (0,), (0, 0)]"})
    assert c.speculative_token_tree == [[0], [1], [0, 0]] and c.num_speculative_tokens == 3
    assert c.tree.static_parents() == [-1, -1, 0] and c.tree.depth == 2
    assert SpeculativeConfig.from_json(json.dumps(c.to_dict())).tree == c.tree
    assert SpeculativeConfig.from_dict({"method": "eagle", "num_speculative_tokens": 4}).tree is None


@pytest.mark.parametrize("keys, message", [
    ({"tree_topk": 4}, "missing tree_depth, num_draft_tokens"),
    ({"tree_topk": 2, "tree_depth": 2, "num_draft_tokens": 8}, "at most 6 candidates"),
    ({"tree_topk": 0, "tree_depth": 2, "num_draft_tokens": 2}, "tree_topk must be an integer >= 1"),
    ({"speculative_token_tree": [[0, 0]]}, "needs its parent"),
    ({"speculative_token_tree": [[0], [0]]}, "lists a path twice"),
    ({"speculative_token_tree": "[[0], [1"}, "list of paths"),
    ({"speculative_token_tree": [[0], [-1]]}, "ranks >= 0"),
    ({"speculative_token_tree": [[0]], "num_speculative_tokens": 3}, "has 1 draft tokens"),
    ({"speculative_token_tree": [[0]], "tree_topk": 2}, "not both"),
])
def test_bad_tree_configs_say_what_to_do(keys, message):
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.from_dict({"method": "eagle", **keys})


def test_methods_without_trees_are_refused(tiny_llama, tiny_llama_draft):
    # n-gram drafts trees since the ngramtree branch; a separate draft model does not
    with pytest.raises(ConfigError, match="method 'draft_model' does not handle token trees"):
        LLM(str(tiny_llama), {"model": str(tiny_llama_draft), "tree_topk": 2, "tree_depth": 2, "num_draft_tokens": 4},
            device="cpu", dtype="float32", kv_cache_memory=4 << 20)


# ------------------------------------------------------------------------------- the type
def random_parents(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(-1, i) for i in range(n)]


def ref_ancestors(parents: list[int]) -> list[set[int]]:
    out = []
    for i, p in enumerate(parents):
        out.append({i} | (out[p] if p >= 0 else set()))
    return out


def test_ancestors_and_depth_match_a_python_reference():
    rng = random.Random(0)
    for n in (1, 2, 5, 17, 40):
        rows = [random_parents(rng, n) for _ in range(6)] + [[i - 1 for i in range(n)]]  # and a chain: depth n
        tree = TokenTree(torch.tensor(rows))
        tree.validate()
        for b, par in enumerate(rows):
            ref = ref_ancestors(par)
            got = tree.ancestors[b]
            assert [set(torch.nonzero(got[i]).flatten().tolist()) for i in range(n)] == ref
            assert tree.depth[b].tolist() == [len(a) for a in ref]
    chain = TokenTree.chain(2, 4)
    assert chain.parents.tolist() == [[-1, 0, 1, 2]] * 2 and chain.depth.tolist() == [[1, 2, 3, 4]] * 2


def test_contract_checks():
    with pytest.raises(ValueError, match="one parent per node"):
        TokenTree(torch.tensor([[-1, 0]])).check(torch.zeros(1, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match="int64"):
        TokenTree(torch.tensor([[-1.0]])).check(torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="earlier node"):
        TokenTree(torch.tensor([[-1, 1]])).validate()


def test_attention_mask_and_columns():
    tree = TokenTree(torch.tensor([[-1, -1, 0]]))  # node2 under node0
    depth, vis = column_tree(tree, 4)
    assert depth.tolist() == [[0, 1, 1, 2]]
    assert vis[0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    mask = tree_attention_mask(8, torch.tensor([3]), vis)[0, 0].int()  # root at position 3
    assert mask.tolist() == [[1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 1, 0, 0],
                             [1, 1, 1, 1, 1, 0, 1, 0]]


def test_loop_helpers():
    assert path_moves([1, -1], 1, 10) == ([12], [11])
    assert path_moves([0, 2, 3], 3, 10) == ([13, 14], [12, 13])
    assert path_moves([0, 1], 2, 10) == ([], [])  # a chain prefix is in place already
    h = torch.arange(2 * 5).view(2, 5, 1).float()
    got = gather_path({-1: h}, torch.tensor([[2, 3, -1, -1], [0, -1, -1, -1]]))[-1][..., 0]
    assert got.tolist() == [[0, 3, 4, 0, 0], [5, 6, 5, 5, 5]]


# ---------------------------------------------------------------------------- builders
V = 11


class SynthExpander:
    """A deterministic synthetic draft: log-probs of a node's children are a function of
    the tokens on its path (a hash), so a builder must follow paths exactly."""

    def __init__(self, R: int):
        self.R, self.device = R, torch.device("cpu")
        self.paths = [[(r,)] for r in range(R)]  # per row: the frontier's paths (row id first)

    @staticmethod
    def logp(path: tuple) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash(path) % (2 ** 31))
        return (torch.randn(V, generator=g) * 2).log_softmax(-1)

    def _top(self, paths, width):
        lp = torch.stack([self.logp(p) for p in paths])
        return lp.topk(width, dim=-1)

    def root(self, width):
        self.prev = [(r,) for r in range(self.R)]
        return self._top(self.prev, width)

    def expand(self, level, parent, tokens, vis, slots, width):
        R, F = tokens.shape
        prev = self.prev if level == 1 else self.front
        if level == 1:
            prev = [[p] for p in prev]
        self.front = [[prev[r][int(parent[r, f])] + (int(tokens[r, f]),) for f in range(F)] for r in range(R)]
        lp, ids = zip(*[self._top(self.front[r], width) for r in range(R)])
        return torch.stack(lp), torch.stack(ids)


def synth_topk(row: int):
    def topk(path, width):
        lp = SynthExpander.logp((row,) + path).topk(width)
        return lp.values.tolist(), lp.indices.tolist()
    return topk


@pytest.mark.parametrize("K, D, N", [(1, 4, 4), (3, 3, 7), (4, 5, 15), (2, 4, 14), (4, 2, 20)])
def test_dynamic_tree_is_eagle2(K, D, N):
    R = 3
    spec = TreeSpec.dynamic(K, D, N + 1)
    tokens, parents = dynamic_tree(SynthExpander(R), spec)
    assert tokens.shape == parents.shape == (R, N)
    TokenTree(parents).validate()
    assert bool((TokenTree(parents).depth <= D).all())
    for r in range(R):
        assert tree_token_paths(tokens[r].tolist(), parents[r].tolist()) == reference_tree_paths(spec, synth_topk(r))


@pytest.mark.parametrize("paths", [
    [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 0, 0]],
    [[0], [0, 0], [0, 0, 0]],
    [[1], [0], [2], [3]],
    [[0], [1], [1, 2], [1, 0], [1, 2, 1]],
])
def test_static_tree_follows_the_ranks(paths):
    R = 2
    spec = TreeSpec.static(paths)
    tokens, parents = draft_tree(SynthExpander(R), spec, StaticPlan(spec, "cpu"))
    assert parents[0].tolist() == spec.static_parents()
    for r in range(R):
        assert tree_token_paths(tokens[r].tolist(), parents[r].tolist()) == reference_tree_paths(spec, synth_topk(r))
    assert region_size(spec) == sum(1 for i in range(len(spec.paths)) if i in set(spec.static_parents()))


# ------------------------------------------------------------------- the tree verify forward
@pytest.fixture(scope="module")
def runners(tiny_llama):
    from speculum.backends.torch.backend import TorchBackend
    out = {}
    for kind in ("native", "hf"):
        backend = TorchBackend(device="cpu", dtype="float32", runner=kind, kv_cache_memory=4 << 20, block_size=4)
        runner = backend.load_model(tiny_llama, role="target")
        backend.plan_memory(256)
        out[kind] = runner
    return out


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_tree_forward_equals_chain_forwards_and_moves_kv(runners, kind):
    """Each node's logits equal a causal forward over its path; after move_kv + truncate
    the cache holds the accepted path as if a chain had been verified."""
    runner = runners[kind]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (7, 2, 13)]
    parents = [[-1, -1, 0, 0, 1, 3, -1, 5], [-1, 0, 1, 2, 3, 4, 5, 6], [-1, 0, 0, 2, 2, 4, 1, 1]]
    nodes = torch.randint(3, 500, (3, 8), generator=g)
    counts = [8, 3, 6]  # rows with fewer nodes: padding after them
    nodes[1, 3:] = -1
    nodes[2, 6:] = -1
    sids = [100, 101, 102]
    runner.add_many(sids, [p[:-1] for p in prompts])
    tree = TokenTree(torch.tensor(parents))
    inputs = torch.cat([torch.tensor([[p[-1]] for p in prompts]), nodes.clamp_min(0)], dim=1)
    out = runner.forward(sids, inputs, [n + 1 for n in counts], tree=tree).logits
    anc = [ref_ancestors(p) for p in parents]
    native = runners["native"]  # references: fresh causal forwards (the hf runner batches all rows)
    for b, (sid, p) in enumerate(zip(sids, prompts)):
        for i in range(counts[b]):
            path = [int(nodes[b, j]) for j in sorted(anc[b][i])]
            ref = chain_logits(native, p + path)
            assert (out[b, i + 1] - ref).abs().max().item() < 1e-4, (kind, b, i)
        ref = chain_logits(native, p)
        assert (out[b, 0] - ref).abs().max().item() < 1e-4
    # accept a path per row, move its K/V into place, drop the rest, continue one token
    accepted = {0: [1, 4], 1: [0, 1, 2], 2: [0, 2, 4, 5]}  # row 2: sources overlap destinations
    for b, sid in enumerate(sids):
        path = accepted[b]
        root = len(prompts[b]) - 1
        src, dst = path_moves(path, len(path), root)
        runner.move_kv([sid], [src], [dst])
        runner.truncate(sid, len(prompts[b]) + len(path))
    nxt = torch.randint(3, 500, (3, 1), generator=g)
    got = runner.forward(sids, nxt, [1, 1, 1]).logits[:, 0]
    for b, sid in enumerate(sids):
        seq = prompts[b] + [int(nodes[b, j]) for j in accepted[b]] + [int(nxt[b, 0])]
        assert (got[b] - chain_logits(native, seq)).abs().max().item() < 1e-4, (kind, b)
    for sid in sids:
        runner.remove(sid)


@pytest.mark.parametrize("nxt_tree", [False, True], ids=["then-chain", "then-tree"])
@pytest.mark.parametrize("verified", ["tree", "chain"])
def test_forward_from_verdict_equals_the_host_path(runners, verified, nxt_tree):
    """``NativeRunner.forward_from_verdict``: with the accepted counts (and a tree's path) as
    device tensors it moves the path's K/V, places the next forward (a chain, or a tree) after
    each row's accepted tokens, and gives the logits of fresh causal forwards; truncated to
    what it wrote, the cache then continues as if everything had gone through the host."""
    runner = runners["native"]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (7, 2, 13)]
    sids = [200, 201, 202]
    runner.add_many(sids, [p[:-1] for p in prompts])
    last = torch.tensor([[p[-1]] for p in prompts])
    if verified == "tree":
        parents = [[-1, -1, 0, 0, 1, 3, -1, 5], [-1, 0, 1, 2, 3, 4, 5, 6], [-1, 0, 0, 2, 2, 4, 1, 1]]
        nodes = torch.randint(3, 500, (3, 8), generator=g)
        runner.forward(sids, torch.cat([last, nodes], dim=1), [9, 9, 9], tree=TokenTree(torch.tensor(parents)))
        accepted = {0: [1, 4], 1: [0, 1, 2], 2: [0, 2, 4, 5]}  # row 2: sources overlap destinations
        path = torch.full((3, 8), -1, dtype=torch.int64)
        for b, p in accepted.items():
            path[b, : len(p)] = torch.tensor(p)
        kept = {b: [int(nodes[b, j]) for j in p] for b, p in accepted.items()}
    else:
        drafts = torch.randint(3, 500, (3, 4), generator=g)
        runner.forward(sids, torch.cat([last, drafts], dim=1), [5, 5, 5])
        kept = {b: drafts[b, :a].tolist() for b, a in enumerate((2, 0, 4))}
        path = None
    acc = torch.tensor([len(kept[b]) for b in range(3)])
    q = 4
    ids = torch.randint(3, 500, (3, q), generator=g)  # each row's new token, then the next drafts or nodes
    tree = TokenTree(torch.tensor([[-1, 0, 0]] * 3)) if nxt_tree else None  # nodes 1, 2 both under node 0
    out = runner.forward_from_verdict(sids, [len(p) for p in prompts], acc, ids, path=path, tree=tree).logits
    native = runners["native"]
    for b in range(3):
        ctx = prompts[b] + kept[b]
        paths = [[0], [0, 1], [0, 2]] if nxt_tree else [[0], [0, 1], [0, 1, 2]]
        assert (out[b, 0] - chain_logits(native, ctx + [int(ids[b, 0])])).abs().max().item() < 1e-4
        for c, cols in enumerate(paths, start=1):
            seq = ctx + [int(ids[b, 0])] + [int(ids[b, i + 1]) for i in cols]
            assert (out[b, c] - chain_logits(native, seq)).abs().max().item() < 1e-4, (verified, b, c)
    # keep the new token and the first next draft, as a host would after the next verify
    for b, sid in enumerate(sids):
        runner.truncate(sid, len(prompts[b]) + int(acc[b]) + 2)
    nxt = torch.randint(3, 500, (3, 1), generator=g)
    got = runner.forward(sids, nxt, [1, 1, 1]).logits[:, 0]
    for b in range(3):
        seq = prompts[b] + kept[b] + [int(ids[b, 0]), int(ids[b, 1]), int(nxt[b, 0])]
        assert (got[b] - chain_logits(native, seq)).abs().max().item() < 1e-4, (verified, b)
    for sid in sids:
        runner.remove(sid)


_ids = itertools.count(10_000)


def chain_logits(runner, seq: list[int]) -> torch.Tensor:
    """Logits after ``seq`` from a fresh causal prefill + one decode step."""
    sid = next(_ids)
    runner.add(sid, seq[:-1])
    out = runner.forward([sid], torch.tensor([[seq[-1]]]), [1]).logits[0, 0].clone()
    runner.remove(sid)
    return out


# ------------------------------------------------------------------------------ benchmarks
def test_step_profile_counts_the_hosts_cuda_calls_per_step():
    """``bench offline --profile`` on a GPU counts the CUDA runtime calls of a step and the
    operators launching kernels (the host side a CPU profile cannot show): checked here on
    fake profiler events shaped like torch's, and on a real CPU profile (nothing to count)."""
    from types import SimpleNamespace as NS

    from torch.profiler import ProfilerActivity, profile

    from speculum.bench.step_profile import api_summary, profile_table

    def ev(name, us, parent=None):
        return NS(name=name, time_range=NS(elapsed_us=lambda: us), cpu_parent=parent)
    outer = ev("aten::index_copy_", 30)
    inner = ev("aten::copy_", 10, outer)
    events = [outer, inner, ev("cudaLaunchKernel", 5, inner), ev("cudaLaunchKernel", 7, ev("aten::argmax", 9)),
              ev("cudaLaunchKernel", 3), ev("cudaGraphLaunch", 12), ev("cudaMemcpyAsync", 6),
              ev("cudaEventSynchronize", 200), ev("cudaEventRecord", 1), ev("cudaGetDevice", 1)]
    got = api_summary(events, steps=2)
    assert got["cuda_api"] == {"synchronisations": [0.5, 100.0], "kernel launches": [1.5, 7.5],
                               "graph launches": [0.5, 6.0], "copies": [0.5, 3.0], "events": [0.5, 0.5],
                               "other": [0.5, 0.5]}
    # each launch goes to its outermost aten operator (index_copy_, not the copy_ inside it)
    assert sorted(got["launches_by_op"]) == [["(outside an operator)", 0.5], ["aten::argmax", 0.5],
                                             ["aten::index_copy_", 0.5]]
    line = profile_table([{"method": "eagle3(k=4)", "profile": {
        "step_ms": 1, "draft_ms": 0.2, "verify_ms": 0.5, "host_ms": 0.3, "tokens_per_loop_step": 2, **got}}])
    assert "CUDA calls per step: synchronisations 0.5 (100 us)" in line and "aten::argmax 0.5" in line
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(4).argmax()
    assert api_summary(prof.events(), steps=1) == {"cuda_api": {}, "launches_by_op": []}


def test_bench_labels_step_profile_and_report(tiny_llama, tmp_path, capsys):
    from speculum.bench.methods import method_name
    from speculum.bench.step_profile import profile_steps, profile_table
    assert method_name({"method": "eagle", "tree_topk": 4, "tree_depth": 5, "num_draft_tokens": 16}) == \
        "eagle(tree4x5/16)"
    assert method_name({"method": "medusa", "speculative_token_tree": [[0], [1], [0, 0]]}) == "medusa(static3)"
    assert method_name({"method": "eagle", "num_speculative_tokens": 4}) == "eagle(k=4)"
    # configs of one method with their own heads or options keep apart
    assert method_name({"method": "eagle3", "num_speculative_tokens": 4, "model": "/tmp/tr/eagle3tail",
                        "options": {"draft_tail": False}}) == "eagle3(k=4,eagle3tail,draft_tail=False)"
    # a tree and the same tree under "auto" (the batch-16 benchmark runs both): two names
    assert method_name({"method": "eagle", "tree_topk": 8, "tree_depth": 4, "num_draft_tokens": 32,
                        "num_speculative_tokens_per_batch_size": "auto"}) == "eagle(tree8x4/32,auto)"
    assert method_name({"method": "ngram", "num_speculative_tokens": 4,
                        "num_speculative_tokens_per_batch_size": {"1-8": 4}}) == "ngram(k=4,by batch)"
    assert method_name({"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1,
                        "prompt_lookup_max": 5}) == "ngram(k=6,n=1-5)"
    llm = LLM(str(tiny_llama), {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
              device="cpu", dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=2)
    prompts = [{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5]}, {"prompt_token_ids": [9, 10]}]
    p = profile_steps(llm, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert p["loop_steps"] > 0 and p["tokens_per_loop_step"] >= 1
    assert p["step_ms"] >= p["draft_ms"] + p["verify_ms"] - 1e-6 and p["draft_ms"] > 0 and p["verify_ms"] > 0
    assert "ngram" in profile_table([{"method": "ngram(k=3)", "profile": p}])
    assert llm.loop.step.__func__ is type(llm.loop).step  # the timers are removed again
    # the report script over a sweep-shaped JSON
    import importlib.util
    spec = importlib.util.spec_from_file_location("trees_report", Path(__file__).parents[1] / "scripts" / "trees_report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)

    def row(name, cfg, mal, tps):
        e = {"tokens_per_s": tps, "mean_acceptance_length": mal}
        return {"method": name, "config": cfg, "categories": {"writing": e}, "total": e, "profile": p}
    rows = [row("autoregressive", None, None, 100.0), row("eagle(k=4)", {"method": "eagle", "num_speculative_tokens": 4},
                                                          1.8, 120.0)]
    rows += [row(f"eagle(tree4x5/{n})", {"method": "eagle", "tree_topk": 4, "tree_depth": 5, "num_draft_tokens": n},
                 1.8 + n / 32, 120 + n) for n in (8, 16, 32)]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"batch_size": 1, "prompts_per_category": 2, "max_tokens": 64, "gpu": "cpu",
                                "results": rows}))
    assert report.main(["--sweep", str(path), "--b1", str(path), str(path), "--figure", str(tmp_path / "f.png")]) == 0
    out = capsys.readouterr().out
    assert "| eagle | 1.80 | eagle(tree4x5/32) | 2.80 | +1.00 |" in out and "met" in out
    assert (tmp_path / "f.png").stat().st_size > 1000
