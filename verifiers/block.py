"""Block verification (Sun, Mendlovic, Leviathan, Aharoni, Ro, Beirami, Suresh, ICLR 2025).

Notation of the paper: ``p`` is the target distribution, ``q`` the draft distribution,
``X_1 .. X_n`` the draft block (``n <= k``), ``p_i = p(. | X_1..X_{i-1})``. Token-wise
rejection sampling accepts each draft on its own; block verification accepts the block
jointly and is optimal among lossless verifiers in expected accepted tokens (never
worse than token-wise in expectation; for a given block it may accept fewer or more).

For ``i = 0 .. n`` a weight (the paper's ``p_i``, here ``w_i`` to keep ``p`` for the
target)::

    w_0 = 1,    w_i = min(1, w_{i-1} * p_i(X_i) / q_i(X_i))

the residual after ``i`` accepted tokens and the probability ``h_i`` of stopping there::

    res_i = max(0, w_i * p_{i+1} - q_{i+1})                  (i < n)
    h_i   = sum(res_i) / (sum(res_i) + 1 - w_i)   (0 < i < n;  0/0 := 1)
    h_0   = 1,   h_n = w_n

With ``eta_1 .. eta_n ~ U[0, 1)``, the number accepted is ``tau = max{i : eta_i < h_i}``
(0 when none): the scan goes backwards from the whole block. Then ``X_1..X_tau`` are
emitted, followed by one token ``Y ~ norm(res_tau)`` if ``tau < n``, or ``Y ~ p_{n+1}``
(the bonus) if the whole block was accepted. For ``n = 1`` this is token-wise rejection
sampling. The weights need no loop: ``log w_i = S_i - max_{j <= i} S_j`` with
``S_i = sum_{j <= i} log(p_j(X_j) / q_j(X_j))`` and ``S_0 = 0`` (a Lindley recursion).

One-hot drafts (no ``q``) gain nothing from the block rule: any lossless verifier
accepts ``X_1..X_i`` with probability at most ``prod p_j(X_j)``, which token-wise
already reaches, so :class:`BlockVerifier` hands them to the rejection sampler.

Trees (later): the weights and stop probabilities are quantities of one root-to-leaf
path; a tree variant computes them per path (``[B, paths, depth]``) from the same
formulas, which is why they live in :func:`block_weights`, apart from the sampling.
"""

from __future__ import annotations

import logging

import attrs
import torch

from speculum.interfaces import Draft, Verdict
from speculum.sampling import SamplingBatch
from speculum.verifiers.noise import Generators, RowNoise, as_noise, race
from speculum.verifiers.rejection import rejection_sample
from speculum.verifiers.sampled import verify_sampled

log = logging.getLogger(__name__)

#: largest log-ratio kept: min(1, .) saturates long before, and inf - inf would be NaN
_MAX_LOG_RATIO = 80.0


@attrs.define(eq=False)
class BlockWeights:
    """The per-position quantities of block verification for a batch of draft blocks."""

    # [B, k+1] w_0..w_k (w_i meaningful for i <= n)
    w: torch.Tensor
    # [B, k+1] h_0..h_k: probability of stopping at i in the backward scan (0 past n)
    h: torch.Tensor
    # [B] n: leading valid drafts per row
    n: torch.Tensor


def block_weights(p: torch.Tensor, q: torch.Tensor, draft_ids: torch.Tensor,
                  residual: str = "weighted") -> BlockWeights:
    """Weights, stop probabilities and residuals of block verification (see module doc).

    ``p``: [B, k+1, V] target probabilities; ``q``: [B, k, V] draft probabilities;
    ``draft_ids``: [B, k], -1 padded. ``residual="token"`` is a deliberately wrong variant
    for tests (token-wise residuals ``max(0, p - q)`` inside the block rule).
    """
    B, k1, V = p.shape
    k = k1 - 1
    device = p.device
    valid = (draft_ids >= 0).to(torch.int64).cumprod(dim=1)  # [B, k]
    n = valid.sum(dim=1)  # [B]
    ids = draft_ids.clamp_min(0).unsqueeze(-1)
    p_x = p[:, :k].gather(-1, ids).squeeze(-1)  # [B, k] p_i(X_i)
    q_x = q.gather(-1, ids).squeeze(-1)  # [B, k] q_i(X_i)
    log_r = (p_x.log() - q_x.log()).clamp_max(_MAX_LOG_RATIO)
    log_r = torch.where(p_x > 0, log_r, torch.full_like(log_r, -torch.inf))  # 0/0 is a rejection
    log_r = torch.where(valid.bool(), log_r, torch.zeros_like(log_r))  # padding: no NaN
    S = torch.cat([torch.zeros(B, 1, device=device), log_r.cumsum(dim=1)], dim=1)  # [B, k+1]
    w = (S - S.cummax(dim=1).values).exp()  # [B, k+1]
    scale = w[:, :k] if residual == "weighted" else torch.ones_like(w[:, :k])
    R = (scale.unsqueeze(-1) * p[:, :k] - q).clamp_min(0).sum(dim=-1)  # [B, k]: sum_x res_i(x)
    den = R + 1 - w[:, :k]
    h_mid = torch.where(den > 0, R / den.clamp_min(1e-30), torch.ones_like(R))  # [B, k]: h_0..h_{k-1}
    pos = torch.arange(k1, device=device).view(1, k1)
    h_all = torch.cat([h_mid, torch.zeros(B, 1, device=device)], dim=1)
    h = torch.where(pos < n.view(B, 1), h_all, torch.where(pos == n.view(B, 1), w, torch.zeros_like(w)))
    return BlockWeights(w=w, h=h, n=n)


def block_verify(p: torch.Tensor, q: torch.Tensor, draft_ids: torch.Tensor,
                 generators: Generators | RowNoise, residual: str = "weighted") -> Verdict:
    """One block-verification step in the paper's notation, vectorised over the batch.

    ``p``: [B, k+1, V] target probabilities; ``q``: [B, k, V] draft probabilities (not
    None: one-hot drafts go to :func:`rejection_sample`); ``draft_ids``: [B, k], -1
    padded. Noise: ``k`` uniforms (``eta_1..eta_k``), then ``V`` exponentials for ``Y``,
    per row. ``residual="token"`` is the deliberately wrong variant of the tests.
    """
    if q is None:
        raise ValueError("block_verify needs the draft probabilities q; one-hot drafts (q=None) are "
                         "verified token-wise: use rejection_sample")
    noise = as_noise(generators)
    B, k1, V = p.shape
    k = k1 - 1
    device = p.device
    pos = torch.arange(k1, device=device).view(1, k1)
    if k == 0:
        return rejection_sample(p, None, draft_ids, noise)
    bw = block_weights(p, q, draft_ids, residual)
    eta = noise.uniforms(B, k, device)  # [B, k]: eta_1..eta_k
    stop = eta < bw.h[:, 1:]  # [B, k]
    tau = (stop.to(torch.int64) * pos[:, 1:]).amax(dim=1)  # [B] largest i with eta_i < h_i, else 0
    p_tau = p.gather(1, tau.view(B, 1, 1).expand(B, 1, V)).squeeze(1)  # [B, V]
    # res_tau = max(0, w_tau p_{tau+1} - q_{tau+1}), built for the stop position only
    at = tau.clamp_max(k - 1)
    q_tau = q.gather(1, at.view(B, 1, 1).expand(B, 1, V)).squeeze(1)  # [B, V]
    w_tau = bw.w.gather(1, at.view(B, 1)) if residual == "weighted" else torch.ones(B, 1, device=device)
    res_tau = (w_tau * p_tau - q_tau).clamp_min(0)
    res_tau = torch.where(res_tau.sum(-1, keepdim=True) > 0, res_tau, p_tau)  # 0/0 guard (see h)
    dist = torch.where((tau < bw.n).view(B, 1), res_tau, p_tau)
    last = race(dist, noise.exponentials(B, V, device))
    drafted = torch.cat([draft_ids, draft_ids.new_full((B, 1), -1)], dim=1)
    tokens = torch.where(pos < tau.view(B, 1), drafted, torch.full_like(drafted, -1))
    tokens = torch.where(pos == tau.view(B, 1), last.view(B, 1), tokens)
    return Verdict(token_ids=tokens, num_accepted=tau)


class BlockVerifier:
    """Lossless block verification for drafts with probabilities (``acceptance_method: "block"``).

    Drafts without probabilities (n-gram, greedy drafting) are verified token-wise by the
    rejection sampler, which is already optimal for them; the first such step logs it.
    Greedy rows use exact argmax matching.
    """

    lossless = True
    #: token trees: not yet (the weights are per path; see the module doc)
    supports_trees = False

    def __init__(self) -> None:
        self._told_one_hot = False

    def verify(self, target_logits: torch.Tensor, draft: Draft, sampling: SamplingBatch) -> Verdict:
        if draft.probs is None:
            if not self._told_one_hot and not sampling.all_greedy:
                log.info("block verification: drafts without probabilities (one-hot) are verified token-wise; "
                         "the block rule accepts no more for them")
                self._told_one_hot = True
            return verify_sampled(rejection_sample, target_logits, draft, sampling)
        return verify_sampled(block_verify, target_logits, draft, sampling)
