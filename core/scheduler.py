"""Which sequences run the next step: admission and preemption over the KV cache groups.

Each step a running sequence of ``L`` tokens may grow to ``L + k`` tokens of KV in every
cache group (the target writes its last token and up to ``k`` drafts; a draft cache
runs up to ``k - 1`` positions ahead), never past that group's ``max_model_len`` (the
loop drafts fewer tokens near the limit). The scheduler reserves exactly that, in every
paged group (target, draft model, draft head), before the step runs:

- running sequences that no longer fit are preempted, newest first: their KV is freed and
  they go back to the front of the queue, to be recomputed (prefilled again with their
  output so far) when room returns;
- waiting sequences are admitted first come, first served while blocks, ``max_num_seqs``
  and ``max_num_batched_tokens`` allow; a long prompt at the head waits rather than
  being overtaken, so it is never starved;
- a sequence that could not fit even in an empty cache fails on its own
  (``finish_reason="error"``) instead of blocking the queue.

With load-aware speculation (``num_speculative_tokens_per_batch_size``) a step may draft
fewer than ``k`` tokens; the reservation stays at ``k`` (the engine's
``num_speculative_tokens``, or a request's own smaller one). The step's k is chosen after
admission, from the batch that runs, so a reservation that followed it would admit
sequences that a longer step must preempt again; the price is at most one block per
speculative sequence.
"""

from __future__ import annotations

import collections
import logging
from typing import Callable, Sequence as Seq

import attrs

from speculum.kv import PagedKVAllocator, blocks_for
from speculum.sequence import Sequence

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class ScheduleResult:
    """What :meth:`Scheduler.schedule` changed this step."""

    admitted: list[Sequence] = attrs.field(factory=list)
    preempted: list[Sequence] = attrs.field(factory=list)
    #: sequences that can never be served, with the reason (already out of every queue)
    failed: list[tuple[Sequence, str]] = attrs.field(factory=list)


class Scheduler:
    """FIFO admission with preemption by recompute, over the paged cache groups ``caches``.

    ``release(seq)`` frees a sequence's KV and proposer state (the loop's ``finish``);
    the scheduler calls it for preempted sequences before it admits others.
    ``lookahead``: draft tokens per step (k; 0 without speculation). With no paged
    cache (the transformers runner) only ``max_num_seqs`` and the token budget bound a step.
    """

    def __init__(self, caches: Seq[PagedKVAllocator], release: Callable[[Sequence], None], *,
                 max_num_seqs: int, lookahead: int = 0, max_num_batched_tokens: int | None = None):
        self.caches = list(caches)
        self.release = release
        self.max_num_seqs = max_num_seqs
        self.lookahead = lookahead
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- queues -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> bool:
        """Take ``seq`` out of whichever queue holds it; True if it was running."""
        if seq in self.running:
            self.running.remove(seq)
            return True
        try:
            self.waiting.remove(seq)
        except ValueError:
            pass
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- KV arithmetic ------------------------------------------------------------------
    def tokens_after_step(self, seq: Sequence, cache: PagedKVAllocator) -> int:
        """Tokens of KV ``seq`` may hold in ``cache`` after its next step."""
        k = (self.lookahead if seq.max_k is None else min(seq.max_k, self.lookahead)) if seq.speculative else 0
        n = len(seq.token_ids) + k
        return min(n, cache.max_model_len) if cache.max_model_len else n

    def blocks_needed(self, seq: Sequence, cache: PagedKVAllocator) -> int:
        return cache.blocks_needed(seq.seq_id, self.tokens_after_step(seq, cache))

    def _never_fits(self, seq: Sequence) -> str | None:
        for c in self.caches:
            need = blocks_for(self.tokens_after_step(seq, c), c.block_size)
            if need > c.num_usable_blocks:
                return (f"request {seq.request_id} needs {need} KV blocks ({self.tokens_after_step(seq, c)} tokens) "
                        f"in the {c.group} cache, which holds {c.num_usable_blocks}; raise kv_cache_memory or "
                        "shorten the prompt")
        return None

    def _roomy(self) -> bool:
        """Fast path: every running sequence fits its worst case in every cache."""
        for c in self.caches:
            worst = blocks_for(self.lookahead + 1, c.block_size) + 1
            if c.num_free_blocks < len(self.running) * worst:
                return False
        return True

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> ScheduleResult:
        result = ScheduleResult()
        if not self.waiting and self._roomy():
            return result
        # blocks the running sequences need for their next step, per cache: summed once, a
        # preempted sequence's share taken off (at 512 sequences the sums were most of a step's
        # scheduling)
        need = {id(c): sum(self.blocks_needed(s, c) for s in self.running) for c in self.caches}
        while self.running and any(need[id(c)] > c.num_free_blocks for c in self.caches):
            victim = self.running.pop()
            for c in self.caches:
                need[id(c)] -= self.blocks_needed(victim, c)
            self.release(victim)
            if len(self.running) == 0 and self._never_fits(victim):
                result.failed.append((victim, self._never_fits(victim)))
                continue
            self.waiting.appendleft(victim)
            result.preempted.append(victim)
            self.num_preemptions += 1
            log.warning("KV cache full: preempted request %s (will recompute)", victim.request_id)
        budget = {id(c): c.num_free_blocks - need[id(c)] for c in self.caches}
        prefill_tokens = 0
        while self.waiting and len(self.running) + len(result.admitted) < self.max_num_seqs:
            s = self.waiting[0]
            why = self._never_fits(s)
            if why is not None:
                self.waiting.popleft()
                result.failed.append((s, why))
                continue
            if (self.max_num_batched_tokens is not None and result.admitted
                    and prefill_tokens + len(s.token_ids) > self.max_num_batched_tokens):
                break
            need = {id(c): self.blocks_needed(s, c) for c in self.caches}
            if any(need[i] > budget[i] for i in budget):
                break  # first come, first served: wait for room (it fits an empty cache)
            for i in budget:
                budget[i] -= need[i]
            prefill_tokens += len(s.token_ids)
            result.admitted.append(self.waiting.popleft())
        self.running += result.admitted
        return result

    def check(self) -> None:
        """Invariants, for tests and soaks: every cache's blocks are free or held once,
        and only running sequences hold any."""
        running = {s.seq_id for s in self.running}
        for c in self.caches:
            c.check()
            stray = (set(c.owners().values()) | set(c.seq_ids())) - running
            if stray:
                raise AssertionError(f"{c.group}: KV held for sequences that are not running: {sorted(stray)[:5]}")
