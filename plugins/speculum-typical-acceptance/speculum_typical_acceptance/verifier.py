"""The ``typical_acceptance`` verifier and its options (``verifier_options`` in the config)."""

from __future__ import annotations

import functools

import attrs
import torch

from speculum.interfaces import Draft, Verdict
from speculum.sampling import SamplingBatch
from speculum.verifiers import tree_greedy_verify, verify_sampled
from speculum_typical_acceptance.rule import typical_accept, typical_accept_tree


def _open_unit(_inst, attribute, value):
    if not 0.0 < value < 1.0:
        raise ValueError(f"{attribute.name} must be in (0, 1), got {value!r} (Medusa-2 uses 0.09)")


def _non_negative(_inst, attribute, value):
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value!r} (Medusa-2 uses 0.3)")


@attrs.frozen
class TypicalAcceptanceOptions:
    """Accept ``x`` when ``p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p)))``."""

    #: the hard ceiling of the threshold (in (0, 1): keeps temperature 0 exactly greedy)
    posterior_threshold: float = attrs.field(default=0.09, converter=float, validator=_open_unit)
    #: scale of the entropy-adaptive threshold ``exp(-H)``
    posterior_alpha: float = attrs.field(default=0.3, converter=float, validator=_non_negative)


class TypicalAcceptanceVerifier:
    """Typical acceptance (Medusa-2). LOSSY: sampled output does not follow the target.

    Greedy rows (temperature 0) use exact argmax matching, which is what the rule reduces
    to there.
    """

    lossless = False
    #: token trees: the deepest path whose every node passes, ties by likelihood (rule.py)
    supports_trees = True

    def __init__(self, options: TypicalAcceptanceOptions | None = None):
        self.options = options or TypicalAcceptanceOptions()
        o = self.options
        self._rule = functools.partial(_rule, posterior_threshold=o.posterior_threshold,
                                       posterior_alpha=o.posterior_alpha)

    def verify(self, target_logits: torch.Tensor, draft: Draft, sampling: SamplingBatch) -> Verdict:
        if draft.tree is not None:
            return self._verify_tree(target_logits, draft, sampling)
        return verify_sampled(self._rule, target_logits, draft, sampling)

    def _verify_tree(self, target_logits: torch.Tensor, draft: Draft, sampling: SamplingBatch) -> Verdict:
        """Greedy rows take the argmax path (what the rule is at temperature 0)."""
        from speculum.sampling import processed_probs
        if sampling.all_greedy:
            return tree_greedy_verify(target_logits, draft.token_ids, draft.tree)
        flags = sampling.flags(target_logits.shape[-1])
        p = processed_probs(target_logits, sampling.temperature, sampling.top_k, sampling.top_p, flags)
        o = self.options
        verdict = typical_accept_tree(p, draft.token_ids, draft.tree, sampling.generators,
                                      o.posterior_threshold, o.posterior_alpha)
        greedy_rows = sampling.temperature == 0
        if bool(greedy_rows.any()):
            g = tree_greedy_verify(target_logits, draft.token_ids, draft.tree)
            gr = greedy_rows.view(-1, 1).to(p.device)
            verdict = Verdict(token_ids=torch.where(gr, g.token_ids, verdict.token_ids),
                              num_accepted=torch.where(greedy_rows.to(p.device), g.num_accepted, verdict.num_accepted),
                              path=torch.where(gr, g.path, verdict.path))
        return verdict


def _rule(p, q, draft_ids, generators, posterior_threshold, posterior_alpha) -> Verdict:
    """``speculum.verifiers.verify_sampled`` rule signature; the draft's ``q`` is unused."""
    return typical_accept(p, draft_ids, generators, posterior_threshold, posterior_alpha)
