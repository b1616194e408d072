"""N-gram lookup drafting token trees: the candidates and their trie, the proposer's
Draft, config errors, and on a tiny target: greedy output equal to no speculation
(mixed prompt lengths, preemption, overlap forced on) and the engine's steps equal to
``scripts/ngram_ceiling.py``'s tree replay over the same answers."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest
import torch

from speculum.config import SpeculativeConfig
from speculum.errors import ConfigError
from speculum.interfaces import ProposeBatch, SequenceView
from speculum.sampling import SamplingBatch, SamplingParams
from speculum.testing import (make_llm, assert_tree_greedy_lossless, assert_tree_greedy_lossless_under_preemption,
                              assert_drafting_ahead_changes_nothing, record_trees, tiny_model_dir, tree_token_paths)
from speculum_ngram import NgramProposer, SuffixIndex, TreeSuffixIndex, continuation_trie

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "ngram_ceiling.py"
TREE = {"tree_topk": 3, "tree_depth": 3, "num_draft_tokens": 8}
SPEC = {"method": "ngram", "prompt_lookup_min": 1, **TREE}
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _script():
    spec = importlib.util.spec_from_file_location("ngram_ceiling", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _prompts(seed: int = 0) -> list[dict]:
    """Mixed lengths; some repeat themselves (n-gram drafts and is accepted often)."""
    g = torch.Generator().manual_seed(seed)
    r = (lambda n: torch.randint(3, 500, (n,), generator=g).tolist())
    return [{"prompt_token_ids": p} for p in ([5], r(3) * 3, r(17), r(6) * 5, r(40), r(2) * 2)]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("target"), "llama", seed=0)


def _propose(p: NgramProposer, seqs: list[list[int]], k: int):
    params = [SamplingParams(temperature=0)] * len(seqs)
    views = [SequenceView(i, s, 1) for i, s in enumerate(seqs)]
    return p.propose(ProposeBatch(views, k, SamplingBatch.from_params(params, [None] * len(seqs))))


def _tree_proposer(n_min=1, n_max=5, topk=3, depth=3, num_draft_tokens=8, window=0) -> NgramProposer:
    cfg = SpeculativeConfig(method="ngram", prompt_lookup_min=n_min, prompt_lookup_max=n_max, tree_topk=topk,
                            tree_depth=depth, num_draft_tokens=num_draft_tokens)
    p = NgramProposer.from_context(types.SimpleNamespace(config=cfg, options=None))
    p.search_window = window
    return p


# ------------------------------------------------------------------ candidates and the trie
def test_continuations_longest_suffix_first_then_most_recent_distinct():
    # "1 2" is followed by 3 7, then 4 5, then 3 7 again; "2" alone also by 8 8
    ctx = [1, 2, 3, 7, 2, 8, 8, 1, 2, 4, 5, 1, 2, 3, 7, 0, 1, 2]
    ix = TreeSuffixIndex(ctx, 1, 5, keep=8)
    assert ix.continuations(2, 8) == [(3, 7), (4, 5), (8, 8)]  # n = 2: latest first, no repeat; then n = 1
    assert ix.continuations(2, 2) == [(3, 7), (4, 5)]
    assert ix.continuations(3, 1) == [(3, 7, 0)]
    # the chain draft of a chain index is the first continuation
    assert SuffixIndex(list(ctx), 1, 5).draft(3) == list(ix.continuations(3, 1)[0]) == ix.draft(3)
    # keep bounds the occurrences remembered per n-gram: the latest 1 of "1 2" only
    assert TreeSuffixIndex(list(ctx), 2, 2, keep=1).continuations(2, 8) == [(3, 7)]
    assert TreeSuffixIndex(list(ctx), 2, 2, keep=0).continuations(2, 8) == [(3, 7), (4, 5)]


def test_trie_shares_prefixes_and_skips_what_exceeds_the_budget():
    paths = [(1, 2, 3), (1, 2, 4), (5, 6), (1, 7)]
    tok, par = continuation_trie(paths, 32)
    assert tok == [1, 2, 3, 4, 5, 6, 7] and par == [-1, 0, 1, 1, -1, 4, 0]
    assert tree_token_paths(tok, par) == {(1,), (1, 2), (1, 2, 3), (1, 2, 4), (5,), (5, 6), (1, 7)}
    # 5 nodes: (5, 6) would make 6, skipped; (1, 7) still fits
    tok, par = continuation_trie(paths, 5)
    assert tok == [1, 2, 3, 4, 7] and par == [-1, 0, 1, 1, 0]
    assert continuation_trie([], 4) == ([], [])
    assert continuation_trie([(1, 2, 3)], 2) == ([], [])


@pytest.mark.parametrize("vocab", [3, 8, 50])
def test_index_continuations_equal_the_definition_as_the_sequence_grows(vocab):
    """Step by step (a few tokens appended, sometimes a copy of earlier text, sometimes many
    at once): the index's continuations equal a scan of the whole context (or of the last
    ``window`` tokens) over each n-gram's latest ``keep`` occurrences."""
    g = torch.Generator().manual_seed(vocab)

    def reference(t, n_min, n_max, depth, m, keep):
        L, out = len(t), []
        for n in range(min(n_max, L - 1), n_min - 1, -1):
            ends = [e for e in range(n - 1, L - 1) if t[e - n + 1: e + 1] == t[L - n:]]
            for e in reversed(ends[-keep:] if keep else ends):
                c = tuple(t[e + 1: e + 1 + depth])
                if c not in out:
                    out.append(c)
                    if len(out) == m:
                        return out
        return out

    checked = 0
    for trial in range(30):
        n_min = 1 + trial % 2
        n_max, depth, m, keep = n_min + trial % 4, 1 + trial % 5, 1 + trial % 6, [0, 2, 6][trial % 3]
        t = torch.randint(0, vocab, (1 + trial * 3,), generator=g).tolist()
        ix = TreeSuffixIndex(t, n_min, n_max, keep)
        for step in range(15):
            want = reference(t, n_min, n_max, depth, m, keep)
            assert ix.continuations(depth, m) == want, (trial, step)
            window = 5 + trial  # a search window: the definition over the last tokens only
            assert ix.continuations(depth, m, window) == reference(t[-window:], n_min, n_max, depth, m, keep)
            checked += len(want) > 1
            grow = int(torch.randint(1, 30 if step % 5 == 0 else 5, (1,), generator=g))
            if step % 2:
                at = int(torch.randint(0, len(t), (1,), generator=g))
                t.extend(t[at: at + grow])
            else:
                t.extend(torch.randint(0, vocab, (grow,), generator=g).tolist())
    assert checked > 50


def test_proposer_drafts_a_padded_trie_per_row():
    p = _tree_proposer(n_min=2, topk=3, depth=2, num_draft_tokens=6)  # 5 nodes
    rows = [[1, 2, 3, 7, 0, 1, 2, 4, 5, 0, 1, 2], [9, 8, 7], [1, 2, 3, 1, 2]]
    d = _propose(p, rows, 5)
    assert d.probs is None and d.lengths == [4, 0, 2]
    assert d.token_ids.tolist() == [[4, 5, 3, 7, -1], [-1] * 5, [3, 1, -1, -1, -1]]
    assert d.tree.parents.tolist() == [[-1, 0, -1, 2, -1], [-1] * 5, [-1, 0, -1, -1, -1]]
    # the bound is the lookup's top-k: padding under the root (token -1) does not count, so the
    # sampled verifier loops depth x 3 times, not depth x 5
    assert d.tree.max_depth == 2 and d.tree.max_children == 3
    d.tree.validate(d.token_ids)
    with pytest.raises(ValueError, match="children > max_children"):
        d.tree.validate()  # counting the padding, the root of row 1 has 5 children
    d.tree.check(d.token_ids)


def test_padding_nodes_are_never_accepted():
    """Padding (token -1 under the root) never matches, even where the target's argmax is
    anything at all; the greedy tree verifier accepts the real path."""
    from speculum.verifiers.tree import tree_greedy_verify
    p = _tree_proposer(n_min=2, topk=3, depth=2, num_draft_tokens=6)
    d = _propose(p, [[1, 2, 3, 1, 2], [9, 8, 7]], 5)
    V = 16
    for argmax in range(V):
        logits = torch.zeros(2, 6, V)
        logits[:, :, argmax] = 1.0
        v = tree_greedy_verify(logits, d.token_ids, d.tree)
        on_path = [n for n in v.path[0].tolist() if n >= 0]
        assert all(d.token_ids[0, n] >= 0 for n in on_path)
        assert v.num_accepted[1] == 0


def test_one_candidate_drafts_the_chain():
    chain, tree = NgramProposer(1, 4), _tree_proposer(n_min=1, n_max=4, topk=1, depth=3, num_draft_tokens=4)
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        s = torch.randint(0, 6, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist()
        want = [t for t in chain.propose(ProposeBatch([SequenceView(0, list(s), 1)], 3, SamplingBatch.from_params(
            [SamplingParams(temperature=0)], [None]))).token_ids[0].tolist() if t >= 0]
        got = _propose(tree, [list(s)], 3)
        assert [t for t in got.token_ids[0].tolist() if t >= 0] == want
        chain._index.clear(), tree._index.clear()


def test_a_static_tree_or_a_budget_past_topk_times_depth_is_a_config_error():
    with pytest.raises(ConfigError, match="tree_topk.*tree_depth.*num_draft_tokens"):
        NgramProposer.from_context(types.SimpleNamespace(
            config=SpeculativeConfig(method="ngram", speculative_token_tree=[[0], [1], [0, 0]]), options=None))
    with pytest.raises(ConfigError, match="num_draft_tokens <= 7"):
        _tree_proposer(topk=2, depth=3, num_draft_tokens=9)
    assert _tree_proposer(topk=2, depth=3, num_draft_tokens=7).tree.num_nodes == 6


# ------------------------------------------------------------------ on a tiny target
@pytest.mark.parametrize("max_num_seqs", [2, 6], ids=["joins-mid-flight", "all-at-once"])
@pytest.mark.parametrize("runner", ["native", "hf"])
def test_tree_greedy_output_is_identical_to_no_speculation(target, runner, max_num_seqs):
    assert_tree_greedy_lossless(lambda sp, **kw: make_llm(target, sp, runner=runner, **kw), SPEC, _prompts(),
                                GREEDY, max_num_seqs=max_num_seqs)


def test_tree_greedy_lossless_under_preemption(target):
    # target 2 layers, K and V, 2 heads x 16 dims, fp32: 512 bytes per token (no draft cache)
    assert_tree_greedy_lossless_under_preemption(target, SPEC, 512)


@pytest.mark.parametrize("tree", [{"tree_topk": 3, "tree_depth": 3, "num_draft_tokens": 8},
                                  {"tree_topk": 8, "tree_depth": 4, "num_draft_tokens": 12}], ids=["3x3/8", "8x4/12"])
def test_engine_steps_equal_the_ceiling_replay(target, tree):
    """Per request, the engine's verify steps and emitted tokens equal the tree replay of
    scripts/ngram_ceiling.py over the same greedy answers (after the prefill's token: the
    replay starts from the prompt and that token). 8x4/12: the budget binds."""
    spec = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4, **tree}
    llm = make_llm(target, spec, max_num_seqs=4)
    seen = record_trees(llm)
    outs = llm.generate(_prompts(1), GREEDY)
    mod = _script()
    cfg = llm.speculative_config.tree
    total_steps = 0
    for p, o in zip(_prompts(1), outs):
        data = [{"prompt": p["prompt_token_ids"] + o.token_ids[:1], "output": o.token_ids[1:]}]
        r = mod.replay_tree(data, 1, 4, cfg.depth, cfg.topk, cfg.num_nodes)
        # the engine counts the prefill's step too; every step emits its accepted nodes and one token
        m = o.metrics
        assert (m.num_steps - 1, m.num_accepted_tokens) == (r["steps"], r["tokens"] - r["steps"]), o.request_id
        assert m.num_steps + m.num_accepted_tokens == len(o.token_ids) == 1 + r["tokens"]
        total_steps += r["steps"]
    assert llm.metrics.num_accepted_tokens > 0 and total_steps < sum(len(o.token_ids) for o in outs) - len(outs)
    assert any(len({tuple(x) for x in tree_token_paths(t, pa)}) > 3 for _, toks, pars, _ in seen
               for t, pa in zip(toks, pars))


def test_tree_steps_drafted_ahead_change_nothing(target):
    """Overlap forced on (a CPU engine does not overlap): n-gram is stateless, so tree
    steps are drafted and launched at the end of the step before; an abort and a join drop
    one. Outputs equal plain decoding; drafts and acceptance equal a run without overlap."""
    params = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)
    prompts = _prompts(2)[1:5]

    def build(overlap: bool):
        llm = make_llm(target, SPEC, max_num_seqs=4)
        llm.loop.overlap = overlap
        return llm

    plain = [o.token_ids for o in make_llm(target).generate(prompts, params)]
    assert_drafting_ahead_changes_nothing(build, prompts, params, plain)


def test_sampled_tree_steps_run(target):
    """Temperature > 0: the one-hot nodes go through the tree rejection sampler (padding
    nodes are no siblings); seeded outputs are reproducible and run to max_tokens."""
    params = SamplingParams(temperature=0.8, max_tokens=24, seed=3, ignore_eos=True)
    runs = [make_llm(target, SPEC, max_num_seqs=3) for _ in range(2)]
    outs = [[o.token_ids for o in llm.generate(_prompts(), params)] for llm in runs]
    assert outs[0] == outs[1] and all(len(t) == 24 for t in outs[0])
    # (a random tiny target at 0.8 is nearly uniform: its nodes are drafted but seldom accepted)
    assert runs[0].metrics.num_tree_steps > 0


def test_the_sampled_verifier_tries_every_real_child_within_the_topk_bound():
    """With max_children = the lookup's top-k (padding not counted), the sampled tree
    verifier still reaches the last real sibling when padding comes first in node order:
    a target certain of that sibling's token accepts it, then its child."""
    from speculum.tree import TokenTree
    from speculum.verifiers.tree import tree_rejection_sample

    V = 8
    tokens = torch.tensor([[-1, -1, 2, 3, 4, 5]])  # two padding nodes, then children 2, 3, 4 of the root
    parents = torch.tensor([[-1, -1, -1, -1, -1, 4]])  # node 5 (token 5) under node 4 (token 4)
    tree = TokenTree(parents, max_depth=2, max_children=3)
    tree.validate(tokens)
    p = torch.full((1, 7, V), 1e-9)
    p[0, 0, 4] = 1.0  # at the root the target wants token 4 (the third real sibling)
    p[0, 5, 5] = 1.0  # after node 4 (column 5) it wants token 5 (node 5)
    p[0, 6, 1] = 1.0  # after node 5: token 1
    p = p / p.sum(-1, keepdim=True)
    v = tree_rejection_sample(p, None, tokens, tree, torch.Generator().manual_seed(0))
    assert int(v.num_accepted[0]) == 2 and v.token_ids[0, :3].tolist() == [4, 5, 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("max_num_seqs", [1, 6])
def test_tree_greedy_lossless_on_cuda(target, max_num_seqs):
    """On the GPU (graphed verify forwards, graphed greedy tree verify, steps drafted ahead
    by default): the host-made trees are shipped to the device; output equals plain decoding
    (fp32) and the engine's steps equal the replay."""
    def make(spec, **kw):
        return make_llm(target, spec, device="cuda", **kw)

    llm = assert_tree_greedy_lossless(make, SPEC, _prompts(), GREEDY, max_num_seqs=max_num_seqs)
    mod, cfg = _script(), llm.speculative_config.tree
    for p, o in zip(_prompts(), llm.generate(_prompts(), GREEDY)):
        r = mod.replay_tree([{"prompt": p["prompt_token_ids"] + o.token_ids[:1], "output": o.token_ids[1:]}],
                            1, 5, cfg.depth, cfg.topk, cfg.num_nodes)
        assert (o.metrics.num_steps - 1, o.metrics.num_accepted_tokens) == (r["steps"], r["tokens"] - r["steps"])
