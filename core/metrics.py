"""Speculation metrics, per request and engine-wide, defined as vLLM defines them.

A *verify step* is one target forward while decoding; a *draft* is a verify step that
carried at least one draft token. The figures:

- ``draft_acceptance_rate`` = accepted / drafted tokens
- ``mean_acceptance_length`` = 1 + accepted / drafts (vLLM's: tokens per drafting step)
- ``tokens_per_step`` = 1 + accepted / verify steps (tokens per target forward, steps
  without a draft included: what the speedup follows)
- ``acceptance_rate_per_position()[i]`` = drafts whose token ``i+1`` was accepted / drafts
  that reached position ``i+1`` (vLLM's ``num_accepted_tokens_per_pos / num_drafts`` when
  every draft has ``k`` tokens)

Each is None (an empty list per position) when its denominator is zero: nothing drafted
means no acceptance rate, never 0.
"""

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
    - ``accepted_per_position[i]``: drafts whose token ``i+1`` was accepted
    - ``drafts_per_position[i]``: drafts with at least ``i+1`` tokens
    - ``num_tree_steps`` / ``num_tree_nodes``: verify steps that carried a token tree,
      and the nodes they verified (also counted in ``num_draft_tokens``); for a tree the
      accepted tokens are the accepted path's depth and positions are depths (a tree
      reaches position ``i+1`` when it is at least ``i+1`` deep)
    - ``lossless``: False when a lossy verifier (e.g. typical acceptance) produced them
    """

    num_steps: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    acceptance_histogram: list[int] = attrs.field(factory=list)
    accepted_per_position: list[int] = attrs.field(factory=list)
    drafts_per_position: list[int] = attrs.field(factory=list)
    num_tree_steps: int = 0
    num_tree_nodes: int = 0
    lossless: bool = True

    def record_step(self, num_draft: int, num_accepted: int, tree_depth: int | None = None) -> None:
        """One verify step that drafted ``num_draft`` tokens and accepted ``num_accepted``
        (a tree of ``num_draft`` nodes, ``tree_depth`` deep, when given)."""
        if tree_depth is not None:
            self.num_tree_steps += 1
            self.num_tree_nodes += num_draft
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
        reached = num_draft if tree_depth is None else tree_depth
        _grow(self.drafts_per_position, reached)
        for i in range(reached):
            self.drafts_per_position[i] += 1

    def merge(self, other: "SpecDecodeMetrics") -> None:
        self.num_tree_steps += other.num_tree_steps
        self.num_tree_nodes += other.num_tree_nodes
        self.num_steps += other.num_steps
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_emitted_tokens += other.num_emitted_tokens
        self.lossless = self.lossless and other.lossless
        for mine, theirs in ((self.acceptance_histogram, other.acceptance_histogram),
                             (self.accepted_per_position, other.accepted_per_position),
                             (self.drafts_per_position, other.drafts_per_position)):
            _grow(mine, len(theirs))
            for i, v in enumerate(theirs):
                mine[i] += v

    @property
    def draft_acceptance_rate(self) -> float | None:
        """accepted / drafted tokens (None when nothing was drafted)."""
        if not self.num_draft_tokens:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / drafts: tokens per drafting step, as vLLM reports it (None
        when nothing was drafted)."""
        if not self.num_drafts:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    @property
    def tokens_per_step(self) -> float | None:
        """1 + accepted / verify steps: tokens per target forward, steps without a draft
        included (None before the first step)."""
        if not self.num_steps:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_steps

    def acceptance_rate_per_position(self) -> list[float]:
        """For each draft position i+1: accepted there / drafts that reached it."""
        return [a / d for a, d in zip(self.accepted_per_position + [0] * len(self.drafts_per_position),
                                      self.drafts_per_position) if d]

    def as_dict(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_emitted_tokens": self.num_emitted_tokens,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "tokens_per_step": self.tokens_per_step,
            "acceptance_rate_per_position": self.acceptance_rate_per_position(),
            "acceptance_histogram": list(self.acceptance_histogram),
            "accepted_per_position": list(self.accepted_per_position),
            "drafts_per_position": list(self.drafts_per_position),
            "num_tree_steps": self.num_tree_steps,
            "num_tree_nodes": self.num_tree_nodes,
            "lossless": self.lossless,
        }


def _grow(values: list[int], n: int) -> None:
    if len(values) < n:
        values.extend([0] * (n - len(values)))
