"""Lossless rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

Notation of the papers: ``p`` is the target distribution, ``q`` the draft distribution.
Draft token ``x_i ~ q_i`` is accepted with probability ``min(1, p_i(x) / q_i(x))``; on the
first rejection the output is drawn from the residual ``norm(max(0, p_i - q_i))``; when
every draft is accepted a bonus token is drawn from ``p_k``. The output then has exactly
the distribution ``p``. With no draft probabilities the draft is one-hot (q(x) = 1).
"""

from __future__ import annotations

from typing import Sequence

import torch

from speculum.interfaces import Draft, Verdict
from speculum.sampling import SamplingBatch, processed_probs
from speculum.verifiers.greedy import greedy_verify

Generators = Sequence[torch.Generator | None] | torch.Generator | None


def _draw(shape_per_row: tuple[int, ...], B: int, generators: Generators, device, kind: str) -> torch.Tensor:
    """Uniforms or Exp(1) noise [B, *shape] where row b comes from its own generator."""
    def one(shape, gen):
        t = torch.empty(shape, device=device)
        return t.uniform_(generator=gen) if kind == "uniform" else t.exponential_(generator=gen)
    if generators is None or isinstance(generators, torch.Generator):
        return one((B, *shape_per_row), generators)
    return torch.stack([one(shape_per_row, g) for g in generators]) if B else torch.empty((0, *shape_per_row))


def rejection_sample(p: torch.Tensor, q: torch.Tensor | None, draft_ids: torch.Tensor,
                     generators: Generators, residual: str = "max(0,p-q)") -> Verdict:
    """One verification step in the papers' notation, vectorised over the batch.

    ``p``: [B, k+1, V] target probabilities; ``q``: [B, k, V] draft probabilities or None
    (one-hot drafts); ``draft_ids``: [B, k], -1 padded. ``generators``: one per row (their
    own random streams) or a single generator for all rows. ``residual`` exists so tests can
    show that a wrong residual (``"p"``) is caught; production code never sets it.
    """
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
        u = _draw((k,), B, generators, device, "uniform")
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
    e = _draw((V,), B, generators, device, "exponential")
    last = (dist / e).argmax(dim=-1)
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

    def verify(self, target_logits: torch.Tensor, draft: Draft, sampling: SamplingBatch) -> Verdict:
        if draft.tree is not None:
            from speculum.verifiers.tree import verify_tree
            return verify_tree(target_logits, draft, sampling)
        if sampling.all_greedy:
            return greedy_verify(target_logits, draft.token_ids)
        flags = sampling.flags(target_logits.shape[-1])
        p = processed_probs(target_logits, sampling.temperature, sampling.top_k, sampling.top_p, flags)
        ids = draft.token_ids.to(p.device)
        probs = draft.probs.to(p.device) if draft.probs is not None else None
        verdict = rejection_sample(p, probs, ids, sampling.generators)
        greedy_rows = sampling.temperature == 0
        if flags[2] if flags is not None else bool(greedy_rows.any()):
            g = greedy_verify(target_logits, ids)
            gr = greedy_rows.view(-1, 1)
            verdict.token_ids = torch.where(gr, g.token_ids.to(p.device), verdict.token_ids)
            verdict.num_accepted = torch.where(greedy_rows, g.num_accepted.to(p.device), verdict.num_accepted)
        return verdict
