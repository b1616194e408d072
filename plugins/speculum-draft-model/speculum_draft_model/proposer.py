"""A separate, smaller model drafts ``k`` tokens autoregressively with its own KV cache.

The draft must share the target's vocabulary (checked at construction). Its cache is
rolled back by length after each verification, so rejected drafts cost no copies.
"""

from __future__ import annotations

import logging

import attrs

from speculum.interfaces import Draft, ProposeBatch, SequenceView, StepFeedback
from speculum.proposers.draft_loop import draft_autoregressive, rollback

log = logging.getLogger(__name__)


@attrs.frozen
class DraftModelOptions:
    """Plugin options (``"options": {...}`` in the speculative config).

    ``num_layers``: keep only the first N layers of the draft checkpoint (a cheap
    self-draft when ``model`` is the target itself); None keeps all.
    """

    num_layers: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.ge(1)))


class DraftModelProposer:
    """Drafts with a separate model run by the engine's backend."""

    def __init__(self, runner, sample: bool = True):
        self.runner = runner
        self.sample = sample

    @classmethod
    def from_context(cls, ctx) -> "DraftModelProposer":
        path = ctx.resolve_draft_path(hint="a small model of the target's family (same vocabulary), or train one "
                                           "with `speculum train draft --model <target>`")
        opts = ctx.options or DraftModelOptions()
        # the draft runs up to k - 1 positions past a sequence's last token; near the
        # context limit those drafts are discarded by the loop, but they must still fit
        runner = ctx.backend.load_model(path, role="draft",
                                        max_model_len=ctx.max_model_len + ctx.config.num_speculative_tokens,
                                        num_layers=opts.num_layers)
        ctx.check_vocab(runner.vocab_size)
        log.info("draft model %s loaded (%s layers)", path, opts.num_layers or "all")
        return cls(runner, sample=ctx.config.draft_sample_method == "sample")

    def add_request(self, seq: SequenceView) -> None:
        self.runner.add(seq.seq_id, seq.token_ids[:-1])

    def remove_request(self, seq_id: int) -> None:
        self.runner.remove(seq_id)

    def propose(self, batch: ProposeBatch) -> Draft:
        return draft_autoregressive(self.runner, batch.seqs, batch.num_speculative_tokens,
                                    batch.sampling, self.sample)

    def observe(self, feedback: StepFeedback) -> None:
        rollback(self.runner, feedback.seq_ids, feedback.num_accepted, feedback.new_lengths)
