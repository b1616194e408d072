"""Statistical proof that tree verification reproduces the target distribution exactly.

Setting: vocabulary V = 6 and a fixed two-token "target model": the law of the first
token ``p0`` and, for every first token ``a``, the law of the second ``p1[a]``. One step
verifies a tree of depth 2 with 3 siblings under the root and 3 under each of them (12
nodes): node columns carry the target distribution after their path (``p1[token]`` at
depth 1; depth-2 columns carry an arbitrary law, for the bonus token, which is not
tested). When a step emits only one token ``a``, a second step verifies a fresh tree
rooted after ``a`` (root law ``p1[a]``) and its first token is the second token. The
pair (first, second token) must then follow ``p0(a) p1[a](b)`` exactly: this checks
acceptance at depth 1 and 2, the residual after rejected siblings at both depths, and
the token drawn after an accepted node.

Nodes are either drawn from draft distributions (each sibling from its own ``q``,
independently; probabilities handed to the verifier) or deterministic (three distinct
tokens per parent, ``probs=None``: one-hot). Temperature 1, and temperature/top-k/top-p
through :class:`RejectionSampler` (target and draft logits processed alike).

Statistic: Pearson's chi-square over the 36 cells of the pair (``gof_pvalue`` of
``test_rejection_sampler``: cells with expected count < 5 pooled), level ALPHA = 1e-4,
N = 100 000 pairs per test.

Power: the wrong variant that does not replace ``p`` by the residual between siblings
(``tree_rejection_sample(..., sibling_residual=False)``) must be rejected. Its pair law
``w`` is estimated from 300 000 independent pairs; the test requires TV(w, p) >= 0.05
and computes the power of the level-1e-4 test at N = 100 000 with the noncentral
chi-square (``lambda = N sum (w - p)^2 / p``): > 0.999 in every case (the cases here have
TV 0.15 with draft probabilities and 0.28 with deterministic nodes, power 1 to many
decimals), then checks that the wrong variant's fresh samples are in fact rejected.
"""

from __future__ import annotations

import pytest
import torch

from speculum.interfaces import Draft
from speculum.sampling import SamplingBatch, processed_probs
from speculum.tree import TokenTree
from speculum.verifiers import RejectionSampler
from speculum.verifiers.tree import tree_greedy_verify, tree_rejection_sample
from test_rejection_sampler import ALPHA, chisq_power, gof_pvalue, tv

V = 6
N = 100_000
N_WRONG_LAW = 300_000
WIDTH = 3  # siblings per node
# root -> 3 children (nodes 0..2), node c -> 3 children (nodes 3 + 3c .. 5 + 3c)
PARENTS = [-1, -1, -1] + [c for c in range(WIDTH) for _ in range(WIDTH)]


def case(seed: int):
    """Target logits: first token [V], second given the first [V, V], bonus [V]; draft
    logits: one per sibling slot at the root [3, V] and per (first token, slot) [V, 3, V]."""
    g = torch.Generator().manual_seed(seed)
    t0, t1, t2 = torch.randn(V, generator=g) * 1.2, torch.randn(V, V, generator=g) * 1.2, torch.randn(V, generator=g)
    d0 = t0.view(1, V) + torch.randn(WIDTH, V, generator=g)
    d1 = t1.view(V, 1, V) + torch.randn(V, WIDTH, V, generator=g)
    return (t0, t1, t2), (d0, d1)


def tree_of(n: int) -> TokenTree:
    return TokenTree(torch.tensor(PARENTS).expand(n, -1).contiguous(), max_depth=2, max_children=WIDTH)


def draw(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One token per row of probs [n, V]."""
    return torch.multinomial(probs, 1, replacement=True, generator=gen).squeeze(1)


class Step:
    """Builds one tree step over n rows whose root law is ``root_t`` [n, V] (target logits)."""

    def __init__(self, target, draft, temperature, top_k, top_p, sampled: bool):
        self.t0, self.t1, self.t2 = target
        self.d0, self.d1 = draft
        self.f = (temperature, top_k, top_p)
        self.sampled = sampled

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """processed_probs for logits [n, T, V] with the case's filters."""
        n = logits.shape[0]
        t, k, p = self.f
        return processed_probs(logits, torch.full((n,), t), torch.full((n,), k, dtype=torch.int64),
                               torch.full((n,), p))

    def build(self, root_t: torch.Tensor, root_d: torch.Tensor, gen: torch.Generator):
        """(target logits [n, 13, V], tokens [n, 12], draft probs [n, 12, V] or None).

        ``root_d`` [n, 3, V]: draft logits of the three root children; a depth-1 node with
        token a has children drawn from ``d1[a]`` and target law ``t1[a]``."""
        n = root_t.shape[0]
        q_root = self.probs(root_d)  # [n, 3, V]
        if self.sampled:
            first = torch.stack([draw(q_root[:, s], gen) for s in range(WIDTH)], dim=1)  # [n, 3]
        else:  # three distinct deterministic tokens: the draft's top 3 of slot 0
            first = root_d[:, 0].topk(WIDTH, dim=-1).indices
        q_second = self.probs(self.d1[first].view(n, WIDTH * WIDTH, V)).view(n, WIDTH, WIDTH, V)
        if self.sampled:
            second = torch.stack([draw(q_second[:, c, s], gen) for c in range(WIDTH) for s in range(WIDTH)], dim=1)
        else:
            second = self.d1[first, 0].topk(WIDTH, dim=-1).indices.view(n, WIDTH * WIDTH)
        tokens = torch.cat([first, second], dim=1)  # [n, 12]
        logits = torch.cat([root_t.view(n, 1, V), self.t1[first], self.t2.expand(n, WIDTH * WIDTH, V)], dim=1)
        probs = torch.cat([q_root, q_second.view(n, WIDTH * WIDTH, V)], dim=1) if self.sampled else None
        return logits, tokens, probs


def run_pairs(step: Step, n: int, seed: int, verify) -> torch.Tensor:
    """[n, 2] first and second emitted token, over one or two tree steps."""
    gen = torch.Generator().manual_seed(seed)
    logits, tokens, probs = step.build(step.t0.expand(n, V), step.d0.expand(n, WIDTH, V), gen)
    v = verify(logits, tokens, probs, gen)
    first, second = v.token_ids[:, 0], v.token_ids[:, 1]
    short = v.num_accepted == 0  # only one token emitted: a second step rooted after it
    m = int(short.sum())
    if m:
        a = first[short]
        logits2, tokens2, probs2 = step.build(step.t1[a], step.d1[a], gen)
        second = second.clone()
        second[short] = verify(logits2, tokens2, probs2, gen).token_ids[:, 0]
    return torch.stack([first, second], dim=1)


def pair_law(step: Step) -> torch.Tensor:
    """Exact law of the pair [V * V] under the processed target."""
    p0 = step.probs(step.t0.view(1, 1, V))[0, 0]
    p1 = step.probs(step.t1.view(1, V, V))[0]
    return (p0.view(V, 1) * p1).reshape(-1)


def via_rejection_sampler(step: Step):
    """Verify through RejectionSampler.verify (logits in, filters applied inside)."""
    def verify(logits, tokens, probs, gen):
        n = logits.shape[0]
        t, k, p = step.f
        sampling = SamplingBatch.from_tensors(torch.full((n,), t), torch.full((n,), k, dtype=torch.int64),
                                              torch.full((n,), p), gen)
        return RejectionSampler().verify(logits, Draft(tokens, probs, tree=tree_of(n)), sampling)
    return verify


def direct(step: Step, sibling_residual: bool = True):
    def verify(logits, tokens, probs, gen):
        return tree_rejection_sample(step.probs(logits), probs, tokens, tree_of(logits.shape[0]), gen,
                                     sibling_residual=sibling_residual)
    return verify


FILTERS = [
    pytest.param(1.0, 0, 1.0, id="t1"),
    pytest.param(0.8, 4, 1.0, id="t0.8-topk4"),
    pytest.param(1.0, 0, 0.8, id="t1-topp0.8"),
]


def cells(pairs: torch.Tensor) -> torch.Tensor:
    return pairs[:, 0] * V + pairs[:, 1]


@pytest.mark.parametrize("sampled", [True, False], ids=["draft-probs", "deterministic"])
@pytest.mark.parametrize("temperature, top_k, top_p", FILTERS)
def test_tree_sampling_reproduces_the_target_pair_law(sampled, temperature, top_k, top_p):
    target, draft = case(12)
    step = Step(target, draft, temperature, top_k, top_p, sampled)
    pairs = run_pairs(step, N, seed=1, verify=via_rejection_sampler(step))
    law = pair_law(step)
    pval = gof_pvalue(cells(pairs), law)
    assert pval > ALPHA, f"the (first, second) token law differs from the target's (p-value {pval:.2e})"
    # both depths are exercised: steps accept 1 and 2 nodes (and 0, but for top-p 0.8 with
    # sampled children, where three samples almost always cover the few tokens left)
    v = via_rejection_sampler(step)(*step.build(target[0].expand(2000, V), draft[0].expand(2000, WIDTH, V),
                                                torch.Generator().manual_seed(3)), torch.Generator().manual_seed(4))
    assert {1, 2} <= set(v.num_accepted.tolist())
    if top_p == 1.0 or not sampled:
        assert 0 in set(v.num_accepted.tolist())
    assert bool((v.path[:, 1][v.num_accepted == 2] >= WIDTH).all())  # the second accepted node is at depth 2
    # the second accepted sibling is tried too: some accepted nodes are not the first child
    first_node = v.path[:, 0][v.num_accepted >= 1]
    assert len(set(first_node.tolist())) >= 2


@pytest.mark.parametrize("sampled", [True, False], ids=["draft-probs", "deterministic"])
def test_no_residual_between_siblings_is_caught(sampled):
    target, draft = case(12)
    step = Step(target, draft, 1.0, 0, 1.0, sampled)
    law = pair_law(step)
    w_pairs = run_pairs(step, N_WRONG_LAW, seed=5, verify=direct(step, sibling_residual=False))
    w = torch.bincount(cells(w_pairs), minlength=V * V).double() / N_WRONG_LAW
    assert tv(w, law) >= 0.05, f"pick a case where the wrong variant differs (TV {tv(w, law):.3f})"
    assert chisq_power(law, w, N) > 0.999
    right = run_pairs(step, N, seed=6, verify=direct(step))
    assert gof_pvalue(cells(right), law) > ALPHA
    wrong = run_pairs(step, N, seed=7, verify=direct(step, sibling_residual=False))
    pval = gof_pvalue(cells(wrong), law)
    assert pval < ALPHA, f"the missing residual update between siblings was not detected (p-value {pval:.2e})"


# ---------------------------------------------------------------------------- greedy
def test_greedy_tree_takes_the_deepest_matching_path():
    # argmax per column: root 2; node0 -> 5, node1 -> 1, node2 -> 0, node3 -> 4, node4 -> 3, node5 -> 0
    am = torch.tensor([2, 5, 1, 0, 4, 3, 0])
    logits = torch.full((1, 7, V), -5.0)
    logits[0, torch.arange(7), am] = 5.0
    #            0   1   2   3   4   5
    parents = [-1, -1, 0, 1, 1, 3]
    rows = [
        [3, 2, 5, 0, 1, 4],    # node0 misses the root's 2; node1 = 2, node4 = 1 match: depth 2
        [2, 2, 5, 1, 1, 4],    # node0 -> node2 match (depth 2), node1 -> node3 -> node5 too: depth 3 wins
        [4, 4, 5, 1, 1, 4],    # nothing matches at the root
        [2, -1, 5, 1, 1, 4],   # node1 dropped (-1): its subtree cannot be accepted
        [2, 10**6, 5, 1, 1, 4],  # node1 past the vocabulary (an unchecked device draft): as if dropped
    ]
    tokens = torch.tensor(rows)
    tree = TokenTree(torch.tensor(parents).expand(5, -1).contiguous())
    v = tree_greedy_verify(logits.expand(5, -1, -1), tokens, tree)
    assert v.num_accepted.tolist() == [2, 3, 0, 2, 2]
    assert v.path.tolist() == [[1, 4, -1, -1, -1, -1], [1, 3, 5, -1, -1, -1], [-1] * 6, [0, 2, -1, -1, -1, -1],
                               [0, 2, -1, -1, -1, -1]]
    assert v.token_ids.tolist() == [[2, 1, 3, -1, -1, -1, -1], [2, 1, 4, 0, -1, -1, -1], [2, -1, -1, -1, -1, -1, -1],
                                    [2, 5, 0, -1, -1, -1, -1], [2, 5, 0, -1, -1, -1, -1]]


def test_greedy_tree_ties_take_the_first_node():
    logits = torch.zeros(1, 4, V)
    logits[0, :, 1] = 3.0  # argmax 1 everywhere
    tokens = torch.tensor([[1, 1, 1]])  # two root children equal 1; node2 under node1
    tree = TokenTree(torch.tensor([[-1, -1, 1]]))
    v = tree_greedy_verify(logits, tokens, tree)
    assert v.path.tolist() == [[1, 2, -1]] and v.num_accepted.tolist() == [2]
    tree = TokenTree(torch.tensor([[-1, -1, -1]]))
    assert tree_greedy_verify(logits, tokens, tree).path.tolist() == [[0, -1, -1]]


def _greedy_tree_reference(am: list[int], tokens: list[int], parents: list[int]):
    """One row, node by node: (tokens emitted, accepted count, path)."""
    ok = []
    for i, (t, p) in enumerate(zip(tokens, parents)):
        ok.append(t >= 0 and t == am[p + 1] and (p < 0 or ok[p]))
    depth = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    cands = [i for i in range(len(tokens)) if ok[i]]
    if not cands:
        return [am[0]], 0, []
    best = max(cands, key=lambda i: (depth[i], -i))
    path, a = [], best
    while a >= 0:
        path.append(a)
        a = parents[a]
    path.reverse()
    return [tokens[i] for i in path] + [am[best + 1]], len(path), path


def test_greedy_tree_verification_agrees_with_a_node_by_node_reference():
    """Random trees (up to 24 nodes, some missing), argmaxes matched at random: the
    vectorised rule emits what walking the tree node by node does, on every row."""
    g = torch.Generator().manual_seed(3)
    for trial in range(30):
        B, N = 8, int(torch.randint(1, 25, (1,), generator=g))
        parents = torch.full((B, N), -1, dtype=torch.int64)
        for i in range(1, N):
            parents[:, i] = torch.randint(-1, i, (B,), generator=g)
        logits = torch.randn(B, N + 1, V, generator=g)
        am = logits.argmax(-1)
        tokens = torch.where(torch.rand(B, N, generator=g) < 0.6, am.gather(1, parents + 1),
                             torch.randint(0, V, (B, N), generator=g))
        tokens = torch.where(torch.rand(B, N, generator=g) < 0.1, -1, tokens)
        v = tree_greedy_verify(logits, tokens, TokenTree(parents))
        for b in range(B):
            want, a, path = _greedy_tree_reference(am[b].tolist(), tokens[b].tolist(), parents[b].tolist())
            assert int(v.num_accepted[b]) == a, (trial, b)
            assert v.path[b].tolist() == path + [-1] * (N - a), (trial, b)
            assert v.token_ids[b].tolist() == want + [-1] * (N - a), (trial, b)


def test_chain_tree_equals_chain_verification():
    from speculum.verifiers.greedy import greedy_verify
    from speculum.verifiers.rejection import rejection_sample
    g = torch.Generator().manual_seed(0)
    B, k = 400, 4
    logits = torch.randn(B, k + 1, V, generator=g) * 2
    am = logits.argmax(-1)
    drafts = torch.where(torch.rand(B, k, generator=g) < 0.7, am[:, :k], torch.randint(0, V, (B, k), generator=g))
    tree = TokenTree.chain(B, k)
    a, b = tree_greedy_verify(logits, drafts, tree), greedy_verify(logits, drafts)
    assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.num_accepted, b.num_accepted)
    assert torch.equal(a.path, torch.where(torch.arange(k) < a.num_accepted.view(-1, 1), torch.arange(k), -1))
    # sampled, one-hot drafts: a chain's tree verification is the chain rejection sampler's law
    p = logits.softmax(-1)
    t = tree_rejection_sample(p, None, drafts, tree, torch.Generator().manual_seed(1))
    c = rejection_sample(p, None, drafts, torch.Generator().manual_seed(1))
    assert torch.equal(t.num_accepted, c.num_accepted)  # same uniforms, same accept decisions


def test_mixed_greedy_and_sampled_tree_rows():
    target, draft = case(3)
    step = Step(target, draft, 1.0, 0, 1.0, sampled=False)
    n = 64
    gen = torch.Generator().manual_seed(0)
    logits, tokens, _ = step.build(target[0].expand(n, V), draft[0].expand(n, WIDTH, V), gen)
    greedy = torch.arange(n) % 2 == 0
    sampling = SamplingBatch.from_tensors(torch.where(greedy, 0.0, 1.0), torch.zeros(n, dtype=torch.int64),
                                          torch.ones(n), gen)
    v = RejectionSampler().verify(logits, Draft(tokens, tree=tree_of(n)), sampling)
    g = tree_greedy_verify(logits[greedy], tokens[greedy], tree_of(int(greedy.sum())))
    assert torch.equal(v.token_ids[greedy], g.token_ids) and torch.equal(v.path[greedy], g.path)
