"""A separate, smaller model drafts ``k`` tokens autoregressively with its own KV cache.

The draft must share the target's vocabulary (checked at construction). Its cache is
rolled back by length after each verification, so rejected drafts cost no copies.
A propose only appends to that cache, so taking one back (:meth:`DraftModelProposer.rewind`,
for a step drafted ahead that never ran) is a truncation to the length before it: the
proposer is a :class:`~speculum.interfaces.RewindableProposer`, and with overlap (CUDA)
each step is drafted and launched at the end of the step before. It is also a
:class:`~speculum.interfaces.VerdictDrafter`: on a runner that forwards from a verdict still on
the device (the native runner), greedy chains start right after the verify step, before the
host has read how many drafts were accepted (:func:`~speculum.proposers.draft_loop.draft_chain_from_verdict`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import attrs

import torch

from speculum.interfaces import Draft, ProposeBatch, SequenceView, StepFeedback, Verdict
from speculum.proposers.draft_loop import draft_autoregressive, draft_chain_from_verdict, rollback
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


@attrs.define(eq=False)
class _Launched:
    """Chains drafted from a verdict still on the device (:meth:`DraftModelProposer.draft_from_verdict`)."""

    seq_ids: tuple[int, ...]
    #: per sequence, its length before the verified step (its draft cache then held it and k - 1 drafts)
    lengths: dict[int, int]
    k: int
    #: the drafts (every row), as the next propose of the same rows returns them
    draft: Draft
    #: sequences whose accepted count observe() has applied
    observed: set[int] = attrs.field(factory=set)


class DraftModelProposer:
    """Drafts with a separate model run by the engine's backend."""

    def __init__(self, runner, sample: bool = True):
        self.runner = runner
        self.sample = sample
        #: per sequence drafted for by the last propose: its draft-cache length before it
        self._before: dict[int, int] = {}
        #: the last propose's k and each of its sequences' last token (for drafting from the verdict)
        self._k = 0
        self._last: dict[int, int] = {}
        #: chains drafted from a verdict not yet on the host, until the next propose or rewind
        self._launched: _Launched | None = None

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
        if self._launched is not None:
            self._launched.lengths.pop(seq_id, None)  # the batch changed: the next propose takes these back
        self.runner.remove(seq_id)
        self._before.pop(seq_id, None)
        self._last.pop(seq_id, None)

    def propose(self, batch: ProposeBatch) -> Draft:
        seqs, k = batch.seqs, batch.num_speculative_tokens
        launched = self._take_launched(seqs, k)
        self._k, self._last = k, {s.seq_id: s.token_ids[-1] for s in seqs}
        if launched is not None:  # drafted from the verdict already (greedy, every row); _before set by observe
            return launched
        self._before = {s.seq_id: self.runner.length(s.seq_id) for s in seqs}
        return draft_autoregressive(self.runner, seqs, k, batch.sampling, self.sample)

    def rewind(self, seq_ids) -> None:
        """Undo the last propose for ``seq_ids``: drop the draft-cache positions it appended
        (and take back chains drafted from a verdict that no propose took)."""
        if self._launched is not None:
            self._take_back(self._launched)
            self._launched = None
        for sid in seq_ids:
            self._restore(sid)

    def _restore(self, sid: int) -> None:
        before = self._before.pop(sid, None)
        if before is not None and self.runner.length(sid) > before:
            self.runner.truncate(sid, before)

    def observe(self, feedback: StepFeedback) -> None:
        rows = [b for b, (sid, a) in enumerate(zip(feedback.seq_ids, feedback.num_accepted)) if not self._settle(sid, a)]
        rollback(self.runner, [feedback.seq_ids[b] for b in rows], [feedback.num_accepted[b] for b in rows],
                 [feedback.new_lengths[b] for b in rows])
        for b in rows:  # verified: a later rewind concerns only the propose that follows
            self._before.pop(feedback.seq_ids[b], None)

    # -- drafting from a verdict still on the device (VerdictDrafter) ------------------------
    def draft_from_verdict(self, seq_ids, lengths, verdict: Verdict, hidden_states) -> Draft | None:
        """Start the next greedy chains of ``seq_ids`` now, from the verdict of the step just
        verified while it is still on the device (:class:`~speculum.interfaces.VerdictDrafter`).
        Only for rows the last propose drafted ``k`` tokens for from a caught-up cache (their
        cache then holds the sequence and ``k - 1`` drafts), chains only, and where the draft's
        runner forwards from a verdict (the native runner); else None and nothing launched."""
        k = self._k
        if (verdict.path is not None or self._launched is not None or k < 1
                or not getattr(self.runner, "forwards_from_verdict", False) or verdict.token_ids.shape[1] != k + 1
                or any(sid not in self._before or self.runner.length(sid) != n + k - 1
                       for sid, n in zip(seq_ids, lengths))):
            return None
        B = len(seq_ids)
        with torch.inference_mode():  # (the verdict's rows stay on the device; the last tokens go with the metadata)
            out = draft_chain_from_verdict(self.runner, seq_ids, lengths, verdict.as_rows(),
                                           [self._last[sid] for sid in seq_ids], k)
        if out is None:
            return None
        draft = Draft(token_ids=out, lengths=[k] * B)
        self._launched = _Launched(tuple(seq_ids), dict(zip(seq_ids, lengths)), k, draft)
        self._before = {}  # the last propose was verified: nothing of it to take back
        return draft

    def _take_launched(self, seqs, k: int) -> Draft | None:
        """The chains :meth:`draft_from_verdict` launched for exactly ``seqs`` at ``k``, every row
        observed since; anything else launched is taken back. Clears the launch."""
        launched, self._launched = self._launched, None
        if launched is None:
            return None
        if (tuple(s.seq_id for s in seqs) == launched.seq_ids and launched.k == k
                and launched.observed == set(launched.seq_ids)):
            return launched.draft
        self._take_back(launched)
        return None

    def _settle(self, sid: int, num_accepted: int) -> bool:
        """observe() for a row drafted from its verdict: its cache is cut to the sequence and
        the ``k - 1`` drafts fed (``n + a + 1`` tokens, then ``k - 1``); a rewind of the propose
        that takes these drafts goes back to the sequence's first ``n + a`` tokens."""
        launched = self._launched
        if launched is None or sid not in launched.lengths or sid in launched.observed:
            return False
        n = launched.lengths[sid]
        self.runner.truncate(sid, n + num_accepted + launched.k)
        self._before[sid] = n + num_accepted
        launched.observed.add(sid)
        return True

    def _take_back(self, launched: _Launched) -> None:
        """Undo chains launched from a verdict that no propose took: observed rows go back to
        their sequence's tokens but the new one (as a rollback leaves them), the others to the
        positions before the one the launch rewrote first."""
        for sid, n in launched.lengths.items():
            if sid in launched.observed:
                self._restore(sid)
            elif self.runner.length(sid) > n - 1:
                self.runner.truncate(sid, n - 1)
