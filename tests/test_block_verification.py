"""Block verification reproduces the target distribution exactly, and accepts more.

Setting: a toy autoregressive pair over a small vocabulary ``V`` whose distributions
depend on the whole prefix (a table per prefix, fixed by a seed): the target ``P(. | z)``
and a draft ``Q(. | z)`` (the target's log-probabilities plus Gaussian noise). A row of a
batch is one verification step: drafts ``X_1..X_k ~ Q`` sampled autoregressively, ``p``
and ``q`` looked up along them. After the verifier, each row is completed to ``L = k + 1``
tokens by sampling the target, so a lossless verifier makes the first ``L`` tokens follow
the target's joint law ``P(z_1) P(z_2 | z_1) ..`` exactly. Block verification is only
exact jointly (the token at a position, among rows that reach it, is not ``p`` of that
position alone), which is why the test is on the joint law.

Two layers of proof:

* exact: an independent numpy enumeration over all ``V^k`` draft blocks computes the
  output law of the block rule as the paper states it; its total variation from the
  target's joint law is < 1e-12 (and that of the wrong variant >= 0.05);
* statistical: the torch implementation, ``N = 200 000`` rows, Pearson's chi-square of the
  ``V^L`` joint counts (cells with expected count < 5 pooled) at level ``ALPHA = 1e-4``.

Power: the wrong variant uses token-wise residuals ``max(0, p - q)`` inside the block rule
(``residual="token"``). Its exact joint law ``w`` is enumerated; the noncentrality
``N sum (w - P)^2 / P`` over the unpooled cells gives the power of the level-1e-4 test
against it, asserted > 0.999 (it is 1 to many decimals: TV 0.05-0.1), and the sampled
wrong variant must be rejected (p < 1e-4). Blocks of k = 3 (V = 4, 256 cells) and k = 4
(V = 3, 243 cells).
"""

from __future__ import annotations

import itertools
import logging

import numpy as np
import pytest
import torch
from scipy import stats

import speculum
from speculum.interfaces import Draft
from speculum.sampling import SamplingBatch, SamplingParams, make_generator, processed_probs
from speculum.verifiers import BlockVerifier, RejectionSampler, block_verify, block_weights, greedy_verify
from speculum.verifiers import rejection_sample
from speculum.verifiers.expected import expected_accepted_block, expected_accepted_tokenwise

ALPHA = 1e-4
N = 200_000
CASES = [pytest.param(3, 4, id="k3-V4"), pytest.param(4, 3, id="k4-V3")]


# --------------------------------------------------------------------------- toy model
class Toy:
    """Target and draft tables per prefix: ``P[d]``: [V^d, V] for depth d = 0..k+1."""

    def __init__(self, k: int, V: int, seed: int, scale: float = 1.5, noise: float = 1.0):
        g = torch.Generator().manual_seed(seed)
        self.k, self.V, self.L = k, V, k + 1
        self.logits = [torch.randn(V ** d, V, generator=g, dtype=torch.float64) * scale for d in range(k + 2)]
        self.P = [z.softmax(-1) for z in self.logits]
        self.draft_logits = [z + torch.randn(V ** d, V, generator=g, dtype=torch.float64) * noise
                             for d, z in enumerate(self.logits[:k])]
        self.Q = [z.softmax(-1) for z in self.draft_logits]

    def rows(self, n: int, gen: torch.Generator, P=None, Q=None):
        """n steps: (p [n, k+1, V], q [n, k, V], drafts [n, k], target logits [n, k+1, V]).

        Drafts are drawn from ``Q`` (default the draft tables) along each row's prefix.
        """
        P, Q = P or self.P, Q or self.Q
        idx = torch.zeros(n, dtype=torch.int64)
        ps, qs, xs, pl = [], [], [], []
        for d in range(self.k):
            q = Q[d][idx].float()
            x = torch.multinomial(q, 1, generator=gen)[:, 0]
            ps.append(P[d][idx]), qs.append(q), xs.append(x), pl.append(self.logits[d][idx])
            idx = idx * self.V + x
        ps.append(P[self.k][idx]), pl.append(self.logits[self.k][idx])
        return torch.stack(ps, 1).float(), torch.stack(qs, 1), torch.stack(xs, 1), torch.stack(pl, 1).float()

    def complete(self, tokens: torch.Tensor, gen: torch.Generator, P=None) -> torch.Tensor:
        """[n] cell index of the first L tokens: the verdict's tokens, then target samples."""
        P = P or self.P
        n = tokens.shape[0]
        out = torch.full((n, self.L), -1, dtype=torch.int64)
        w = min(self.L, tokens.shape[1])
        out[:, :w] = tokens[:, :w]
        cell = torch.zeros(n, dtype=torch.int64)
        for d in range(self.L):
            need = out[:, d] < 0
            if bool(need.any()):
                out[need, d] = torch.multinomial(P[d][cell[need]].float(), 1, generator=gen)[:, 0]
            cell = cell * self.V + out[:, d]
        return cell

    def target_law(self, P=None) -> np.ndarray:
        """Exact joint law of the first L tokens: [V^L]."""
        P = [t.numpy() for t in (P or self.P)]
        law = np.ones(1)
        for d in range(self.L):  # law over prefixes of length d+1, in cell order
            law = (law[:, None] * P[d]).reshape(-1)
        return law


def enumerate_law(toy: Toy, rule: str) -> tuple[np.ndarray, float]:
    """Exact (joint law of the first L output tokens, E[accepted]) of a verifier, by enumeration.

    An independent numpy reading of the rules: ``"block"`` (Sun et al., Algorithm 2),
    ``"wrong"`` (block with token-wise residuals), ``"token"`` (token-wise rejection).
    """
    k, V, L = toy.k, toy.V, toy.L
    P = [t.numpy() for t in toy.P]
    Q = [t.numpy() for t in toy.Q]

    def cell(prefix):
        c = 0
        for t in prefix:
            c = c * V + t
        return c

    def p(prefix):
        return P[len(prefix)][cell(prefix)]

    def q(prefix):
        return Q[len(prefix)][cell(prefix)]

    target = toy.target_law()
    out = np.zeros(V ** L)
    e_acc = 0.0

    def emit(prefix, y_law, weight):
        # prefix + Y, then the target's continuation: the law over full cells
        for y in range(V):
            if y_law[y] > 0:
                z = prefix + (y,)
                base = cell(z) * V ** (L - len(z))
                cond = target[base: base + V ** (L - len(z))] / target[base: base + V ** (L - len(z))].sum()
                out[base: base + V ** (L - len(z))] += weight * y_law[y] * cond

    for x in itertools.product(range(V), repeat=k):
        qx = float(np.prod([q(x[:i])[x[i]] for i in range(k)]))
        if rule == "token":
            reach = 1.0
            for j in range(k + 1):
                if j == k:
                    emit(x, p(x), qx * reach)
                    e_acc += qx * reach * k
                    break
                a = min(1.0, p(x[:j])[x[j]] / q(x[:j])[x[j]])
                r = np.maximum(p(x[:j]) - q(x[:j]), 0)
                if reach * (1 - a) > 0:
                    emit(x[:j], r / r.sum(), qx * reach * (1 - a))
                    e_acc += qx * reach * (1 - a) * j
                reach *= a
            continue
        w = [1.0]
        for i in range(k):
            w.append(min(1.0, w[-1] * p(x[:i])[x[i]] / q(x[:i])[x[i]]))
        res, h = [], [1.0]
        for i in range(k):
            r = np.maximum((w[i] if rule == "block" else 1.0) * p(x[:i]) - q(x[:i]), 0)
            res.append(r)
            if i >= 1:
                den = r.sum() + 1 - w[i]
                h.append(r.sum() / den if den > 0 else 1.0)
        h.append(w[k])
        for j in range(k + 1):
            pt = h[j] * float(np.prod([1 - h[i] for i in range(j + 1, k + 1)]))
            if pt <= 0:
                continue
            e_acc += qx * pt * j
            y_law = p(x) if j == k else res[j] / res[j].sum()
            emit(x[:j], y_law, qx * pt)
    return out, e_acc


def tv(a, b) -> float:
    return float(0.5 * np.abs(np.asarray(a, dtype=float) - np.asarray(b, dtype=float)).sum())


def chisq_pvalue(cells: torch.Tensor, law: np.ndarray) -> float:
    """P-value of 'cells are i.i.d. from law' (cells with expected count < 5 pooled)."""
    obs = np.bincount(cells.numpy(), minlength=law.size).astype(float)
    if obs[law <= 0].sum() > 0:
        return 0.0
    exp = law / law.sum() * obs.sum()
    small = exp < 5
    if small.any():
        obs = np.append(obs[~small], obs[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
    return float(stats.chisquare(obs, exp).pvalue)


def power(law: np.ndarray, wrong: np.ndarray, n: int) -> float:
    """Power of the level-ALPHA chi-square test of ``law`` when samples follow ``wrong``."""
    keep = law * n >= 5
    lam = float((n * (wrong[keep] - law[keep]) ** 2 / law[keep]).sum())
    df = int(keep.sum()) - 1 + int(bool((~keep & (law > 0)).any()))
    return float(stats.ncx2.sf(stats.chi2.isf(ALPHA, df), df, lam))


# ------------------------------------------------------------------ exact, by enumeration
@pytest.mark.parametrize("k, V", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_rule_is_exact_by_enumeration(k, V, seed):
    toy = Toy(k, V, seed)
    target = toy.target_law()
    block, _ = enumerate_law(toy, "block")
    wrong, _ = enumerate_law(toy, "wrong")
    token, _ = enumerate_law(toy, "token")
    assert tv(block, target) < 1e-12 and tv(token, target) < 1e-12
    assert tv(wrong, target) >= 0.05, "the wrong variant must differ substantially for the power claim"


def test_block_accepts_at_least_as_many_as_token_wise_on_every_configuration():
    """E[accepted] of block >= token-wise on 60 toy configurations (k 2..4, sharp and flat
    targets, good and bad drafts), and strictly more on average."""
    gains = []
    for i, (k, V) in enumerate([(2, 4), (3, 4), (4, 3)] * 20):
        toy = Toy(k, V, seed=100 + i, scale=[0.5, 1.5, 3.0][i % 3], noise=[0.3, 1.0, 2.0][(i // 3) % 3])
        _, e_block = enumerate_law(toy, "block")
        _, e_token = enumerate_law(toy, "token")
        assert e_block >= e_token - 1e-12, (k, V, i, e_block, e_token)
        gains.append(e_block - e_token)
    assert np.mean(gains) > 0.01


# ------------------------------------------------------------------ statistical, the torch code
@pytest.mark.parametrize("k, V", CASES)
def test_block_verify_reproduces_the_joint_law(k, V):
    toy = Toy(k, V, seed=0)
    gen = torch.Generator().manual_seed(10 + k)
    p, q, x, _ = toy.rows(N, gen)
    verdict = block_verify(p, q, x, gen)
    law = toy.target_law()
    pval = chisq_pvalue(toy.complete(verdict.token_ids, gen), law)
    assert pval > ALPHA, f"block verification is not exact (p = {pval:.2e})"
    # the accepted count matches the enumerated expectation (5 standard errors)
    _, e_block = enumerate_law(toy, "block")
    acc = verdict.num_accepted.double()
    assert abs(float(acc.mean()) - e_block) < 5 * float(acc.std()) / N ** 0.5


@pytest.mark.parametrize("k, V", CASES)
def test_token_wise_residuals_inside_the_block_rule_are_caught(k, V):
    toy = Toy(k, V, seed=0)
    law = toy.target_law()
    wrong_law, _ = enumerate_law(toy, "wrong")
    assert tv(wrong_law, law) >= 0.05
    assert power(law, wrong_law, N) > 0.999
    gen = torch.Generator().manual_seed(20 + k)
    p, q, x, _ = toy.rows(N, gen)
    cells = toy.complete(block_verify(p, q, x, gen, residual="token").token_ids, gen)
    assert chisq_pvalue(cells, wrong_law) > ALPHA  # it does what the enumeration says ...
    pval = chisq_pvalue(cells, law)
    assert pval < ALPHA, f"the wrong variant was not detected (p = {pval:.2e})"  # ... and is caught


def test_padded_blocks_are_exact():
    """Rows with n < k drafts (-1 padded): the block is X_1..X_n, the bonus comes from p_{n+1}."""
    k, V = 3, 4
    toy = Toy(k, V, seed=3)
    gen = torch.Generator().manual_seed(30)
    p, q, x, _ = toy.rows(N, gen)
    n = torch.randint(0, k + 1, (N,), generator=gen)
    x = torch.where(torch.arange(k).view(1, k) < n.view(N, 1), x, -1)
    verdict = block_verify(p, q, x, gen)
    assert bool((verdict.num_accepted <= n).all())
    assert bool((verdict.num_accepted[n == 0] == 0).all())
    pval = chisq_pvalue(toy.complete(verdict.token_ids, gen), toy.target_law())
    assert pval > ALPHA, f"padded blocks are not exact (p = {pval:.2e})"


def test_verifier_with_temperature_and_top_k_is_exact():
    """The whole path: logits -> processed_probs (target and draft alike) -> block rule."""
    k, V, t, top_k = 3, 4, 0.7, 3
    toy = Toy(k, V, seed=4)

    def processed(tables):  # each table's rows at temperature t, top-k
        return [processed_probs(z.float().unsqueeze(1), torch.full((z.shape[0],), t),
                                torch.full((z.shape[0],), top_k), torch.ones(z.shape[0]))[:, 0].double()
                for z in tables]

    P, Q = processed(toy.logits), processed(toy.draft_logits)
    gen = torch.Generator().manual_seed(40)
    n = N // 2
    _, q, x, logits = toy.rows(n, gen, P, Q)
    sampling = SamplingBatch.from_tensors(torch.full((n,), t), torch.full((n,), top_k), torch.ones(n), gen)
    verdict = BlockVerifier().verify(logits, Draft(x, q), sampling)
    assert 0 < float(verdict.num_accepted.double().mean()) < k
    pval = chisq_pvalue(toy.complete(verdict.token_ids, gen, P), toy.target_law(P))
    assert pval > ALPHA, f"block verification through the verifier is not exact (p = {pval:.2e})"


@pytest.mark.parametrize("k, V", CASES)
def test_expected_accepted_given_the_drafts_averages_to_the_rules_expectation(k, V):
    """The paired measure of ``speculum bench verifiers``: E[accepted | drafts] per rule,
    averaged over drafts X ~ q, is the enumerated E[accepted] (5 standard errors)."""
    toy = Toy(k, V, seed=8)
    p, q, x, _ = toy.rows(N, torch.Generator().manual_seed(80))
    for rule, fn in (("block", expected_accepted_block), ("token", expected_accepted_tokenwise)):
        e = fn(p, q, x).double()
        _, exact = enumerate_law(toy, rule)
        assert abs(float(e.mean()) - exact) < 5 * float(e.std()) / N ** 0.5, rule
    # one-hot drafts: both are the token-wise expectation, prod p_j(X_j)
    torch.testing.assert_close(expected_accepted_block(p, None, x), expected_accepted_tokenwise(p, None, x))


# ------------------------------------------------------------------ structure, fallbacks
def test_one_block_token_is_token_wise_rejection():
    """k = 1: block verification is the rejection sampler (same acceptance, same residual)."""
    toy = Toy(1, 6, seed=5)
    gen = torch.Generator().manual_seed(50)
    p, q, x, _ = toy.rows(20_000, gen)
    a = block_verify(p, q, x, torch.Generator().manual_seed(1))
    b = rejection_sample(p, q, x, torch.Generator().manual_seed(1))
    same = (a.token_ids == b.token_ids).all(dim=1).double().mean()
    assert float(same) > 0.999  # identical noise; only float rounding of u < p/q may differ


def test_weights_and_stop_probabilities():
    """w is the clipped running product; h_0 = 1, h_n = w_n, h = 0 past the block."""
    p = torch.tensor([[[0.5, 0.5], [0.9, 0.1], [0.2, 0.8], [0.5, 0.5]]])
    q = torch.tensor([[[0.25, 0.75], [0.3, 0.7], [0.5, 0.5]]])
    bw = block_weights(p, q, torch.tensor([[0, 0, 1]]))
    # ratios 2, 3, 1.6 -> w = 1, 1, 1, 1; with X_2 = 1 instead: 2, 1/7 -> w_2 = 1/7
    torch.testing.assert_close(bw.w, torch.ones(1, 4))
    bw = block_weights(p, q, torch.tensor([[0, 1, -1]]))
    torch.testing.assert_close(bw.w[0, :3], torch.tensor([1.0, 1.0, 1 / 7]))
    assert int(bw.n) == 2 and float(bw.h[0, 0]) == 1.0
    assert float(bw.h[0, 2]) == pytest.approx(1 / 7) and float(bw.h[0, 3]) == 0.0


def test_one_hot_drafts_fall_back_to_token_wise_and_say_so_once(caplog):
    toy = Toy(3, 5, seed=6)
    _, _, x, logits = toy.rows(64, torch.Generator().manual_seed(60))
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(64)]

    def batch():
        return SamplingBatch.from_params(params, [make_generator(i) for i in range(64)])

    verifier = BlockVerifier()
    with caplog.at_level(logging.INFO, logger="speculum.verifiers.block"):
        for _ in range(3):
            verifier.verify(logits, Draft(x), batch())
    assert sum("verified token-wise" in r.message for r in caplog.records) == 1
    # the same seeds give the rejection sampler's verdict exactly
    v, ref = BlockVerifier().verify(logits, Draft(x), batch()), RejectionSampler().verify(logits, Draft(x), batch())
    assert torch.equal(ref.token_ids, v.token_ids) and torch.equal(ref.num_accepted, v.num_accepted)
    with pytest.raises(ValueError, match="one-hot drafts"):
        block_verify(logits.softmax(-1), None, x, None)


def test_greedy_rows_are_argmax_matching_and_seeds_reproduce():
    toy = Toy(3, 5, seed=7)
    gen = torch.Generator().manual_seed(70)
    B = 8
    _, q, x, pl = toy.rows(B, gen)
    params = [SamplingParams(temperature=0.0 if b % 2 else 1.0, seed=b) for b in range(B)]

    def run():
        gens = [None if b % 2 else make_generator(b) for b in range(B)]
        return BlockVerifier().verify(pl, Draft(x, q), SamplingBatch.from_params(params, gens))

    a, b = run(), run()
    assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.num_accepted, b.num_accepted)
    g = greedy_verify(pl, x)
    odd = torch.arange(B) % 2 == 1
    assert torch.equal(a.token_ids[odd], g.token_ids[odd]) and torch.equal(a.num_accepted[odd], g.num_accepted[odd])
    # a row's outcome depends on its own seed only, not on the rest of the batch
    for r in range(0, B, 2):
        one = BlockVerifier().verify(pl[r:r + 1], Draft(x[r:r + 1], q[r:r + 1]),
                                     SamplingBatch.from_params([params[r]], [make_generator(r)]))
        assert torch.equal(one.token_ids[0], a.token_ids[r])


class _TreeDrafter:
    """Claims to draft trees (the engine checks the verifier next)."""

    supports_trees = True

    def propose(self, batch):
        return Draft.empty(len(batch.seqs))

    def observe(self, feedback):
        pass


class _TreePlugin:
    @staticmethod
    @speculum.hookimpl
    def speculum_register_proposers(register):
        register("treeish", lambda ctx: _TreeDrafter(), description="claims trees")


def test_a_tree_config_with_block_verification_is_refused(tiny_llama):
    """Trees are verified by rejection_sampler and greedy; block's tree variant is not built."""
    with pytest.raises(speculum.ConfigError, match="verifier 'block' does not handle token trees"):
        speculum.LLM(str(tiny_llama), {"method": "treeish", "tree_topk": 2, "tree_depth": 2, "num_draft_tokens": 4,
                                       "acceptance_method": "block"},
                     device="cpu", dtype="float32", kv_cache_memory=4 << 20, plugins=[_TreePlugin])
