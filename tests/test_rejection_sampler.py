"""Statistical proof that the verifiers reproduce the target distribution exactly.

Setting: a small vocabulary, fixed target logits (distributions ``p_0 .. p_k``) and draft
logits (``q_0 .. q_{k-1}``), the same for every row; each row of one big batch is an
independent verification step. Because ``p_i`` does not depend on the row's earlier
tokens, the lossless property says:

* the token emitted at position ``i``, over the rows that reached it
  (``num_accepted >= i``), is distributed as ``p_i`` -- position 0 is the plain marginal,
  later positions are conditional on the earlier drafts being accepted;
* draft ``i`` is accepted (given that position ``i`` was reached) with probability
  ``alpha_i = sum_x min(p_i(x), q_i(x))`` (``p_i(d)`` for a one-hot draft ``d``).

Statistic: Pearson's chi-square goodness of fit (``scipy.stats.chisquare``) of the
observed token counts against the exact expected counts ``n * p_i`` (cells with expected
count < 5 are pooled; a token outside the support of ``p_i`` fails at once). A test
passes when the p-value is > ``ALPHA = 1e-4``, so a correct sampler fails each check
with probability 1e-4 (the false-alarm rate per test; all randomness is seeded, so a run
is reproducible anyway). Acceptance rates must lie within 5 standard errors of
``alpha_i`` (false alarm ~6e-7 per check).

Power: the chi-square test is shown to catch the classic mistake of resampling from
``p`` instead of the residual ``norm(max(0, p - q))`` after a rejection
(``rejection_sample(..., residual="p")``). That wrong sampler emits
``w = min(p, q) + (1 - alpha) p`` at position 0. The test computes ``w`` and its total
variation distance to ``p`` analytically and requires TV >= 0.05. With N = 100 000 rows
the chi-square noncentrality is ``lambda = N sum (w - p)^2 / p >= 4 N TV^2 >= 1000``
(Cauchy-Schwarz), while the 1e-4 critical value is 37.4 (11 degrees of freedom, V = 12)
or 44.3 (15, V = 16), so the power is 1 to many decimals. The test computes it with the
noncentral chi-square and asserts both power > 0.999 and that the wrong sampler is in
fact rejected (p < 1e-4). The cases used here have TV 0.17 (draft probabilities) and
0.23 (one-hot drafts).

Every test runs against both implementations (the ``impl`` fixture): the torch verifiers
and their jax.numpy twins (:mod:`speculum.backends.jax.verifiers`, skipped when JAX is not
installed), with the same N, the same checks and so the same power.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from speculum.interfaces import Draft
from speculum.sampling import SamplingBatch, SamplingParams, make_generator, processed_probs
from speculum.verifiers import GreedyVerifier, RejectionSampler, greedy_verify, rejection_sample

try:
    import jax  # noqa: F401
except ImportError:  # the jax parameter is then skipped
    jax = None

ALPHA = 1e-4  # false-alarm rate of every goodness-of-fit check
N = 100_000  # rows (independent verification steps) per statistical test
K = 3  # draft positions
V = 12  # vocabulary


# -------------------------------------------------------------------- implementations
class Impl:
    """One implementation of the verifiers, with torch tensors in and out."""

    def __init__(self, name, rejection_sample, greedy_verify, RejectionSampler, GreedyVerifier, processed_probs):
        self.name = name
        self.rejection_sample = rejection_sample
        self.greedy_verify = greedy_verify
        self.RejectionSampler = RejectionSampler
        self.GreedyVerifier = GreedyVerifier
        self.processed_probs = processed_probs


@pytest.fixture(params=["torch", pytest.param("jax", marks=pytest.mark.skipif(jax is None, reason="JAX not installed"))])
def impl(request) -> Impl:
    if request.param == "torch":
        return Impl("torch", rejection_sample, greedy_verify, RejectionSampler, GreedyVerifier, processed_probs)
    from speculum.backends.jax import sampling as jsampling
    from speculum.backends.jax import verifiers as jv
    return Impl("jax", jv.rejection_sample, jv.greedy_verify, jv.JaxRejectionSampler, jv.JaxGreedyVerifier,
                jsampling.processed_probs_torch)


# ----------------------------------------------------------------------------- helpers
def _cells(samples: torch.Tensor, probs: torch.Tensor) -> tuple[np.ndarray, np.ndarray] | None:
    """Observed and expected counts over the support of ``probs`` (small cells pooled).

    Returns None when a sample falls outside the support (an impossible token).
    """
    samples = samples.flatten().long().cpu()
    probs = probs.double().cpu().flatten()
    assert samples.numel() > 0, "no samples to test"
    if samples.min() < 0 or samples.max() >= probs.numel():
        return None
    obs = torch.bincount(samples, minlength=probs.numel()).double()
    support = probs > 0
    if obs[~support].sum() > 0:
        return None
    n = obs.sum()
    exp = probs[support] / probs[support].sum() * n
    obs = obs[support]
    small = exp < 5
    if bool(small.any()):
        obs = torch.cat([obs[~small], obs[small].sum().view(1)])
        exp = torch.cat([exp[~small], exp[small].sum().view(1)])
    return obs.numpy(), exp.numpy()


def gof_stat(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """(chi-square statistic, degrees of freedom); (inf, 1) for an impossible token."""
    cells = _cells(samples, probs)
    if cells is None:
        return float("inf"), 1
    obs, exp = cells
    if len(obs) < 2:
        return 0.0, 0
    res = stats.chisquare(obs, exp)
    return float(res.statistic), len(obs) - 1


def gof_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of 'samples are i.i.d. from probs' (chi-square goodness of fit)."""
    cells = _cells(samples, probs)
    if cells is None:
        return 0.0
    obs, exp = cells
    if len(obs) < 2:
        return 1.0
    return float(stats.chisquare(obs, exp).pvalue)


def chisq_power(p: torch.Tensor, w: torch.Tensor, n: int) -> float:
    """Power of the level-ALPHA chi-square test of H0: p when samples really follow w."""
    p, w = p.double(), w.double()
    exp = p * n
    keep = exp >= 5  # the cells the test keeps unpooled (pooling only lowers df)
    lam = float((n * (w[keep] - p[keep]) ** 2 / p[keep]).sum())
    df = int(keep.sum()) - 1 + int(bool((~keep & (p > 0)).any()))
    crit = stats.chi2.isf(ALPHA, df)
    return float(stats.ncx2.sf(crit, df, lam))


def fixed_case(seed: int, v: int = V, k: int = K, scale: float = 1.5, draft_noise: float = 1.0):
    """Target logits [k+1, V] and draft logits [k, V], fixed by ``seed``.

    The draft logits are the target's plus Gaussian noise, like a real draft model: the
    acceptance rate is ~0.5-0.8, so enough rows reach the later positions.
    """
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(k + 1, v, generator=g) * scale
    return target, target[:k] + torch.randn(k, v, generator=g) * draft_noise


def draw_drafts(q: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """[n, k] draft tokens, column i drawn i.i.d. from q[i]."""
    return torch.stack([torch.multinomial(q[i], n, replacement=True, generator=gen)
                        for i in range(q.shape[0])], dim=1)


def check_structure(verdict, draft_ids: torch.Tensor) -> None:
    """Accepted drafts, then one target token, then -1 padding; never past the drafts."""
    B, k = draft_ids.shape
    toks, acc = verdict.token_ids, verdict.num_accepted
    assert toks.shape == (B, k + 1) and acc.shape == (B,)
    n_draft = (draft_ids >= 0).long().cumprod(dim=1).sum(dim=1)
    assert bool((acc >= 0).all()) and bool((acc <= n_draft).all())
    pos = torch.arange(k + 1).view(1, -1)
    padded = torch.cat([draft_ids, draft_ids.new_full((B, 1), -1)], dim=1)
    before = pos < acc.view(-1, 1)
    assert torch.equal(toks[before], padded[before]), "emitted tokens must start with the accepted drafts"
    assert bool((toks.gather(1, acc.view(-1, 1)) >= 0).all()), "one target token after the accepted drafts"
    assert bool((toks[pos > acc.view(-1, 1)] == -1).all()), "-1 padding after the target token"


def check_positions(verdict, p: torch.Tensor, positions: range | None = None) -> None:
    """Token at position i over the rows that reached it is distributed as p[i]."""
    for i in positions if positions is not None else range(p.shape[0]):
        rows = verdict.num_accepted >= i
        assert int(rows.sum()) > 1000, f"too few rows reach position {i} for a meaningful test"
        pval = gof_pvalue(verdict.token_ids[rows, i], p[i])
        assert pval > ALPHA, f"position {i}: emitted tokens are not distributed as p_{i} (p-value {pval:.2e})"


def check_acceptance(verdict, draft_ids: torch.Tensor, alpha: torch.Tensor) -> None:
    """P(accept draft i | position i reached and drafted) = alpha[i], within 5 SE."""
    acc = verdict.num_accepted
    for i in range(alpha.shape[0]):
        rows = (acc >= i) & (draft_ids[:, i] >= 0)
        n = int(rows.sum())
        rate = float((acc[rows] >= i + 1).double().mean())
        a = float(alpha[i])
        se = (a * (1 - a) / n) ** 0.5
        assert abs(rate - a) < 5 * se, f"position {i}: acceptance {rate:.4f}, expected {a:.4f} +- {se:.4f}"


def alpha_of(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Acceptance probability per position: sum_x min(p_i(x), q_i(x))."""
    return torch.minimum(p[: q.shape[0]].double(), q.double()).sum(-1)


def wrong_residual_dist(p0: torch.Tensor, q0: torch.Tensor) -> torch.Tensor:
    """Position-0 output of the sampler that redraws from p after a rejection."""
    p0, q0 = p0.double(), q0.double()
    m = torch.minimum(p0, q0)
    return m + (1 - m.sum()) * p0


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(0.5 * (a.double() - b.double()).abs().sum())


# ------------------------------------------------------- sampled: with draft probabilities
def test_rejection_sample_with_draft_probs_is_exact(impl):
    """Drafts x_i ~ q_i with q given, temperature 1: every position follows p_i."""
    tl, dl = fixed_case(1234)
    p, q = tl.softmax(-1), dl.softmax(-1)
    gen = torch.Generator().manual_seed(1)
    drafts = draw_drafts(q, N, gen)
    verdict = impl.rejection_sample(p.expand(N, -1, -1), q.expand(N, -1, -1), drafts, gen)
    check_structure(verdict, drafts)
    check_positions(verdict, p)  # positions 0..K, K being the bonus token
    check_acceptance(verdict, drafts, alpha_of(p, q))
    # and the first-position acceptance as stated: mean of accepted-at-0 = sum min(p0, q0)
    a0 = float(alpha_of(p, q)[0])
    rate0 = float((verdict.num_accepted >= 1).double().mean())
    assert abs(rate0 - a0) < 5 * (a0 * (1 - a0) / N) ** 0.5


def test_wrong_residual_is_detected_power(impl):
    """Power: the same check rejects resampling from p after a rejection.

    TV(wrong output, p) is computed analytically (>= 0.05 required); with N = 1e5 the
    power of the level-1e-4 chi-square test is > 0.999 (computed below, in fact ~1).
    """
    tl, dl = fixed_case(1234)
    p, q = tl.softmax(-1), dl.softmax(-1)
    w = wrong_residual_dist(p[0], q[0])
    assert tv(w, p[0]) >= 0.05, "pick p, q so that the wrong sampler differs substantially"
    assert chisq_power(p[0], w, N) > 0.999
    gen = torch.Generator().manual_seed(2)
    drafts = draw_drafts(q, N, gen)
    wrong = impl.rejection_sample(p.expand(N, -1, -1), q.expand(N, -1, -1), drafts, gen, residual="p")
    # its output really follows w (the analysis above is right) ...
    assert gof_pvalue(wrong.token_ids[:, 0], w) > ALPHA
    # ... and the test for p rejects it
    pval = gof_pvalue(wrong.token_ids[:, 0], p[0])
    assert pval < ALPHA, f"the wrong residual was not detected (p-value {pval:.2e})"


def test_padded_drafts_are_exact(impl):
    """Rows with fewer drafts (-1 padded): no draft means no residual, just p_i."""
    tl, dl = fixed_case(99)
    p, q = tl.softmax(-1), dl.softmax(-1)
    gen = torch.Generator().manual_seed(3)
    drafts = draw_drafts(q, N, gen)
    n_draft = torch.randint(0, K + 1, (N,), generator=gen)
    drafts = torch.where(torch.arange(K).view(1, -1) < n_draft.view(-1, 1), drafts, -1)
    verdict = impl.rejection_sample(p.expand(N, -1, -1), q.expand(N, -1, -1), drafts, gen)
    check_structure(verdict, drafts)
    check_positions(verdict, p)
    check_acceptance(verdict, drafts, alpha_of(p, q))
    no_draft = n_draft == 0
    assert bool((verdict.num_accepted[no_draft] == 0).all())
    pval = gof_pvalue(verdict.token_ids[no_draft, 0], p[0])
    assert pval > ALPHA, f"rows without drafts must sample p_0 (p-value {pval:.2e})"


# -------------------------------------------------- sampled: no draft probabilities (one-hot)
def test_one_hot_drafts_are_exact_and_wrong_residual_detected(impl):
    """probs=None: a deterministic draft d counts as q = one-hot(d).

    Drafts are fixed per position (draft argmax, as a greedy-drafting model would give).
    Acceptance is p_i(d_i); the residual is p_i without d_i. The wrong sampler (redraw
    from p) emits p(d) one-hot(d) + (1 - p(d)) p, at TV p(d)(1 - p(d)) from p.
    """
    tl, dl = fixed_case(555)
    p = tl.softmax(-1)
    d = dl.argmax(-1)  # [K]
    drafts = d.view(1, K).expand(N, K).contiguous()
    gen = torch.Generator().manual_seed(4)
    verdict = impl.rejection_sample(p.expand(N, -1, -1), None, drafts, gen)
    check_structure(verdict, drafts)
    check_positions(verdict, p)
    onehot = torch.nn.functional.one_hot(d, V).double()
    check_acceptance(verdict, drafts, alpha_of(p, onehot))
    # power for the one-hot case
    w = wrong_residual_dist(p[0], onehot[0])
    pd = float(p[0, d[0]])
    assert tv(w, p[0]) == pytest.approx(pd * (1 - pd))
    assert tv(w, p[0]) >= 0.05
    assert chisq_power(p[0], w, N) > 0.999
    wrong = impl.rejection_sample(p.expand(N, -1, -1), None, drafts, torch.Generator().manual_seed(5), residual="p")
    assert gof_pvalue(wrong.token_ids[:, 0], p[0]) < ALPHA


def test_one_hot_drafts_varying_per_row(impl):
    """probs=None with a different (deterministic) draft token per row.

    Conditional on its draft d, each row must emit p_0; the chi-square statistics of the
    V groups are summed (independent groups, df added) into one test at level 1e-4.
    """
    tl, _ = fixed_case(77)
    p = tl.softmax(-1)
    rows = torch.arange(N)
    drafts = torch.stack([(rows * 7 + i) % V for i in range(K)], dim=1)
    verdict = impl.rejection_sample(p.expand(N, -1, -1), None, drafts, torch.Generator().manual_seed(6))
    check_structure(verdict, drafts)
    total, df = 0.0, 0
    for tok in range(V):
        grp = drafts[:, 0] == tok
        s, f = gof_stat(verdict.token_ids[grp, 0], p[0])
        total, df = total + s, df + f
        # acceptance of draft tok is p_0(tok)
        a = float(p[0, tok])
        n = int(grp.sum())
        rate = float((verdict.num_accepted[grp] >= 1).double().mean())
        assert abs(rate - a) < 5 * (a * (1 - a) / n) ** 0.5 + 1e-12
    pval = float(stats.chi2.sf(total, df))
    assert pval > ALPHA, f"per-draft output distribution differs from p_0 (p-value {pval:.2e})"
    check_positions(verdict, p, range(2))  # acceptance ~1/V: few rows get further


# ------------------------------------------------------ through RejectionSampler.verify
def _reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Independent numpy reference of temperature, then top-k, then top-p (per row)."""
    z = logits.double().numpy() / temperature
    out = np.zeros_like(z)
    for r in range(z.shape[0]):
        order = np.argsort(-z[r])
        keep = order[:top_k] if top_k > 0 else order
        e = np.exp(z[r, keep] - z[r, keep].max())
        pr = e / e.sum()
        before = np.cumsum(pr) - pr
        n_keep = max(1, int((before < top_p).sum()))
        keep, pr = keep[:n_keep], pr[:n_keep]
        out[r, keep] = pr / pr.sum()
    return out


FILTERS = [
    pytest.param(1.0, 0, 1.0, id="t1"),
    pytest.param(0.7, 5, 1.0, id="t0.7-topk5"),
    pytest.param(1.0, 0, 0.8, id="t1-topp0.8"),
    pytest.param(1.3, 7, 0.85, id="t1.3-topk7-topp0.85"),
]


@pytest.mark.parametrize("temperature, top_k, top_p", FILTERS)
def test_processed_probs_matches_reference(impl, temperature, top_k, top_p):
    tl, _ = fixed_case(2024, v=16)
    B = tl.shape[0]
    got = impl.processed_probs(tl.unsqueeze(0), torch.tensor([temperature]), torch.tensor([top_k]),
                          torch.tensor([top_p]))[0]
    np.testing.assert_allclose(got.double().numpy(), _reference_probs(tl, temperature, top_k, top_p),
                               atol=1e-6)
    if top_k:
        assert bool(((got > 0).sum(-1) <= top_k).all())
    assert got.shape == (B, 16)


@pytest.mark.parametrize("temperature, top_k, top_p", FILTERS)
def test_verify_with_temperature_top_k_top_p_is_exact(impl, temperature, top_k, top_p):
    """The whole path: logits -> processed_probs (target) -> rejection sampling.

    The draft distribution is processed identically (as the engine does) and the drafts
    are sampled from it; output must follow the processed target distribution.
    """
    v = 16
    tl, dl = fixed_case(2024, v=v)
    temp = torch.full((N,), temperature)
    tk = torch.full((N,), top_k, dtype=torch.int64)
    tp = torch.full((N,), top_p)
    one = slice(0, 1)
    p = processed_probs(tl.unsqueeze(0), temp[one], tk[one], tp[one])[0]
    q = processed_probs(dl.unsqueeze(0), temp[one], tk[one], tp[one])[0]
    gen = torch.Generator().manual_seed(7)
    drafts = draw_drafts(q, N, gen)
    sampling = SamplingBatch.from_tensors(temp, tk, tp, gen)
    verdict = impl.RejectionSampler().verify(tl.expand(N, -1, -1), Draft(drafts, q.expand(N, -1, -1)), sampling)
    check_structure(verdict, drafts)
    check_positions(verdict, p)
    check_acceptance(verdict, drafts, alpha_of(p, q))


# ---------------------------------------------------------------------------- greedy
def _greedy_logits() -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [1, 4, 6] whose argmax per position is [2, 5, 0, 3]."""
    am = torch.tensor([2, 5, 0, 3])
    logits = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(4), am] = 10.0
    return logits.unsqueeze(0), am


def test_greedy_verify_longest_matching_prefix_and_padding(impl):
    logits, am = _greedy_logits()
    drafts = torch.tensor([
        [2, 5, 0],    # all match -> 3 accepted + bonus argmax
        [2, 1, 0],    # mismatch at 1
        [4, 5, 0],    # mismatch at 0
        [2, -1, -1],  # one draft, matched -> bonus at position 1
        [2, -1, 0],   # padding ends the draft even if later tokens match
        [-1, -1, -1],  # no draft
        [2, 5, 1],    # mismatch at the last draft
    ])
    B = drafts.shape[0]
    v = impl.greedy_verify(logits.expand(B, -1, -1), drafts)
    assert v.num_accepted.tolist() == [3, 1, 0, 1, 1, 0, 2]
    assert v.token_ids.tolist() == [
        [2, 5, 0, 3],
        [2, 5, -1, -1],
        [2, -1, -1, -1],
        [2, 5, -1, -1],
        [2, 5, -1, -1],
        [2, -1, -1, -1],
        [2, 5, 0, -1],
    ]
    check_structure(v, drafts)
    # ids past the vocabulary or below -1 (a device draft a plain greedy step leaves unchecked)
    # never match an argmax: the same verdict as -1 there
    odd = torch.tensor([[2, 10**6, 0], [2, 5, -7]])
    vo = impl.greedy_verify(logits.expand(2, -1, -1), odd)
    assert vo.num_accepted.tolist() == [1, 2] and vo.token_ids.tolist() == [[2, 5, -1, -1], [2, 5, 0, -1]]
    # no drafts at all (k = 0): the argmax only
    v0 = impl.greedy_verify(logits[:, :1].expand(2, -1, -1), torch.empty(2, 0, dtype=torch.int64))
    assert v0.token_ids.tolist() == [[2], [2]] and v0.num_accepted.tolist() == [0, 0]


def test_greedy_verifier_and_all_greedy_rejection_sampler(impl):
    logits, _ = _greedy_logits()
    drafts = torch.tensor([[2, 5, 0], [2, 1, 0], [-1, -1, -1]])
    B = drafts.shape[0]
    tl = logits.expand(B, -1, -1)
    ref = greedy_verify(tl, drafts)
    greedy = SamplingBatch.from_params([SamplingParams(temperature=0)] * B, [None] * B)
    for verifier in (impl.GreedyVerifier(), impl.RejectionSampler()):
        for probs in (None, torch.full((B, 3, 6), 1 / 6)):
            v = verifier.verify(tl, Draft(drafts, probs), greedy)
            assert torch.equal(v.token_ids, ref.token_ids) and torch.equal(v.num_accepted, ref.num_accepted)
    sampled = SamplingBatch.from_params([SamplingParams(temperature=1.0)] * B, [make_generator(0)] * B)
    with pytest.raises(ValueError, match="temperature 0"):
        impl.GreedyVerifier().verify(tl, Draft(drafts), sampled)


def test_mixed_greedy_and_sampled_rows(impl):
    """One verify call, half the rows greedy: those equal greedy_verify exactly, the
    sampled rows still follow p."""
    tl, dl = fixed_case(555)
    p, q = tl.softmax(-1), dl.softmax(-1)
    gen = torch.Generator().manual_seed(8)
    drafts = draw_drafts(q, N, gen)
    greedy_rows = torch.arange(N) % 2 == 0
    # greedy rows: the target argmax, each position corrupted with probability 1/2
    am = tl.argmax(-1)[:K].expand(N, K)
    corrupt = torch.rand(N, K, generator=gen) < 0.5
    noise = torch.randint(0, V, (N, K), generator=gen)
    greedy_drafts = torch.where(corrupt, noise, am)
    greedy_drafts[torch.arange(N) % 10 == 0, 2] = -1  # some padded rows too
    drafts = torch.where(greedy_rows.view(-1, 1), greedy_drafts, drafts)
    sampling = SamplingBatch.from_tensors(
        torch.where(greedy_rows, 0.0, 1.0), torch.zeros(N, dtype=torch.int64), torch.ones(N), gen)
    q_rows = q.expand(N, -1, -1)
    verdict = impl.RejectionSampler().verify(tl.expand(N, -1, -1), Draft(drafts, q_rows), sampling)
    check_structure(verdict, drafts)
    g = greedy_verify(tl.expand(N, -1, -1)[greedy_rows], drafts[greedy_rows])
    assert torch.equal(verdict.token_ids[greedy_rows], g.token_ids)
    assert torch.equal(verdict.num_accepted[greedy_rows], g.num_accepted)
    assert 0 < int(g.num_accepted.sum()) < 3 * int(greedy_rows.sum())  # both outcomes occur
    s = ~greedy_rows
    sub = type(verdict)(token_ids=verdict.token_ids[s], num_accepted=verdict.num_accepted[s])
    check_positions(sub, p)
    check_acceptance(sub, drafts[s], alpha_of(p, q))


# ---------------------------------------------------------------------------- determinism
def test_same_seed_same_output(impl):
    tl, dl = fixed_case(31)
    p, q = tl.softmax(-1), dl.softmax(-1)
    n = 5000
    drafts = draw_drafts(q, n, torch.Generator().manual_seed(0))
    P, Q = p.expand(n, -1, -1), q.expand(n, -1, -1)

    def run(seed):
        return impl.rejection_sample(P, Q, drafts, torch.Generator().manual_seed(seed))

    a, b, c = run(11), run(11), run(12)
    assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.num_accepted, b.num_accepted)
    assert not torch.equal(a.token_ids, c.token_ids)


def test_per_row_generators_reproducible_and_batch_independent(impl):
    """Per-request generators: a row's outcome depends on its own seed only, not on the
    other rows of the batch (so seeded requests reproduce under any batching)."""
    tl, dl = fixed_case(32)
    B = 6
    seeds = [101, 102, 103, 104, 105, 106]
    temps = [1.0, 0.7, 1.0, 1.3, 0.9, 1.0]
    params = [SamplingParams(temperature=t, top_k=tk, top_p=tp, seed=s)
              for t, tk, tp, s in zip(temps, [0, 5, 0, 0, 7, 0], [1.0, 1.0, 0.8, 1.0, 0.9, 1.0], seeds)]
    sb = SamplingBatch.from_params(params, [make_generator(s) for s in seeds])
    q = processed_probs(dl.unsqueeze(0).expand(B, -1, -1), sb.temperature, sb.top_k, sb.top_p)
    drafts = torch.stack([draw_drafts(q[b], 1, torch.Generator().manual_seed(b))[0] for b in range(B)])
    drafts[1, 2] = -1
    tlB = tl.unsqueeze(0).expand(B, -1, -1)

    def batch():
        sb = SamplingBatch.from_params(params, [make_generator(s) for s in seeds])
        return impl.RejectionSampler().verify(tlB, Draft(drafts, q), sb)

    full, again = batch(), batch()
    assert torch.equal(full.token_ids, again.token_ids) and torch.equal(full.num_accepted, again.num_accepted)
    for b in range(B):
        one = SamplingBatch.from_params([params[b]], [make_generator(seeds[b])])
        v = impl.RejectionSampler().verify(tlB[b:b + 1], Draft(drafts[b:b + 1], q[b:b + 1]), one)
        assert torch.equal(v.token_ids[0], full.token_ids[b]) and int(v.num_accepted[0]) == int(full.num_accepted[b])
