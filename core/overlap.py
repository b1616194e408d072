"""The overlap half of :class:`speculum.loop.DraftVerifyLoop`: work for the next step
launched before this step's host bookkeeping (see the loop's module doc, "Overlap").

- a plain step's forward run ahead on the tokens just sampled (:meth:`Overlap._run_ahead`);
- a speculative step drafted and launched ahead after this step's appends and observe
  (:meth:`Overlap._plan_ahead`), taken by the next step if the batch is unchanged
  (:meth:`Overlap._claim_planned`), else dropped and the proposer rewound;
- the next drafts started from the verdict still on the device
  (:meth:`Overlap._draft_from_verdict`, :class:`~speculum.interfaces.VerdictDrafter`), and,
  opt-in, the next verify forward too (:meth:`Overlap._forward_from_verdict`).

The mixin reads and writes the loop's state (``target``, ``proposer``, ``length``, the
counters); it exists to keep each file about one thing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import torch

from speculum.devices import on_device
from speculum.interfaces import Draft, ForwardOutput, KVCacheFull, Verdict
from speculum.sequence import Sequence
from speculum.spec_length import FixedLength

if TYPE_CHECKING:
    from speculum.loop import _Plan


class Overlap:
    """Methods of :class:`~speculum.loop.DraftVerifyLoop` that launch the next step's work ahead."""

    def _may_run_ahead(self, seqs: list[Sequence], failed_rows: dict) -> bool:
        """Whether the next step is a plain decode of these rows whose forward may start
        now: no row will draft, no logprobs are read from this step's logits (the next
        forward overwrites them), no row failed. Hidden states a head still reads are copied
        first (:func:`speculum.loop._keep_states`): a head's plain steps (``"auto"`` or a
        schedule switching drafting off under load) overlap as decoding without speculation
        does.

        Under a length policy that varies k (``"auto"``, a batch-size schedule) the next
        step's k is chosen before this decision (:meth:`_choose_next`), so rows that may
        draft will not when it is 0, and a switch to drafting drops nothing run ahead. A
        policy whose k never varies (a schedule giving k = 0 at every batch size) is asked
        now: its plain steps overlap like an engine without speculation."""
        if self._chosen is not None:  # the next step's k, chosen already
            next_k = self._chosen[1]
        else:  # a policy whose k does not vary (a schedule giving every batch size one k: maybe 0)
            next_k = self.k if self.length.varies else self._policy_k(seqs)
        may_draft = next_k and any(s.speculative and self._cap(s) for s in seqs)
        return (not failed_rows and not any(s.params.logprobs is not None for s in seqs)
                and not may_draft)

    def _may_plan_ahead(self, seqs: list[Sequence]) -> bool:
        """Whether the next step's drafts may be made now, before the engine's bookkeeping:
        a fixed k (nothing this step observes changes it), a stateless proposer or one that
        can rewind a propose (:class:`RewindableProposer`: it has observed this step
        already, and is rewound if the step never comes), chains or trees, every row greedy with
        unprocessed logits and no logprobs (no random stream is drawn early, nothing read
        from this step's outputs later), no row finished (the batch stays the same)."""
        return (isinstance(self.length, FixedLength) and (not self.stateful or self.rewindable)
                and all(s.params.temperature == 0 and not s.processed and s.params.logprobs is None
                        and not s.finished for s in seqs)
                and any(s.speculative and self._cap(s) for s in seqs))

    def _plan_ahead(self, seqs: list[Sequence], k_step: int, vf: "_VerdictForward | None" = None) -> None:
        """Draft the next step now and launch its forward; :meth:`step` takes both if the
        same sequences come back unchanged (:meth:`_claim_planned`). ``vf``: that forward,
        launched from the verdict already, taken when the plan is what it was launched on."""
        # timed like any step's drafting (a policy that reads drafting times learns the steady
        # state from these, not only from the first steps after an admission or a switch)
        plan = self._plan(seqs, self._sampling(seqs), k_step, timing=True)
        if vf is not None:
            # the same drafts (the proposer returned what it launched), every row all of them
            if (plan.draft is vf.draft and not any(s.finished for s in seqs)
                    and all(n == vf.q for n in plan.num_tokens)):
                self._ahead = _Ahead(tuple(s.seq_id for s in seqs), vf.bases, vf.out, plan, k_step)
                return
            self._drop_verdict_forward(seqs, vf)
        launched = None
        if not any(s.finished for s in seqs):  # else the proposer failed a row: the batch changes anyway
            launched = self._launch_ahead(seqs, plan.inputs, plan.num_tokens, **plan.forward_kwargs())
        if launched is not None:
            self._ahead = _Ahead(tuple(s.seq_id for s in seqs), *launched, plan, k_step)
        elif self.rewindable:
            self._rewind([s.seq_id for s in seqs if not s.finished])

    def _draft_from_verdict(self, seqs: list[Sequence], plan: "_Plan", verdict: Verdict, out: ForwardOutput,
                            ahead: bool, failed_rows: dict) -> Draft | None:
        """Start the next step's drafts (chains or trees) from this step's verdict on the
        device, before the host waits for its copy (:class:`VerdictDrafter`), when the next
        step will be drafted ahead anyway (:meth:`_may_plan_ahead`) at a k that does not vary
        (the next forward's width is this one's: no length policy is asked here) and every
        row drafted this step (a proposer that asks for no hidden states needs none). Its
        observe settles them, its plan ahead takes them; otherwise they are rewound."""
        if not (self.from_verdict and self.overlap and ahead and not failed_rows and plan.k
                and not self.length.varies and (out.hidden_states or not self.wants_hidden)
                and len(plan.rows) == len(seqs) and self._may_plan_ahead(seqs)):
            return None
        try:
            launched = self.proposer.draft_from_verdict([s.seq_id for s in seqs], [len(s.token_ids) for s in seqs],
                                                        verdict, out.hidden_states)
        except Exception as exc:  # drafts are only drafts: draft after the verdict's copy again
            self.from_verdict = False
            self._once("proposer", f"proposer {type(self.proposer).__name__}.draft_from_verdict failed ({exc!r}); "
                                   "the next drafts wait for the verdict on the host again")
            return None
        self.drafted_from_verdict += launched is not None
        return launched

    def _forward_from_verdict(self, seqs: list[Sequence], verdict: Verdict, draft: Draft,
                              failed_rows: dict[int, str]) -> "_VerdictForward | None":
        """Launch the next verify forward on the new tokens and the drafts just launched from
        the verdict (a chain, or a tree's nodes), with both still on the device (the runner
        moves a tree's accepted path into place and places each row from its accepted count:
        ``forward_from_verdict``). The step's bookkeeping then keeps its K/V and the plan
        ahead takes it (:meth:`_plan_ahead`), or it is dropped. If the runner raises on a
        tree step, the path's K/V may have moved already: those rows fail (``failed_rows``)
        rather than risk a second move, and the feature is turned off."""
        if not (self.forward_from_verdict and (draft.tree is None) == (verdict.path is None)):
            return None
        k = self._policy_k(seqs)  # a fixed k (drafting from the verdict plans ahead only then)
        if draft.tree is not None:
            k = draft.token_ids.shape[1]  # a tree is verified whole
        if not k or draft.token_ids.shape[1] < k:
            return None
        B, dev = len(seqs), self.target.device
        acc = verdict.num_accepted.to(dev, torch.int64)
        first = verdict.token_ids.to(dev).gather(1, acc.view(B, 1))  # each row's new token
        ids = torch.cat([first, draft.token_ids[:, :k].to(dev)], dim=1)
        before = {s.seq_id: self.target.length(s.seq_id) for s in seqs}
        try:
            out = self.target.forward_from_verdict(list(before), [len(s.token_ids) for s in seqs], acc, ids,
                                                   self.hidden_layers, path=verdict.path, tree=draft.tree)
        except Exception as exc:  # the forward waits for the host again
            self._cut_back(before)
            self.forward_from_verdict = False
            self._once("runner", f"runner {type(self.target).__name__}.forward_from_verdict failed ({exc!r}); "
                                 "the next forward waits for the verdict on the host again")
            if verdict.path is not None:
                for b in range(B):
                    failed_rows.setdefault(b, f"the verify forward launched from the verdict failed ({exc!r}); "
                                              "send the request again (the engine now waits for the verdict on "
                                              "the host), and set the speculative config's from_verdict to "
                                              "\"draft\" to avoid it")
            return None
        if out is None:  # no room for the longest outcome now
            return None
        self.forwards_from_verdict += 1
        return _VerdictForward(draft, out, k + 1)

    def _drop_verdict_forward(self, seqs: list[Sequence], vf: "_VerdictForward") -> None:
        """A forward launched from the verdict that no step will use: each row still running
        keeps only its own K/V (the bookkeeping recorded its length in ``vf.bases``)."""
        self.ahead_dropped += 1
        self._cut_back({s.seq_id: vf.bases[s.seq_id] for s in seqs if s.seq_id in vf.bases and not s.finished})

    def _cut_back(self, bases: dict[int, int]) -> None:
        """Truncate each sequence longer than its KV length in ``bases`` back to it."""
        for sid, base in bases.items():
            if self.target.length(sid) > base:
                self.target.truncate(sid, base)

    def _claim_planned(self, seqs: list[Sequence], k_step: int) -> "_Ahead | None":
        """The step drafted and launched ahead by :meth:`_plan_ahead`, if it is this step:
        the same sequences, none grown or finished since (each still holds KV for all its
        tokens but the last), the same k. Else it is dropped and None returned."""
        ahead = self._ahead
        if ahead is None or ahead.plan is None:
            return None
        self._ahead = None
        if (ahead.seq_ids == tuple(s.seq_id for s in seqs) and len(ahead.bases) == len(seqs)
                and ahead.k_step == k_step and all(len(s.token_ids) == ahead.bases[s.seq_id] + 1 for s in seqs)):
            self.ahead_used += 1
            return ahead
        self._drop(ahead)
        return None

    def _run_ahead(self, seqs: list[Sequence], tokens: torch.Tensor) -> None:
        """Launch the next step's forward on ``tokens`` [B, 1] (where the verdict left them)."""
        launched = self._launch_ahead(seqs, tokens, [1] * len(seqs))
        if launched is not None:
            self._ahead = _Ahead(tuple(s.seq_id for s in seqs), *launched)

    def _launch_ahead(self, seqs: list[Sequence], inputs: torch.Tensor, num_tokens: list[int], **kw):
        """(the rows' KV lengths before it, its output) of the next step's forward (``kw``: a
        token ``tree``, the ``last_tokens`` on the host, as :meth:`_Plan.forward_kwargs`
        gives them) launched now, or None when the cache has no room for it (the next step
        then schedules itself)."""
        bases = {s.seq_id: self.target.length(s.seq_id) for s in seqs}
        try:
            return bases, self.target.forward(list(bases), inputs, num_tokens, self.hidden_layers, **kw)
        except KVCacheFull:
            self._cut_back(bases)
            return None

    def _drop(self, ahead: "_Ahead") -> None:
        """Give back the KV positions of a forward run ahead that no step will use (rows
        still running: finish() removed the others), and the drafts made for it."""
        self.ahead_dropped += 1
        for sid, base in ahead.bases.items():
            self.target.truncate(sid, base)
        if ahead.plan is not None and self.rewindable:
            self._rewind(list(ahead.bases))

    def _rewind(self, seq_ids: list[int]) -> None:
        """Take back the proposer's drafts of a step planned ahead that will not run."""
        try:
            self.proposer.rewind(seq_ids)
        except Exception as exc:  # drafts are only drafts (verification keeps output exact); plan no more
            self.rewindable = False
            self._once("proposer", f"proposer {type(self.proposer).__name__}.rewind failed ({exc!r}); "
                                   "steps are no longer drafted ahead")

    def _take_ahead(self, seqs: list[Sequence], k: int):
        """The forward run ahead for this step, if it is this step's forward; else drop it
        (truncating the position it wrote) and return None."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        ids = tuple(s.seq_id for s in seqs)
        if not k and set(ids) == set(ahead.bases):  # the same rows, less those that finished
            self.ahead_used += 1
            if ids == ahead.seq_ids:
                return ahead.out
            pos = {sid: i for i, sid in enumerate(ahead.seq_ids)}
            idx = on_device([pos[sid] for sid in ids], ahead.out.logits.device)
            return ahead.out.take_rows(idx)
        self._drop(ahead)
        return None


@attrs.define
class _Ahead:
    """A forward launched one step ahead: its rows, their KV lengths before it, its output;
    for a speculative step also its plan and k."""

    seq_ids: tuple[int, ...]
    bases: dict[int, int]
    out: ForwardOutput
    plan: _Plan | None = None
    k_step: int = 0


@attrs.define
class _VerdictForward:
    """The next verify forward, launched from the device verdict: the drafts it was
    launched on, its output, its tokens per row, and each row's KV length before it (filled
    in once the host has read the accepted counts)."""

    draft: Draft
    out: ForwardOutput
    q: int
    bases: dict[int, int] = attrs.field(factory=dict)
