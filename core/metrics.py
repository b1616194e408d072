"""Speculation metrics, per request and engine-wide (the figures vLLM users know)."""

from __future__ import annotations

import attrs


@attrs.define
class SpecDecodeMetrics:
    """Counts of one request (or of the whole engine, when merged).

    - ``num_steps``: verify steps (target forwards while decoding)
    - ``num_drafts``: steps that carried at least one draft token
    - ``num_draft_tokens`` / ``num_accepted_tokens``: drafted and accepted tokens
    - ``num_emitted_tokens``: tokens produced by verification (accepted + one per step)
    - ``acceptance_histogram[a]``: steps in which exactly ``a`` drafts were accepted
    - ``accepted_per_position[i]``: steps in which draft token ``i+1`` was accepted
      (for token trees: the accepted node at depth ``i+1``)
    - ``num_tree_steps`` / ``num_tree_nodes``: verify steps that carried a token tree,
      and the nodes they verified (also counted in ``num_draft_tokens``); for a tree the
      accepted tokens are the accepted path's depth
    """

    num_steps: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    acceptance_histogram: list[int] = attrs.field(factory=list)
    accepted_per_position: list[int] = attrs.field(factory=list)
    num_tree_steps: int = 0
    num_tree_nodes: int = 0

    def record_step(self, num_draft: int, num_accepted: int) -> None:
        self.num_steps += 1
        self.num_drafts += num_draft > 0
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1
        _grow(self.acceptance_histogram, num_accepted + 1)
        self.acceptance_histogram[num_accepted] += 1
        _grow(self.accepted_per_position, num_accepted)
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def record_tree(self, num_nodes: int) -> None:
        """The step just recorded verified a tree of ``num_nodes`` nodes."""
        self.num_tree_steps += 1
        self.num_tree_nodes += num_nodes

    def merge(self, other: "SpecDecodeMetrics") -> None:
        self.num_tree_steps += other.num_tree_steps
        self.num_tree_nodes += other.num_tree_nodes
        self.num_steps += other.num_steps
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_emitted_tokens += other.num_emitted_tokens
        for mine, theirs in ((self.acceptance_histogram, other.acceptance_histogram),
                             (self.accepted_per_position, other.accepted_per_position)):
            _grow(mine, len(theirs))
            for i, v in enumerate(theirs):
                mine[i] += v

    @property
    def draft_acceptance_rate(self) -> float | None:
        """accepted / drafted (None when nothing was drafted)."""
        if not self.num_draft_tokens:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / verify steps: tokens gained per target forward."""
        if not self.num_steps:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_steps

    def acceptance_rate_per_position(self) -> list[float]:
        """Fraction of verify steps that accepted draft position i+1."""
        return [a / self.num_steps for a in self.accepted_per_position] if self.num_steps else []

    def as_dict(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_emitted_tokens": self.num_emitted_tokens,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_histogram": list(self.acceptance_histogram),
            "accepted_per_position": list(self.accepted_per_position),
            "num_tree_steps": self.num_tree_steps,
            "num_tree_nodes": self.num_tree_nodes,
        }


def _grow(values: list[int], n: int) -> None:
    if len(values) < n:
        values.extend([0] * (n - len(values)))
