"""The ``typical_acceptance`` verifier and its options (``verifier_options`` in the config)."""

from __future__ import annotations

import functools

import attrs
import torch

from speculum.interfaces import Draft, Verdict
from speculum.sampling import SamplingBatch
from speculum.verifiers import verify_sampled, verify_tree_sampled
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
        self._tree_rule = functools.partial(_tree_rule, posterior_threshold=o.posterior_threshold,
                                            posterior_alpha=o.posterior_alpha)

    def verify(self, target_logits: torch.Tensor, draft: Draft, sampling: SamplingBatch) -> Verdict:
        if draft.tree is not None:  # greedy rows take the argmax path (the rule at temperature 0)
            return verify_tree_sampled(self._tree_rule, target_logits, draft, sampling)
        return verify_sampled(self._rule, target_logits, draft, sampling)


def _rule(p, q, draft_ids, generators, posterior_threshold, posterior_alpha) -> Verdict:
    """``speculum.verifiers.verify_sampled`` rule signature; the draft's ``q`` is unused."""
    return typical_accept(p, draft_ids, generators, posterior_threshold, posterior_alpha)


def _tree_rule(p, q, token_ids, tree, generators, posterior_threshold, posterior_alpha) -> Verdict:
    """``speculum.verifiers.verify_tree_sampled`` rule signature; ``q`` is unused."""
    return typical_accept_tree(p, token_ids, tree, generators, posterior_threshold, posterior_alpha)
