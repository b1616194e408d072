"""Greedy verification: accept a draft token exactly when it is the target's argmax."""

from __future__ import annotations

import torch

from speculum.interfaces import Draft, Verdict
from speculum.sampling import SamplingBatch


def greedy_verify(target_logits: torch.Tensor, draft_ids: torch.Tensor) -> Verdict:
    """Accept the longest prefix of ``draft_ids`` that matches the target argmax.

    ``target_logits``: [B, k+1, V]; ``draft_ids``: [B, k] (-1 padded), on any device. The
    emitted run is the accepted drafts followed by the target's argmax at the first
    mismatch (or the bonus position when every draft matched).

    Only the argmax leaves the device (one synchronisation); the prefix match runs on
    the host, and the Verdict comes back as CPU tensors. With no drafts (``k = 0``)
    there is nothing to match: the argmax stays where it is, unsynchronised, so an
    overlapped step can start the next forward on it.
    """
    B, k1, _ = target_logits.shape
    k = k1 - 1
    # [B, k+1]
    argmax = target_logits.argmax(dim=-1)
    if k == 0:
        return Verdict(token_ids=argmax, num_accepted=torch.zeros(B, dtype=torch.int64, device=argmax.device))
    if k > 0 and draft_ids.device != torch.device("cpu"):
        both = torch.cat([argmax, draft_ids.to(argmax.device, torch.int64)], dim=1).tolist()
        am, drafts = [r[:k1] for r in both], [r[k1:] for r in both]
    else:
        am = argmax.tolist()
        drafts = draft_ids.tolist() if k > 0 else [[] for _ in range(B)]
    tokens, accepted = [], []
    for a, d in zip(am, drafts):
        n = 0
        while n < k and d[n] == a[n]:
            n += 1
        tokens.append(a[: n + 1] + [-1] * (k - n))
        accepted.append(n)
    return Verdict(token_ids=torch.tensor(tokens, dtype=torch.int64).view(B, k1),
                   num_accepted=torch.tensor(accepted, dtype=torch.int64))


class GreedyVerifier:
    """Exact argmax matching. Lossless for temperature 0; refuses sampled requests."""

    lossless = True
    supports_trees = True

    def verify(self, target_logits: torch.Tensor, draft: Draft, sampling: SamplingBatch) -> Verdict:
        if not sampling.all_greedy:
            raise ValueError(
                "the greedy verifier only serves temperature 0 requests; use "
                "acceptance_method='rejection_sampler' for sampled requests"
            )
        if draft.tree is not None:
            from speculum.verifiers.tree import tree_greedy_verify
            return tree_greedy_verify(target_logits, draft.token_ids, draft.tree)
        return greedy_verify(target_logits, draft.token_ids)
