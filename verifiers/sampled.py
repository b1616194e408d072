"""Running an acceptance rule on a step: processed target distributions, greedy rows apart."""

from __future__ import annotations

from typing import Callable

import torch

from speculum.interfaces import Draft, Verdict
from speculum.sampling import SamplingBatch, processed_probs
from speculum.verifiers.greedy import greedy_verify
from speculum.verifiers.noise import Generators

#: ``rule(p, q, draft_ids, generators) -> Verdict``: ``p`` [B, k+1, V] processed target
#: probabilities, ``q`` [B, k, V] draft probabilities or None (one-hot drafts),
#: ``draft_ids`` [B, k] (-1 padded), ``generators`` the rows' random streams
Rule = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor, Generators], Verdict]


def verify_sampled(rule: Rule, target_logits: torch.Tensor, draft: Draft, sampling: SamplingBatch,
                   argmax: torch.Tensor | None = None) -> Verdict:
    """Verify one step with ``rule``; rows at temperature 0 use exact argmax matching.

    Temperature, top-k and top-p turn ``target_logits`` [B, k+1, V] into ``p`` exactly as
    they turned the draft's logits into ``draft.probs`` (``speculum.sampling.processed_probs``).
    An all-greedy step never builds ``p``. ``argmax``: the logits' argmax when the caller
    has it (:func:`~speculum.verifiers.greedy.greedy_verify`).
    """
    if sampling.all_greedy:
        return greedy_verify(target_logits, draft.token_ids, argmax)
    flags = sampling.flags(target_logits.shape[-1])
    p = processed_probs(target_logits, sampling.temperature, sampling.top_k, sampling.top_p, flags)
    ids = draft.token_ids.to(p.device)
    probs = draft.probs.to(p.device) if draft.probs is not None else None
    verdict = rule(p, probs, ids, sampling.generators)
    greedy_rows = sampling.temperature == 0
    if flags[2] if flags is not None else bool(greedy_rows.any()):
        g = greedy_verify(target_logits, ids, argmax)
        gr = greedy_rows.view(-1, 1)
        verdict.token_ids = torch.where(gr, g.token_ids.to(p.device), verdict.token_ids)
        verdict.num_accepted = torch.where(greedy_rows, g.num_accepted.to(p.device), verdict.num_accepted)
    return verdict
