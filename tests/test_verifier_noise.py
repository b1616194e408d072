"""The token a verifier samples is independent of the noise that decided acceptance.

Three random quantities meet in a step: the draft's sampling noise (a proposer samples
drafts from the request's generator), the acceptance uniforms, and the noise of the token
the verifier emits (the replacement after a rejection, or the bonus). Lossless
verification needs the third independent of the first two: given the outcome (how many
drafts were accepted), the emitted token must follow its law (the residual, or ``p``)
whatever the uniforms and the drafts were. ``speculum.verifiers.noise`` argues why the
consecutive draws of one generator are independent; these tests check it on the
rejection sampler and on block verification, and show that the same tests catch the two
ways it goes wrong:

* a shared offset: the emitted token's exponentials made from the acceptance uniforms
  (``e_j = -log(1 - u_j)`` for the first ``k`` tokens), what one Philox offset read by
  both consumers amounts to;
* vLLM's draft-noise reuse: the replacement drawn with the very exponentials that drew
  the rejected draft.

Statistics, each at level ``ALPHA = 1e-4``:

* independence (Pearson's chi-square on a contingency table, ``chi2_contingency``;
  rows and columns under 100 counts dropped): rows rejected at the first draft,
  (quartile of ``u_0``) x (replacement token) and (draft token ``x_0``) x (replacement);
  rows that accepted every draft, (quartile of ``u_{k-1}``) x (bonus token);
* goodness of fit: replacements after a first-draft rejection against the residual
  ``norm(max(0, p_0 - q_0))``. Draft-noise reuse does not make the replacement depend
  on ``x_0`` much (the draft's winning noise is small; the others are shifted by a common
  amount), but it moves the replacement's law away from the residual (TV 0.02 here),
  which this test sees.

The correct verifiers run with a generator per row, as requests have (``N = 40 000``;
seed 11: seed 1 happens to give p = 1e-5 on one table, one ~750-row cell 4 standard
errors off, shared by both rules; 20 other seeds give uniform p-values).

Power, estimated by plug-in: the wrong variant run with ``2 n`` rows gives the statistic
``X`` of its check; ``(X - df) / 2`` estimates the noncentrality at ``n`` rows, and the
power of the level-1e-4 test there, from the noncentral chi-square, must be > 0.999
(estimated noncentralities: shared offset 1900-5000 at n = 40 000; draft-noise reuse
~280 at n = 160 000, df 2: power 1 to many decimals). The test then runs the wrong
variant at ``n`` rows and requires p < 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from speculum.verifiers import RowNoise, block_verify, race, rejection_sample

ALPHA = 1e-4
N = 40_000
K = 3
V = 6
RULES = {"rejection": rejection_sample, "block": block_verify}


def case() -> tuple[torch.Tensor, torch.Tensor]:
    """p [K+1, V] and q [K, V]: acceptance ~0.6 per draft, residuals spread over tokens."""
    g = torch.Generator().manual_seed(2025)
    tl = torch.randn(K + 1, V, generator=g) * 1.2
    return tl.softmax(-1), (tl[:K] + torch.randn(K, V, generator=g)).softmax(-1)


class SharedOffsetNoise(RowNoise):
    """Wrong: the first k exponentials are made from the acceptance uniforms."""

    def uniforms(self, B, n, device):
        self.u = super().uniforms(B, n, device)
        return self.u

    def exponentials(self, B, n, device):
        e = super().exponentials(B, n, device)
        e[:, : self.u.shape[1]] = -torch.log1p(-self.u)
        return e


class DraftNoiseReused(RowNoise):
    """Wrong (vLLM's bug): the replacement reuses the noise that drew the first draft."""

    def __init__(self, generators, draft_noise):
        super().__init__(generators)
        self.draft_noise = draft_noise

    def exponentials(self, B, n, device):
        super().exponentials(B, n, device)
        return self.draft_noise


def run(rule: str, n: int, seed: int, wrong: str | None = None, per_row: bool = True):
    """n steps; drafts drawn from q with the rows' generators, as a proposer does.

    ``per_row``: a generator per row (as requests have) or one for the batch (faster; the
    wrong variants do not depend on it). Returns (u [n, K] the acceptance uniforms,
    drafts [n, K], verdict).
    """
    p, q = case()
    if per_row:
        gens = [torch.Generator().manual_seed(seed * 10_000_019 + i) for i in range(n)]
    else:
        gens = torch.Generator().manual_seed(seed)
    noise = RowNoise(gens)
    e_draft = [noise.exponentials(n, V, "cpu") for _ in range(K)]  # the proposer's draws
    drafts = torch.stack([race(q[i].expand(n, V), e_draft[i]) for i in range(K)], dim=1)
    copies = [torch.Generator() for _ in gens] if per_row else torch.Generator()
    for c, g in zip(copies, gens) if per_row else [(copies, gens)]:
        c.set_state(g.get_state())
    u = RowNoise(copies).uniforms(n, K, "cpu")  # what the verifier will draw first
    if wrong == "shared_offset":
        noise = SharedOffsetNoise(gens)
    elif wrong == "draft_noise":
        noise = DraftNoiseReused(gens, e_draft[0])
    verdict = RULES[rule](p.expand(n, -1, -1), q.expand(n, -1, -1), drafts, noise)
    return u, drafts, verdict


def tables(u, drafts, verdict) -> dict[str, np.ndarray]:
    """The contingency tables (rows and columns with fewer than 100 counts dropped, so
    every expected count is >= 5)."""
    acc, toks = verdict.num_accepted, verdict.token_ids
    rej0 = acc == 0
    full = acc == K
    quart = torch.tensor([0.25, 0.5, 0.75])

    def table(a: torch.Tensor, b: torch.Tensor, na: int) -> np.ndarray:
        t = np.zeros((na, V))
        np.add.at(t, (a.numpy(), b.numpy()), 1)
        t = t[t.sum(1) >= 100]
        return t[:, t.sum(0) >= 100]

    def qbin(x):  # quartile bins of x among the rows used
        return torch.bucketize(x.contiguous(), torch.quantile(x, quart))

    return {
        "u0 x replacement": table(qbin(u[rej0, 0]), toks[rej0, 0], 4),
        "u_last x bonus": table(qbin(u[full, K - 1]), toks[full, K], 4),
        "draft x replacement": table(drafts[rej0, 0], toks[rej0, 0], V),
    }


def independence(t: np.ndarray) -> tuple[float, float, int]:
    """(p-value, statistic, degrees of freedom) of the chi-square independence test."""
    res = stats.chi2_contingency(t, correction=False)
    return float(res.pvalue), float(res.statistic), int(res.dof)


def replacement_fit(verdict) -> tuple[float, float, int]:
    """(p-value, statistic, df): replacements after a first-draft rejection against the
    residual norm(max(0, p_0 - q_0)), the law they must have."""
    p, q = case()
    res = (p[0] - q[0]).clamp_min(0).double()
    y = verdict.token_ids[verdict.num_accepted == 0, 0]
    obs = torch.bincount(y, minlength=V).double()
    support = res > 0
    if float(obs[~support].sum()) > 0:
        return 0.0, float("inf"), 1
    r = stats.chisquare(obs[support].numpy(), (res[support] / res.sum() * obs.sum()).numpy())
    return float(r.pvalue), float(r.statistic), int(support.sum()) - 1


@pytest.mark.parametrize("rule", sorted(RULES))
def test_emitted_token_is_independent_of_acceptance_and_draft_noise(rule):
    u, drafts, verdict = run(rule, N, seed=11)
    acc = verdict.num_accepted
    assert int((acc == 0).sum()) > 5000 and int((acc == K).sum()) > 3000, "both outcomes need rows"
    for name, t in tables(u, drafts, verdict).items():
        assert t.shape[0] >= 2 and t.shape[1] >= 3, name
        pval, _, _ = independence(t)
        assert pval > ALPHA, f"{rule}: {name} are dependent (p = {pval:.2e})"
    pval, _, _ = replacement_fit(verdict)
    assert pval > ALPHA, f"{rule}: replacements do not follow the residual (p = {pval:.2e})"


WRONG = {  # variant -> (rows per test, the check that must catch it)
    "shared_offset": (N, lambda u, d, v: independence(tables(u, d, v)["u0 x replacement"])),
    "shared_offset_bonus": (N, lambda u, d, v: independence(tables(u, d, v)["u_last x bonus"])),
    "draft_noise": (4 * N, lambda u, d, v: replacement_fit(v)),
}


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("variant", sorted(WRONG))
def test_shared_noise_is_caught(rule, variant):
    n, check = WRONG[variant]
    wrong = variant.replace("_bonus", "")
    # plug-in power at n rows from a run with 2n rows: noncentrality ~ (X - df) / 2
    _, x, df = check(*run(rule, 2 * n, seed=2, wrong=wrong, per_row=False))
    power = float(stats.ncx2.sf(stats.chi2.isf(ALPHA, df), df, max(x - df, 0.0) / 2))
    assert power > 0.999, f"{rule}/{variant}: estimated power {power:.4f}"
    pval, _, _ = check(*run(rule, n, seed=3, wrong=wrong, per_row=False))
    assert pval < ALPHA, f"{rule}/{variant}: not caught (p = {pval:.2e})"


def test_rows_without_a_generator_share_one_draw_and_seeded_rows_keep_theirs():
    """Rows with a generator of their own draw from it alone (a seeded request's noise does not
    depend on the batch); rows without one draw together from the default generator, in row
    order, the same values as drawn one by one (CPU); nothing is drawn for n = 0."""
    from speculum.verifiers.noise import RowNoise
    V = 50

    def gen(seed):
        return torch.Generator().manual_seed(seed)

    torch.manual_seed(123)
    mixed = RowNoise([None, gen(1), None, None, gen(2)]).exponentials(5, V, "cpu")
    torch.manual_seed(123)
    alone = [torch.empty(V).exponential_() for _ in range(3)]
    assert torch.equal(mixed[0], alone[0]) and torch.equal(mixed[2], alone[1]) and torch.equal(mixed[3], alone[2])
    assert torch.equal(mixed[1], torch.empty(V).exponential_(generator=gen(1)).clamp_min(torch.finfo(torch.float32).tiny))
    assert torch.equal(mixed[4], torch.empty(V).exponential_(generator=gen(2)).clamp_min(torch.finfo(torch.float32).tiny))
    g = gen(3)
    assert RowNoise([g, None]).uniforms(2, 0, "cpu").shape == (2, 0)
    assert torch.equal(torch.empty(4).uniform_(generator=g), torch.empty(4).uniform_(generator=gen(3)))  # g unmoved
