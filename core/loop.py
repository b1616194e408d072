"""One engine step of the draft-verify loop, over a batch of running sequences.

    proposer.propose -> target forward over [last token + drafts] -> verifier.verify
    -> KV rollback by length -> stop checks -> proposer.observe -> metrics

With no proposer the same step is plain autoregressive decoding (k = 0), so speculative
and baseline runs share every line of code but the draft.

Failures stay local. A request whose row fails (NaN/inf logits, a proposer or verifier
raising :class:`~speculum.errors.RowError` on it, a detokeniser or stop-string error)
finishes with ``finish_reason="error"``; the others go on. A proposer that raises for the
whole batch, or returns a malformed draft, costs only its drafts: the step runs as plain
decoding (logged once per kind of failure). A stateless proposer drafts again next step;
a stateful one (with ``add_request``/``remove_request``) may have left its per-request
state half updated, so it is dropped for the requests of that batch, which carry on
without speculation. A verifier that raises is replaced for the step by plain sampling
of the first position (lossless: no draft is accepted).

Overlap (``overlap=True``, the engine's default on CUDA; the methods in
:mod:`speculum.overlap`): a step in which no row can draft launches the next step's
target forward on the tokens it just sampled, still on the device, before it reads them
back; the host's bookkeeping of this step (stop checks, detokenisation, the engine's
outputs and scheduling, the next sampling batch) then runs while the GPU computes the
next forward. The next step uses that forward when it runs the same sequences (less any
that finished) without drafts; otherwise (a request joined, was aborted or preempted, or
drafts resume) the forward is dropped and its KV position truncated, and the step runs
its own. A head's plain steps (a policy that switched drafting off) run ahead too: the
hidden states it still reads are copied before the next forward overwrites the runner's
output buffers. While requests wait for admission the engine asks for nothing to run
ahead (the next batch would likely differ). Sampling is untouched (it happens in step
order on the host's call), so outputs are identical with and without overlap. A
speculative step at a fixed k with greedy rows drafts the next step and launches its
forward right after its appends, stop checks and the proposer's observe, when the
proposer is stateless or can take a propose back
(:class:`~speculum.interfaces.RewindableProposer`: the hidden-state heads); a next step
that differs drops that forward and rewinds those drafts.

Token trees (``Draft.tree``, see :mod:`speculum.tree`): the forward verifies every node at
once, the verdict names the accepted path, whose K/V the target moves into consecutive
positions before the rollback by length, and whose hidden states reach the proposer in
path order, as a chain's would.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence as Seq

import attrs
import torch

from speculum.devices import on_device
from speculum.errors import RowError
from speculum.interfaces import (Draft, ForwardOutput, HiddenStateProposer, ModelRunner, ProposeBatch,
                                 Proposer, RewindableProposer, StatefulProposer, StepFeedback, Verdict, VerdictDrafter,
                                 Verifier)
from speculum.logprobs import position_logprobs, prompt_scorer
from speculum.overlap import Overlap, _Ahead
from speculum.sampling import SamplingBatch, processed_probs
from speculum.sequence import Sequence
from speculum.spec_length import FixedLength
from speculum.tokenizer import Tokenizer
from speculum.tree import gather_path, path_moves

log = logging.getLogger(__name__)


class DraftVerifyLoop(Overlap):
    """Runs steps for a target runner, an optional proposer and a verifier."""

    def __init__(self, target: ModelRunner, verifier: Verifier, tokenizer: Tokenizer,
                 proposer: Proposer | None = None, num_speculative_tokens: int = 0,
                 hidden_layers: Seq[int] = (), length=None, trees: bool = False, overlap: bool = False,
                 from_verdict: str = "draft"):
        self.target = target
        self.verifier = verifier
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.k = num_speculative_tokens if proposer is not None else 0
        #: the proposer drafts token trees of k nodes (the length policy turns them on or off)
        self.trees = trees and self.k > 0
        #: picks each step's k (:mod:`speculum.spec_length`); fixed k by default
        self.length = length if length is not None else FixedLength(self.k)
        #: steps run at each k (index k): the chosen-k histogram
        self.k_counts: list[int] = [0] * (self.k + 1)
        #: every how many steps drafting is timed with a device sync (CUDA; always elsewhere)
        self.time_every = 8 if target.device.type == "cuda" else 1
        self._steps = 0
        self.hidden_layers = tuple(hidden_layers)
        self.stateful = isinstance(proposer, StatefulProposer)
        self.wants_hidden = isinstance(proposer, HiddenStateProposer)
        #: a stateful proposer that can take back a propose may draft the next step ahead
        self.rewindable = self.stateful and isinstance(proposer, RewindableProposer)
        #: ... and one that drafts from a verdict still on the device starts the next step's
        #: drafting (chain or tree) before the host reads that verdict (:class:`VerdictDrafter`);
        #: the speculative config's ``from_verdict`` ("off": after the copy, a benchmark's "before")
        self.from_verdict = (self.rewindable and isinstance(proposer, VerdictDrafter) and from_verdict != "off")
        #: steps whose next drafts started from the device verdict
        self.drafted_from_verdict = 0
        #: ... and whose next verify forward was launched from it too, before the host read
        #: the verdict (a runner with ``forward_from_verdict``; ``from_verdict="forward"``)
        self.forward_from_verdict = (self.from_verdict and getattr(target, "forwards_from_verdict", False)
                                     and from_verdict == "forward")
        #: steps whose next forward was launched from the device verdict
        self.forwards_from_verdict = 0
        #: the runner takes each row's last token on the host and clamps the drafts itself
        #: (``forward(..., last_tokens=...)``): a step's inputs need no device ops
        self.last_on_host = bool(getattr(target, "takes_last_tokens", False))
        #: hand the runner's argmax of the logits (``ForwardOutput.argmax``) to a verifier that
        #: takes it (``takes_argmax``, ``verify(..., argmax=)``; read each step: a verifier may
        #: be swapped, e.g. by ``bench verifiers``): one launch less a greedy step
        self.use_runner_argmax = True
        self._said: set[str] = set()
        #: failures survived, by kind (proposer, draft, verifier, row): for logs and soaks
        self.failures: dict[str, int] = {}
        #: run the next step's forward ahead when no row drafts (see the module doc)
        self.overlap = overlap
        self._ahead: _Ahead | None = None
        #: forwards run ahead and then used, and run ahead and dropped
        self.ahead_used = self.ahead_dropped = 0
        #: the last step, for its cycle time (:meth:`_observe_cycle`): (start, batch size,
        #: k chosen, tokens verified per row, drafting seconds or None, seconds inside it,
        #: whether it dropped no work launched ahead for it)
        self._cycle: tuple | None = None
        #: the next step's k, chosen when this step ended (so that the work launched ahead is
        #: the work that runs): (the batch's sequence ids, k), or None
        self._chosen: tuple[tuple[int, ...], int] | None = None
        #: seconds spent in prefills since the last step began (not that step's cost)
        self._outside = 0.0

    def _once(self, kind: str, message: str) -> None:
        self.failures[kind] = self.failures.get(kind, 0) + 1
        if message not in self._said:
            self._said.add(message)
            log.warning("%s (logged once; the engine serves on)", message)

    # -- sequences entering and leaving -----------------------------------------------
    def start(self, seqs: list[Sequence]) -> None:
        """Prefill new sequences: everything but the last token goes into the KV cache.

        A proposer that declared ``hidden_layers`` gets the prefill's hidden states too:
        ``add_request(view, hidden_states={layer: [len - 1, H]})``. A proposer that fails
        to take a request leaves it without speculation.
        """
        if not seqs:
            return
        t0 = time.perf_counter()
        try:
            self._start(seqs)
        finally:
            self._outside += time.perf_counter() - t0

    def idle(self) -> None:
        """Nothing runs until the next request: the time until the next step is no step's."""
        self._cycle = None
        self._chosen = None

    def _start(self, seqs: list[Sequence]) -> None:
        scored = [s for s in seqs if s.params.prompt_logprobs is not None and s.prompt_logprobs is None]
        plain = [s for s in seqs if s not in scored]
        hidden = {}
        if plain:
            ids, prompts = [s.seq_id for s in plain], [s.token_ids[:-1] for s in plain]
            if self.hidden_layers:  # {seq_id: {layer: [len - 1, H]}} for proposers that asked
                hidden.update(self.target.add_many(ids, prompts, hidden_layers=self.hidden_layers))
            else:
                self.target.add_many(ids, prompts)
        for s in scored:  # one at a time: their logits are scored chunk by chunk
            sink, entries = prompt_scorer(s.prompt_token_ids, s.params.prompt_logprobs)
            hidden.update(self.target.add_many([s.seq_id], [s.token_ids[:-1]], hidden_layers=self.hidden_layers,
                                               logits_sink=lambda sid, start, logits, f=sink: f(start, logits)))
            s.prompt_logprobs = [None] + [entries[i] for i in range(1, s.num_prompt_tokens)]
        if not self.stateful or not self.k:
            return
        for s in seqs:
            if not s.speculative:
                continue
            try:
                if self.wants_hidden:
                    self.proposer.add_request(s.view(), hidden_states=hidden[s.seq_id] if hidden else {})
                else:
                    self.proposer.add_request(s.view())
            except Exception as exc:
                self._drop_from_proposer([s], f"proposer {type(self.proposer).__name__}.add_request failed "
                                              f"({type(exc).__name__}: {exc}); the request runs without speculation")

    def finish(self, seq: Sequence) -> None:
        """Free a sequence's KV and proposer state."""
        if self._ahead is not None:
            self._ahead.bases.pop(seq.seq_id, None)
        self.target.remove(seq.seq_id)
        if self.stateful and seq.speculative:
            try:
                self.proposer.remove_request(seq.seq_id)
            except Exception as exc:
                self._once("proposer", f"proposer {type(self.proposer).__name__}.remove_request failed: {exc!r}")

    def _drop_from_proposer(self, seqs: list[Sequence], message: str) -> None:
        self._once("proposer", message)
        for s in seqs:
            if not s.speculative:
                continue
            s.speculative = False
            if self.stateful:
                try:
                    self.proposer.remove_request(s.seq_id)
                except Exception:
                    pass  # its state is already broken; the request no longer uses it

    # -- one step ---------------------------------------------------------------------
    def step(self, seqs: list[Sequence], ahead: bool = True) -> None:
        """Advance every sequence in ``seqs`` by one verify step (1..k+1 tokens each).

        ``ahead=False`` (the engine: requests are waiting, so the next batch will likely
        differ) runs nothing ahead for the next step even with :attr:`overlap`.

        Rows that fail are finished with ``finish_reason="error"`` (``seq.fail``); the
        caller frees them with :meth:`finish`. Exceptions out of the target forward
        itself propagate: they concern the whole batch (the engine decides).
        """
        B = len(seqs)
        t_start = time.perf_counter()
        self._observe_cycle(t_start)
        dropped = self.ahead_dropped
        sampling = self._sampling(seqs)
        k_step = self._k_for(seqs)
        if k_step and self.trees:  # a tree is drafted whole or not at all (the node budget is fixed)
            k_step = self.k
        self.k_counts[k_step] += 1
        self._steps += 1
        planned = self._claim_planned(seqs, k_step)
        if planned is not None:  # drafted and launched at the end of the last step (overlap)
            plan, out = planned.plan, planned.out
        else:
            plan = self._plan(seqs, sampling, k_step, timing=True)
            out = self._take_ahead(seqs, plan.k) or self.target.forward(
                [s.seq_id for s in seqs], plan.inputs, plan.num_tokens, self.hidden_layers, **plan.forward_kwargs())
        draft, rows, asked, drafted, depths, k = plan.draft, plan.rows, plan.asked, plan.drafted, plan.depths, plan.k
        tree, ids, draft_seconds = draft.tree, draft.token_ids, plan.draft_seconds
        # [B]: rows whose logits are all finite, not NaN/inf (padding positions compute on real
        # tokens: finite too); negated on the host
        finite = out.finite_rows()
        # [B, k+1, V] penalties, bias, min_tokens, bad_words, min_p per position (drafts
        # before each position count as generated); the raw logits when no row uses them
        logits = sampling.process_logits(out.logits, ids) if sampling.needs_processing else out.logits
        # the runner's argmax is the raw logits': only for unprocessed ones
        verdict, failed_rows = self._verify(logits, draft, sampling, out.argmax if logits is out.logits else None)
        if tree is not None and verdict.path is None:  # the plain-sampling fallback: nothing accepted
            verdict.path = torch.full_like(ids, -1)
        # the host synchronisation of the step (greedy verification has synced already);
        # the copy is queued before a forward run ahead, so it does not wait for that one
        to_host = _to_host(verdict, finite, draft.counts if tree is None else None)
        # the next drafts start on the device now, while the verdict is copied and read
        launched = self._draft_from_verdict(seqs, plan, verdict, out, ahead, failed_rows)
        # ... and the target's next forward on them, when the runner can place it from the device
        vf = self._forward_from_verdict(seqs, verdict, launched, failed_rows) if launched is not None else None
        if self.overlap and ahead and not k_step and self.length.varies and not failed_rows:
            self._choose_next(seqs)  # nothing was asked of the proposer: this step teaches the policy nothing
        if self.overlap and ahead and not k and self._may_run_ahead(seqs, failed_rows):
            out = _keep_states(out)
            self._run_ahead(seqs, verdict.token_ids[:, :1])
        both, counts = to_host()
        accepted = [r[0] for r in both]
        # what each row really drafted, for the metrics (drafts made on the device: their counts
        # came with the verdict; every row verified ``drafted`` positions all the same)
        counted = drafted if counts is None else [min(d, c) for d, c in zip(drafted, counts)]
        width = verdict.token_ids.shape[1]
        hidden = out.hidden_states
        raw = out.logits
        if tree is not None:
            if vf is None:  # (a forward launched from the verdict has moved the paths on the device)
                self._keep_paths(seqs, accepted, [r[2 + width:] for r in both],
                                 [not r[1] or b in failed_rows for b, r in enumerate(both)])
            if hidden and not launched:  # the accepted path's states in path order, as for a chain
                hidden = gather_path(hidden, verdict.path)
            if any(s.params.logprobs is not None for s in seqs):  # logits along the path, in path order
                cols = torch.cat([torch.zeros_like(verdict.path[:, :1]), verdict.path + 1], dim=1).clamp_min(0)
                raw = raw.gather(1, cols.to(raw.device).unsqueeze(-1).expand(-1, -1, raw.shape[-1]))
        if launched:  # the proposer drafted every row from the verdict and read the states then
            hidden = {}
        scored = self._logprobs(seqs, raw, verdict)
        new_lengths = []
        for b, s in enumerate(seqs):
            a, row_bad, tokens = accepted[b], not both[b][1], both[b][2: 2 + width]
            old_len = len(s.token_ids)
            new_lengths.append(old_len + a + 1)
            if row_bad or b in failed_rows:
                s.fail(failed_rows.get(b) or "the model produced NaN/inf logits for this request (numerical "
                       "overflow: try dtype='float32' or bfloat16 instead of float16)")
                continue
            # KV kept: old tokens plus the accepted drafts (the new last token has none yet);
            # without drafts there is nothing to drop (and a forward run ahead holds one more);
            # a forward launched from the verdict holds its tokens after them
            if vf is not None:
                vf.bases[s.seq_id] = old_len + a
                self.target.truncate(s.seq_id, old_len + a + vf.q)
            elif drafted[b] or tree is not None:
                self.target.truncate(s.seq_id, old_len + a)
            s.metrics.record_step(counted[b], a, depths[b] if tree is not None and drafted[b] else None)
            if asked[b]:
                self.length.observe_acceptance(s, asked[b], counted[b], a)
            try:
                kept = s.append(tokens[: a + 1], self.tokenizer)
            except Exception as exc:  # a detokeniser or stop-string failure is this request's
                s.fail(f"stop check / detokenisation failed: {type(exc).__name__}: {exc}")
                continue
            if b in scored:
                s.record_logprobs(scored[b][:kept])
        # the proposer learns every step it drafted for; a step without drafts only
        # concerns a head that needs the target's states of every token
        observed = rows if rows or not self.wants_hidden else \
            [b for b, s in enumerate(seqs) if s.speculative and self._cap(s)]
        self._observe(seqs, observed, accepted, new_lengths, hidden)
        planned = False
        if self.overlap and ahead and not failed_rows:
            next_k = k_step
            if self.length.varies and not any(s.finished for s in seqs):
                next_k = self._chosen[1] if self._chosen is not None else self._choose_next(seqs)
            if next_k and self._may_plan_ahead(seqs):
                planned = True
                self._plan_ahead(seqs, next_k, vf)  # the next step's drafts and forward, before the engine's work
            elif not next_k and k and self._may_run_ahead(seqs, failed_rows):
                # a plain step follows this speculative one: its forward on each row's new last token
                last = on_device([[s.token_ids[-1]] for s in seqs], self.target.device)
                self._run_ahead(seqs, last)
        if launched is not None and not planned:  # drafts started from the verdict that no step will verify
            if vf is not None:
                self._drop_verdict_forward(seqs, vf)
            self._rewind([s.seq_id for s in seqs if not s.finished])
        # a step that dropped work launched ahead for it (a switch the policy did not foresee,
        # a batch that changed) also paid for that work: its cycle is not what its kind costs
        clean = self.ahead_dropped == dropped
        self._cycle = (t_start, B, k_step, k + 1, draft_seconds, time.perf_counter() - t_start, clean)

    def _k_for(self, seqs: list[Sequence]) -> int:
        """This step's k: the one chosen when the last step ended if the batch is the same,
        less rows that finished (the work launched ahead was made for it), else the length
        policy's choice now."""
        chosen, self._chosen = self._chosen, None
        if chosen is not None and {s.seq_id for s in seqs} <= set(chosen[0]):
            return chosen[1]
        return self._policy_k(seqs)

    def _choose_next(self, seqs: list[Sequence]) -> int:
        """Choose the next step's k now (a policy whose k varies), for the same batch: what
        runs ahead is then drafted for the k that step will have, and a switch between
        speculative and plain steps drops nothing launched ahead."""
        k = self._policy_k(seqs)
        self._chosen = (tuple(s.seq_id for s in seqs), k)
        return k

    def _policy_k(self, seqs: list[Sequence]) -> int:
        """The length policy's k for ``seqs``, within the engine's."""
        return min(self.length.choose(seqs), self.k) if self.k else 0

    #: a cycle longer than the step's own time by more than this is a pause (a collection,
    #: the engine waiting for work), not what the step costs
    max_gap = 0.25

    def _observe_cycle(self, now: float) -> None:
        """Tell the length policy what the last step cost: the wall time from its start to
        this one's, less the prefills in between. That is the step's own time plus
        whatever the engine and its callers do per step (outputs, streaming, scheduling,
        detokenisation, a server's event loop holding the interpreter): at high load a
        server spends more there than in the step, and more for a step that emits
        several tokens per row, so a policy fed the step alone misjudges speculation."""
        cycle, self._cycle = self._cycle, None
        outside, self._outside = self._outside, 0.0
        if cycle is None:
            return
        t0, B, k_step, q, draft_seconds, inside, clean = cycle
        seconds = now - t0 - outside
        if seconds > inside + self.max_gap:
            seconds = inside
        self.length.observe_step(B, k_step, q, draft_seconds, seconds if clean else None)

    def _sampling(self, seqs: list[Sequence]) -> SamplingBatch:
        return SamplingBatch.from_params([s.params for s in seqs], [s.generator for s in seqs], self.target.device,
                                         histories=[(s.token_ids, s.num_prompt_tokens) for s in seqs],
                                         rules=[s.rules for s in seqs], needs=any(s.processed for s in seqs),
                                         keys=[(s.seed or 0, len(s.token_ids)) for s in seqs])

    def _plan(self, seqs: list[Sequence], sampling: SamplingBatch, k_step: int, timing: bool) -> "_Plan":
        """The step's drafts (capped per row, masked where unusable) and the target's inputs."""
        B = len(seqs)
        # with trees, rows whose logits processors read the history (penalties, min_tokens,
        # bad words...) decode without drafts: their drafts' histories are tree paths
        rows = [b for b, s in enumerate(seqs) if s.speculative and self._cap(s)
                and not (self.trees and s.processed)] if k_step else []
        timed = timing and bool(rows) and self.length.times_drafting and (self._steps % self.time_every == 0 or self.length.needs_timing(B))
        if timed:
            _sync(self.target.device)
        t_draft = time.perf_counter()
        draft = self._propose(seqs, rows, sampling, k_step)
        if timed:
            _sync(self.target.device)
        draft_seconds = time.perf_counter() - t_draft if timed else None
        tree = draft.tree
        # drafts each row was asked for (what its acceptance is measured against) and got,
        # capped so no row drafts past what it may emit or its own k
        asked, drafted, depths = [0] * B, [0] * B, None
        if draft.token_ids.shape[1]:
            lengths = draft.lengths if draft.lengths is not None else draft.num_tokens.tolist()
            if tree is None:
                drafted = [min(n, max(s.room() - 1, 0), self._cap(s)) for n, s in zip(lengths, seqs)]
            else:  # a tree keeps its nodes; those deeper than a row may emit are never accepted
                drafted = [n if s.room() > 1 else 0 for n, s in zip(lengths, seqs)]
                depths = [min(tree.depth_bound, s.room() - 1) if n else 0 for n, s in zip(drafted, seqs)]
        for b in rows:
            asked[b] = drafted[b] if tree is not None else min(k_step, max(seqs[b].room() - 1, 0), self._cap(seqs[b]))
        k = draft.token_ids.shape[1]
        ids = draft.token_ids
        if k:
            # token ids outside the vocabulary would crash the embedding: such drafts are dropped
            V = self.target.vocab_size
            keep = None  # None: every drafted id stays
            if ids.device.type != "cpu":
                # ids past the vocabulary become -1 where something reads them by index (draft
                # probabilities, penalties' histories); negative ids are never accepted nor
                # embedded (the inputs are clamped), and an argmax never equals an id past the
                # vocabulary: a plain greedy step needs no check (two launches less)
                if not (sampling.all_greedy and not sampling.needs_processing and draft.probs is None):
                    keep = ids < V
            else:  # free to read on the host: one op, and no mask unless an id is out of range
                lo, hi = ids.aminmax()
                if lo < -1 or hi >= V:
                    self._once("draft", f"proposer {type(self.proposer).__name__} drafted token ids outside the "
                                        f"vocabulary (0..{V - 1}); those drafts are dropped")
                    keep = (ids >= 0) & (ids < V)
            # and, where a row keeps fewer drafts than it has, its first ones
            if min(drafted) < k:  # (the usual step keeps all: no mask to build and ship)
                cap = on_device(drafted, ids.device).view(B, 1)
                keep = _both(keep, torch.arange(k, device=ids.device).view(1, k) < cap)
            if tree is not None and min(depths) < tree.depth_bound:
                keep = _both(keep, tree.depth.to(ids.device) <= on_device(depths, ids.device).view(B, 1))
            if draft.probs is not None:  # drafts whose distribution is not one cannot be verified losslessly
                q = draft.probs  # finite and >= 0 (NaN fails both comparisons)
                ok = ((q >= 0) & (q < float("inf"))).flatten(1).all(-1, keepdim=True)
                if q.device.type == "cpu" and not bool(ok.all()):
                    self._once("draft", f"proposer {type(self.proposer).__name__} returned draft probabilities "
                                        "with NaN/inf or negative entries; those rows' drafts are dropped")
                keep = _both(keep, ok.to(ids.device))
            if keep is not None:
                ids = torch.where(keep, ids, -1)
        draft.token_ids = ids
        last = [s.token_ids[-1] for s in seqs]
        if self.last_on_host:  # the runner stages the last tokens with its metadata, clamps the drafts
            inputs = ids
        else:  # [B, k+1]: last token, then drafts; built where the drafts live (host for
            # model-free proposers, so the runner ships everything in one copy)
            inputs = torch.cat([on_device(last, ids.device).view(B, 1), ids.clamp(0, self.target.vocab_size - 1)],
                               dim=1)
        return _Plan(draft, rows, asked, drafted, depths, k, inputs, [n + 1 for n in drafted], draft_seconds,
                     last if self.last_on_host else None)

    def _keep_paths(self, seqs: list[Sequence], accepted: list[int], paths: list[list[int]],
                    failed: list[bool]) -> None:
        """Move each accepted tree path's K/V into consecutive positions (the rest is then
        dropped by the truncation that follows); failed rows are left alone."""
        moves = [(s.seq_id, *path_moves(p, a, len(s.token_ids) - 1))
                 for s, a, p, f in zip(seqs, accepted, paths, failed) if not f]
        moves = [m for m in moves if m[1]]
        if moves:
            self.target.move_kv([m[0] for m in moves], [m[1] for m in moves], [m[2] for m in moves])

    def _cap(self, s: Sequence) -> int:
        """The most drafts per step for ``s`` (its own num_speculative_tokens, else the engine's)."""
        return self.k if s.max_k is None else min(s.max_k, self.k)

    def _logprobs(self, seqs: list[Sequence], raw: torch.Tensor, verdict: Verdict) -> dict[int, list]:
        """{row: per emitted position (token, logprob, rank, top ids, top logprobs)} for rows
        that asked for logprobs: from the target's raw logits (speculum.logprobs)."""
        rows = [b for b, s in enumerate(seqs) if s.params.logprobs is not None and not s.finished]
        if not rows:
            return {}
        idx = on_device(rows, raw.device)
        top_n = max(seqs[b].params.logprobs for b in rows)
        scored = position_logprobs(raw[idx], verdict.token_ids.to(raw.device)[idx], top_n)
        return {b: [(t, lp, rank, ids[: seqs[b].params.logprobs], lps[: seqs[b].params.logprobs])
                    for t, lp, rank, ids, lps in row] for b, row in zip(rows, scored)}

    def _propose(self, seqs: list[Sequence], rows: list[int], sampling: SamplingBatch, k: int) -> Draft:
        """Up to ``k`` drafts for the speculative ``rows``, scattered into a [B, <=k] draft (others -1)."""
        B = len(seqs)
        if not rows:
            return Draft.empty(B)
        sub = sampling if len(rows) == B else sampling.select(rows)
        name = type(self.proposer).__name__
        try:
            draft = self.proposer.propose(ProposeBatch([seqs[b].view() for b in rows], k, sub))
            problem = _malformed(draft, len(rows), k, self.target.vocab_size)
        except RowError as exc:
            for r in exc.rows:
                if 0 <= r < len(rows):
                    seqs[rows[r]].fail(f"the proposer failed on this request: {exc}")
            self._drop_from_proposer([seqs[b] for b in rows], f"proposer {name} failed on some rows ({exc}); "
                                     "the step runs without drafts")
            return Draft.empty(B)
        except Exception as exc:
            what = "the step runs as plain decoding" + (
                "; its requests of this step continue without speculation (its state may be half updated)"
                if self.stateful else "")
            msg = f"proposer {name} raised {type(exc).__name__}: {exc}; {what}"
            if self.stateful:
                self._drop_from_proposer([seqs[b] for b in rows], msg)
            else:
                self._once("proposer", msg)
            return Draft.empty(B)
        if problem is not None:
            msg = f"proposer {name} returned a malformed draft ({problem}); the step runs as plain decoding"
            if self.stateful:
                self._drop_from_proposer([seqs[b] for b in rows], msg)
            else:
                self._once("draft", msg)
            return Draft.empty(B)
        return draft if len(rows) == B else draft.scatter(rows, B)

    def _verify(self, logits: torch.Tensor, draft: Draft, sampling: SamplingBatch,
                argmax: torch.Tensor | None = None) -> tuple[Verdict, dict[int, str]]:
        """The verifier's verdict, or plain sampling of position 0 if it raised. ``argmax``:
        the logits' argmax [B, k+1] when the runner made it, for a verifier that takes it."""
        failed: dict[int, str] = {}
        takes = argmax is not None and self.use_runner_argmax and getattr(self.verifier, "takes_argmax", False)
        kw = {"argmax": argmax} if takes else {}
        try:
            return self.verifier.verify(logits, draft, sampling, **kw), failed
        except RowError as exc:
            failed = {r: f"the verifier failed on this request: {exc}" for r in exc.rows}
        except Exception as exc:
            self._once("verifier", f"verifier {type(self.verifier).__name__} raised {type(exc).__name__}: {exc}; "
                                   "the step takes no draft (plain sampling of the target)")
        return plain_verdict(logits, sampling), failed

    def _observe(self, seqs, rows, accepted, new_lengths, hidden) -> None:
        rows = [b for b in rows if seqs[b].speculative and seqs[b].finish_reason != "error"]
        if not rows:
            return
        B = len(seqs)
        if hidden and len(rows) != B:  # (an asynchronous copy of the index: no synchronisation)
            idx = on_device(rows, next(iter(hidden.values())).device)
            hidden = {layer: h[idx] for layer, h in hidden.items()}
        fb = StepFeedback(seq_ids=[seqs[b].seq_id for b in rows], num_accepted=[accepted[b] for b in rows],
                          new_lengths=[new_lengths[b] for b in rows], hidden_states=hidden or None)
        try:
            self.proposer.observe(fb)
        except Exception as exc:
            self._drop_from_proposer([seqs[b] for b in rows],
                                     f"proposer {type(self.proposer).__name__}.observe raised {type(exc).__name__}: "
                                     f"{exc}; its requests continue without speculation")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@attrs.define
class _Plan:
    """A step's drafts and the target's inputs (:meth:`DraftVerifyLoop._plan`)."""

    draft: Draft
    #: rows asked to draft; per row the drafts asked for and kept; tree depth caps (trees)
    rows: list[int]
    asked: list[int]
    drafted: list[int]
    depths: list[int] | None
    #: the draft's width, the inputs [B, k+1] and tokens per row, drafting time (if timed)
    k: int
    inputs: torch.Tensor
    num_tokens: list[int]
    draft_seconds: float | None
    #: each row's last token, for a runner that takes them on the host (``inputs`` are then
    #: the drafts alone, [B, k]); None: ``inputs`` start with them
    last: list[int] | None = None

    def forward_kwargs(self) -> dict:
        """The target forward's keywords besides the inputs: the tree, the last tokens."""
        kw = {} if self.draft.tree is None else {"tree": self.draft.tree}
        if self.last is not None:
            kw["last_tokens"] = self.last
        return kw


def _keep_states(out: ForwardOutput) -> ForwardOutput:
    """``out`` with its hidden states copied: a runner replaying CUDA graphs returns views of
    its static output buffers, which the next forward (launched ahead, before the head reads
    them in :meth:`DraftVerifyLoop._observe`) overwrites. The copies are queued first on the same
    stream, so they read this step's values. [B, 1, H] per layer: a few kernels."""
    if not out.hidden_states:
        return out
    return attrs.evolve(out, hidden_states={l: h.clone() for l, h in out.hidden_states.items()})


def _to_host(verdict: Verdict, finite: torch.Tensor, counts: torch.Tensor | None = None):
    """Start copying rows of [num_accepted, finite, tokens..., path...] (the path of a tree
    verdict only) to the host, in as few launches as the verdict allows, and ``counts`` [B]
    (a draft's device counts, :attr:`Draft.counts`) beside them; returns a function that
    waits for the copy (and nothing queued after it) and gives (the rows as lists, the
    counts as a list or None)."""
    # [count | tokens (| path)]: a greedy verdict's own tensor (nothing to join), else joined now
    wait = _copy(verdict.as_rows(), finite, *(() if counts is None else (counts,)))

    def read():
        rows, flags, *rest = wait()
        return [[r[0], int(f), *r[1:]] for r, f in zip(rows, flags)], (rest[0] if rest else None)
    return read


_streams: dict[int, torch.cuda.Stream] = {}


def _copy(*ts: torch.Tensor):
    """``[t.tolist() for t in ts]`` as copies started now (one event after them per device)
    and waited for when the returned function is called."""
    if all(t.device.type != "cuda" for t in ts):
        return lambda: [t.tolist() for t in ts]
    hosts, devices = [], []
    for t in ts:
        cuda = t.device.type == "cuda"
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
        host.copy_(t, non_blocking=cuda)
        hosts.append(host)
        if cuda and t.device.index not in devices:
            devices.append(t.device.index)
    events = []
    for index in devices:
        # the engine's stream, looked up once per device (a lookup costs ~20 us of host time a step)
        stream = _streams.get(index)
        if stream is None:
            stream = _streams[index] = torch.cuda.current_stream(index)
        events.append(torch.cuda.Event())
        events[-1].record(stream)

    def wait():
        for e in events:
            e.synchronize()
        return [h.tolist() for h in hosts]
    return wait


def _both(mask: torch.Tensor | None, other: torch.Tensor) -> torch.Tensor:
    """``mask & other``, where a mask of None keeps everything."""
    return other if mask is None else mask & other


def _malformed(draft, rows: int, k: int, vocab_size: int) -> str | None:
    """What is wrong with a proposer's draft for ``rows`` rows, or None (host-side checks)."""
    if not isinstance(draft, Draft) or not isinstance(draft.token_ids, torch.Tensor):
        return f"expected a Draft with a token_ids tensor, got {type(draft).__name__}"
    t = draft.token_ids
    if t.dim() != 2 or t.shape[0] != rows or t.shape[1] > k:
        return f"token_ids of shape {tuple(t.shape)}; expected [{rows}, <= {k}]"
    if t.dtype not in (torch.int64, torch.int32):
        return f"token_ids of dtype {t.dtype}; expected int64"
    if draft.probs is not None and tuple(draft.probs.shape) != (rows, t.shape[1], vocab_size):
        return f"probs of shape {tuple(draft.probs.shape)}; expected [{rows}, {t.shape[1]}, {vocab_size}]"
    if draft.lengths is not None and (len(draft.lengths) != rows or any(not 0 <= n <= t.shape[1] for n in draft.lengths)):
        return f"lengths {list(draft.lengths)[:8]} do not fit token_ids of shape {tuple(t.shape)}"
    if draft.tree is not None:
        try:
            draft.tree.check(t)
        except (TypeError, ValueError) as exc:
            return str(exc)
    return None


def plain_verdict(logits: torch.Tensor, sampling: SamplingBatch) -> Verdict:
    """No draft accepted: each row's token sampled from the target at position 0."""
    from speculum.verifiers.rejection import rejection_sample
    B = logits.shape[0]
    p = processed_probs(logits[:, :1], sampling.temperature, sampling.top_k, sampling.top_p,
                        sampling.flags(logits.shape[-1]))
    v = rejection_sample(p, None, torch.empty(B, 0, dtype=torch.int64, device=logits.device), sampling.generators)
    pad = torch.full((B, logits.shape[1] - 1), -1, dtype=torch.int64, device=v.token_ids.device)
    return Verdict(token_ids=torch.cat([v.token_ids, pad], dim=1), num_accepted=v.num_accepted)
