"""Exact-match sampling: the target samples every position, a draft token stays when it is that sample.

At each verified position ``j`` the target's token is drawn by the exponential race with
noise keyed by (the request's seed, the token's position), never by a stream
(:func:`~speculum.verifiers.noise.keyed_exponentials`). Drafts are kept while they equal
the target's samples; the first mismatch emits the target's sample. Every emitted token
is the target's own sample at its position, so the law is exactly the target's whatever
the draft (draft probabilities are not used). With batch-invariant logits
(``LLM(..., batch_invariant=True)``) the tokens are a function of the seed alone: the
same with speculation on or off, at any batch size. For one-hot drafts (n-gram, greedy
heads) a draft is kept with probability ``p(x)`` as under rejection sampling; for
sampled drafts rejection sampling keeps more.
"""

from __future__ import annotations

import torch

from speculum.devices import on_device
from speculum.interfaces import Draft, Verdict
from speculum.sampling import SamplingBatch
from speculum.verifiers.noise import keyed_exponentials
from speculum.verifiers.sampled import verify_sampled


def exact_match_sample(p: torch.Tensor, draft_ids: torch.Tensor, e: torch.Tensor) -> Verdict:
    """``p`` [B, k+1, V] target probabilities, ``draft_ids`` [B, k] (-1 padded), ``e``
    [B, k+1, V] Exp(1) noise: each position's sample is ``argmax(p / e)``; drafts are
    accepted while they equal it."""
    B, k1, _ = p.shape
    k = k1 - 1
    samples = (p / e).argmax(dim=-1)  # [B, k+1]
    if k:
        match = (draft_ids == samples[:, :k]) & (draft_ids >= 0)
        num_accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)
    else:
        num_accepted = torch.zeros(B, dtype=torch.int64, device=p.device)
    pos = torch.arange(k1, device=p.device).view(1, k1)
    tokens = torch.where(pos <= num_accepted.view(B, 1), samples, torch.full_like(samples, -1))
    return Verdict(token_ids=tokens, num_accepted=num_accepted)


class ExactMatchVerifier:
    """Lossless at any temperature; with batch-invariant kernels a seeded request gives
    the same tokens with and without speculation. Greedy rows use argmax matching."""

    lossless = True
    supports_trees = False
    tree_fix = "use acceptance_method 'rejection_sampler' or 'greedy' for trees"

    def verify(self, target_logits: torch.Tensor, draft: Draft, sampling: SamplingBatch) -> Verdict:
        if sampling.keys is None and not sampling.all_greedy:
            raise ValueError("exact-match sampling needs each row's (seed, position): build the batch with "
                             "SamplingBatch.from_params(..., keys=)")

        def rule(p, _q, ids, _generators):  # draft probabilities and streams are not used
            seeds = on_device([s for s, _ in sampling.keys], p.device)
            positions = on_device([t for _, t in sampling.keys], p.device)
            return exact_match_sample(p, ids, keyed_exponentials(seeds, positions, p.shape[1], p.shape[2]))

        return verify_sampled(rule, target_logits, draft, sampling)
