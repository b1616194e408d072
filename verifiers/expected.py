"""Expected accepted drafts given the drafts, per rule: paired comparisons of verifiers.

For one step (``p``, ``q`` and the drafts fixed) each rule accepts a random number of
drafts; its conditional expectation removes the verifier's own noise, so evaluating both
rules on the very drafts one run produced compares them with far less variance than two
runs (``speculum bench verifiers`` does this). Averaged over drafts ``X ~ q`` it is the
rule's expected accepted count; block verification is never below token-wise there, while
for one given block either may be higher.
"""

from __future__ import annotations

import torch

from speculum.verifiers.block import block_weights


def _draft_probs(p: torch.Tensor, q: torch.Tensor | None, draft_ids: torch.Tensor):
    k = draft_ids.shape[1]
    valid = (draft_ids >= 0).to(p.dtype).cumprod(dim=1)  # [B, k]
    ids = draft_ids.clamp_min(0).unsqueeze(-1)
    p_x = p[:, :k].gather(-1, ids).squeeze(-1)
    q_x = q.gather(-1, ids).squeeze(-1) if q is not None else torch.ones_like(p_x)
    return valid, p_x, q_x


def expected_accepted_tokenwise(p: torch.Tensor, q: torch.Tensor | None, draft_ids: torch.Tensor) -> torch.Tensor:
    """[B] E[accepted | drafts] of token-wise rejection: ``sum_i prod_{j<=i} min(1, p_j(X_j)/q_j(X_j))``.

    ``p``: [B, k+1, V]; ``q``: [B, k, V] or None (one-hot drafts); ``draft_ids``: [B, k].
    """
    if draft_ids.shape[1] == 0:
        return torch.zeros(p.shape[0], device=p.device)
    valid, p_x, q_x = _draft_probs(p, q, draft_ids)
    ratio = torch.where(q_x > 0, p_x / q_x.clamp_min(1e-30), torch.ones_like(p_x)).clamp_max(1.0)
    return (ratio.cumprod(dim=1) * valid).sum(dim=1)


def expected_accepted_block(p: torch.Tensor, q: torch.Tensor | None, draft_ids: torch.Tensor) -> torch.Tensor:
    """[B] E[accepted | drafts] of block verification: ``sum_j j h_j prod_{i>j} (1 - h_i)``.

    With ``q`` None (one-hot drafts) the block verifier runs token-wise, and so does this.
    """
    if q is None or draft_ids.shape[1] == 0:
        return expected_accepted_tokenwise(p, q, draft_ids)
    h = block_weights(p, q, draft_ids).h  # [B, k+1]
    # P(tau = j) = h_j prod_{i > j} (1 - h_i): survival from the end of the block
    keep = torch.flip(torch.cumprod(torch.flip(1 - h, [1]), dim=1), [1])  # [B, k+1]: prod_{i >= j}
    after = torch.cat([keep[:, 1:], torch.ones_like(keep[:, :1])], dim=1)  # prod_{i > j}
    j = torch.arange(h.shape[1], device=h.device, dtype=h.dtype)
    return (j * h * after).sum(dim=1)
