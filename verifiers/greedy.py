"""Greedy verification: accept a draft token exactly when it is the target's argmax."""

from __future__ import annotations

import torch

from speculum.interfaces import Draft, Verdict
from speculum.sampling import SamplingBatch


def greedy_verify(target_logits: torch.Tensor, draft_ids: torch.Tensor) -> Verdict:
    """Accept the longest prefix of ``draft_ids`` that matches the target argmax.

    ``target_logits``: [B, k+1, V]; ``draft_ids``: [B, k] (-1 padded). The emitted run is
    the accepted drafts followed by the target's argmax at the first mismatch (or the
    bonus position when every draft matched).
    """
    B, k1, _ = target_logits.shape
    k = k1 - 1
    # [B, k+1]
    argmax = target_logits.argmax(dim=-1)
    if k == 0:
        return Verdict(token_ids=argmax, num_accepted=torch.zeros(B, dtype=torch.int64, device=argmax.device))
    # [B, k] True while the draft matches (padding never matches: argmax >= 0)
    match = draft_ids == argmax[:, :k]
    num_accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)
    pos = torch.arange(k1, device=argmax.device).view(1, k1)
    # accepted drafts equal argmax there, so the emitted run is argmax up to num_accepted
    tokens = torch.where(pos <= num_accepted.view(B, 1), argmax, torch.full_like(argmax, -1))
    return Verdict(token_ids=tokens, num_accepted=num_accepted)


class GreedyVerifier:
    """Exact argmax matching. Lossless for temperature 0; refuses sampled requests."""

    lossless = True

    def verify(self, target_logits: torch.Tensor, draft: Draft, sampling: SamplingBatch) -> Verdict:
        if not sampling.all_greedy:
            raise ValueError(
                "the greedy verifier only serves temperature 0 requests; use "
                "acceptance_method='rejection_sampler' for sampled requests"
            )
        return greedy_verify(target_logits, draft.token_ids)
