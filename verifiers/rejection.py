"""Lossless rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

Notation of the papers: ``p`` is the target distribution, ``q`` the draft distribution.
Draft token ``x_i ~ q_i`` is accepted with probability ``min(1, p_i(x) / q_i(x))``; on the
first rejection the output is drawn from the residual ``norm(max(0, p_i - q_i))``; when
every draft is accepted a bonus token is drawn from ``p_k``. The output then has exactly
the distribution ``p``. With no draft probabilities the draft is one-hot (q(x) = 1).
"""

from __future__ import annotations

import torch

from speculum.interfaces import Draft, Verdict
from speculum.sampling import SamplingBatch
from speculum.verifiers.noise import Generators, RowNoise, as_noise, race
from speculum.verifiers.sampled import verify_sampled


def rejection_sample(p: torch.Tensor, q: torch.Tensor | None, draft_ids: torch.Tensor,
                     generators: Generators | RowNoise, residual: str = "max(0,p-q)") -> Verdict:
    """One verification step in the papers' notation, vectorised over the batch.

    ``p``: [B, k+1, V] target probabilities; ``q``: [B, k, V] draft probabilities or None
    (one-hot drafts); ``draft_ids``: [B, k], -1 padded. ``generators``: one per row (their
    own random streams), a single generator for all rows, or a :class:`RowNoise`; the
    ``k`` acceptance uniforms are drawn before the ``V`` exponentials of the emitted token
    (``speculum.verifiers.noise`` says why the two are independent). ``residual`` exists
    so tests can show that a wrong residual (``"p"``) is caught; production code never
    sets it.
    """
    noise = as_noise(generators)
    B, k1, V = p.shape
    k = k1 - 1
    device = p.device
    pos = torch.arange(k1, device=device).view(1, k1)
    if k > 0:
        valid = (draft_ids >= 0).to(torch.int64).cumprod(dim=1)  # [B, k]
        n_draft = valid.sum(dim=1)
        ids = draft_ids.clamp_min(0)
        # [B, k] p_i(x_i) and q_i(x_i)
        p_x = p[:, :k].gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        q_x = q.gather(-1, ids.unsqueeze(-1)).squeeze(-1) if q is not None else torch.ones_like(p_x)
        u = noise.uniforms(B, k, device)  # [B, k]
        accept = (u * q_x < p_x) & valid.bool()  # u < p/q without dividing by zero
        num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
    else:
        n_draft = torch.zeros(B, dtype=torch.int64, device=device)
        num_accepted = n_draft.clone()
    # [B, V] target distribution at the first non-accepted position
    p_i = p.gather(1, num_accepted.view(B, 1, 1).expand(B, 1, V)).squeeze(1)
    rejected = num_accepted < n_draft
    dist = p_i
    if k > 0 and residual != "p":  # computed for every row: branching would cost a sync
        at = num_accepted.clamp_max(k - 1)
        if q is not None:
            q_i = q.gather(1, at.view(B, 1, 1).expand(B, 1, V)).squeeze(1)
        else:
            q_i = torch.zeros_like(p_i).scatter_(-1, ids.gather(1, at.view(B, 1)), 1.0)
        res = (p_i - q_i).clamp_min(0)
        # p == q exactly makes rejection impossible; guard the empty residual anyway
        res = torch.where(res.sum(-1, keepdim=True) > 0, res, p_i)
        dist = torch.where(rejected.view(B, 1), res, p_i)
    # exponential race: argmax(dist / E), E ~ Exp(1), samples from dist (unnormalised ok)
    last = race(dist, noise.exponentials(B, V, device))
    if k > 0:
        drafted = torch.cat([draft_ids, draft_ids.new_full((B, 1), -1)], dim=1)
    else:
        drafted = torch.full((B, 1), -1, dtype=torch.int64, device=device)
    tokens = torch.where(pos < num_accepted.view(B, 1), drafted, torch.full_like(drafted, -1))
    tokens = torch.where(pos == num_accepted.view(B, 1), last.view(B, 1), tokens)
    return Verdict(token_ids=tokens, num_accepted=num_accepted)


class RejectionSampler:
    """Verifies sampled and greedy requests losslessly.

    Temperature, top-k and top-p are applied identically to target and draft logits
    (drafts arrive already processed as ``draft.probs``). Greedy rows use exact argmax.
    Tree drafts go to :func:`speculum.verifiers.tree.verify_tree`.
    """

    lossless = True
    supports_trees = True
    #: takes the runner's argmax of the logits for greedy rows (``verify(..., argmax=)``)
    takes_argmax = True

    def verify(self, target_logits: torch.Tensor, draft: Draft, sampling: SamplingBatch,
               argmax: torch.Tensor | None = None) -> Verdict:
        if draft.tree is not None:
            from speculum.verifiers.tree import verify_tree
            return verify_tree(target_logits, draft, sampling, argmax)
        return verify_sampled(rejection_sample, target_logits, draft, sampling, argmax)
