"""A separate, smaller model drafts ``k`` tokens autoregressively with its own KV cache.

The draft must share the target's vocabulary (checked at construction). Its cache is
rolled back by length after each verification, so rejected drafts cost no copies.
A propose only appends to that cache, so taking one back (:meth:`DraftModelProposer.rewind`,
for a step drafted ahead that never ran) is a truncation to the length before it: the
proposer is a :class:`~speculum.interfaces.RewindableProposer`, and with overlap (CUDA)
each step is drafted and launched at the end of the step before.
"""

from __future__ import annotations

import logging
from pathlib import Path

import attrs

from speculum.interfaces import Draft, ProposeBatch, SequenceView, StepFeedback
from speculum.proposers.draft_loop import draft_autoregressive, rollback
from speculum.proposers.head_checkpoint import (checkpoint_embedding, find_shipped_head, shipped_names,
                                                target_fingerprint)

log = logging.getLogger(__name__)

#: drafts shipped with the plugin (package data), one folder each, used when ``model`` is unset
#: and one was made for the target (``speculum train draft --embeddings-from-target``: the
#: checkpoint holds the layers only, the target's embedding is put back when it is loaded)
SHIPPED = Path(__file__).parent / "drafts"


def shipped_draft(target_path: Path | None) -> Path | None:
    """The shipped draft made for the target at ``target_path`` (by the fingerprint of its
    embedding, as heads are found), if any."""
    if target_path is None:
        return None
    embed, layers = checkpoint_embedding(target_path)
    return None if embed is None else find_shipped_head(SHIPPED, "draft", target_fingerprint(embed, None, layers))


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
        #: per sequence drafted for by the last propose: its draft-cache length before it
        self._before: dict[int, int] = {}

    @classmethod
    def from_context(cls, ctx) -> "DraftModelProposer":
        have = shipped_names(SHIPPED, "draft")  # (none: no folder, nothing of the target's read)
        found = shipped_draft(ctx.target_path) if have and not ctx.config.model else None
        shipped = f"; the plugin ships drafts for {', '.join(have)} only" if have else ""
        path = ctx.resolve_draft_path(hint="a small model of the target's family (same vocabulary), or train one "
                                           f"with `speculum train draft --model <target>`{shipped}", default=found)
        if found is not None:
            log.info("draft_model: using the shipped draft %s", found.name)
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
        self._before.pop(seq_id, None)

    def propose(self, batch: ProposeBatch) -> Draft:
        self._before = {s.seq_id: self.runner.length(s.seq_id) for s in batch.seqs}
        return draft_autoregressive(self.runner, batch.seqs, batch.num_speculative_tokens,
                                    batch.sampling, self.sample)

    def rewind(self, seq_ids) -> None:
        """Undo the last propose for ``seq_ids``: drop the draft-cache positions it appended."""
        for sid in seq_ids:
            before = self._before.pop(sid, None)
            if before is not None and self.runner.length(sid) > before:
                self.runner.truncate(sid, before)

    def observe(self, feedback: StepFeedback) -> None:
        rollback(self.runner, feedback.seq_ids, feedback.num_accepted, feedback.new_lengths)
        for sid in feedback.seq_ids:  # verified: a later rewind concerns only the propose that follows
            self._before.pop(sid, None)
