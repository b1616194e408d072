"""The asynchronous front of the engine: one background thread owns the ``LLM``.

The engine is not thread safe, so nothing but the engine thread ever touches it. Request
coroutines talk to that thread through a queue of commands (add, abort); the thread
answers each request through its own ``asyncio.Queue``, the updates of one step handed
over together (one ``loop.call_soon_threadsafe`` per step, not one per request)::

    HTTP handlers --add/abort--> inbox --> engine thread: add_request / abort_request
                                                          step()
    per-request asyncio.Queue <--EngineUpdate------------ (new tokens, final output)

A request that cannot be added (``RequestError`` and the like) gets an error update and
never reaches the engine. A request the engine fails (``finish_reason="error"``) gets an
error update (HTTP 500 with the reason); the others go on. If ``step()`` itself raises
(the device is gone: ``EngineDeadError``), every request the engine holds is failed with
an error to its client and new requests are refused with 503.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any

import attrs

from speculum.metrics import SpecDecodeMetrics
from speculum.sampling import SamplingParams

log = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """The engine failed while running a step that included this request."""


class EngineStoppedError(RuntimeError):
    """The server is shutting down (or its engine thread is gone)."""


@attrs.define(eq=False)
class EngineUpdate:
    """What the engine thread hands a request: ``added``, ``output`` or ``error``.

    ``output`` carries the token ids produced since the previous update; the final one
    (``finished=True``) adds the engine's text, the finish reason and the metrics.
    """

    kind: str
    new_token_ids: list[int] = attrs.field(factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    #: final text (finished only; the engine's, with stop strings cut)
    text: str | None = None
    #: every output token id (finished only)
    token_ids: list[int] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    #: the request's speculation counts (finished only)
    metrics: SpecDecodeMetrics | None = None
    #: (drafted, accepted) per verify step, when step records are on (finished only)
    steps: list[tuple[int, int]] | None = None
    error: BaseException | None = None
    #: per new token ``{token id: Logprob}`` when the request asked for logprobs
    new_logprobs: list | None = None
    #: every token's logprobs, the sample's cumulative logprob and the prompt's logprobs
    #: (finished only, when asked)
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list | None = None


@attrs.define(eq=False)
class _Live:
    """Engine-thread bookkeeping of one request."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    stream: bool
    num_prompt_tokens: int
    arrival: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_sent: int = 0
    metrics: SpecDecodeMetrics | None = None
    steps: list[tuple[int, int]] | None = None
    prev_drafted: int = 0
    prev_accepted: int = 0


def deliver(loop: asyncio.AbstractEventLoop, items: list) -> None:
    """Put each ``(asyncio.Queue, update)`` of ``items`` on its queue, in order, from the
    engine thread: one ``call_soon_threadsafe`` (one wake-up of ``loop``) for all of them."""
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # the client's event loop is closed: nobody to tell
        pass


def _put_all(items: list) -> None:
    for q, update in items:
        q.put_nowait(update)


class RequestStream:
    """A request's side of the conversation: ``await stream.get()`` the next update."""

    def __init__(self, request_id: str, q: asyncio.Queue):
        self.request_id = request_id
        self._queue = q
        self.finished = False

    async def get(self) -> EngineUpdate:
        update = await self._queue.get()
        self._note(update)
        return update

    def get_nowait(self) -> EngineUpdate | None:
        """The next update if one is already queued (to merge several into one chunk)."""
        try:
            update = self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None
        self._note(update)
        return update

    def _note(self, update: EngineUpdate) -> None:
        if update.finished or update.kind == "error":
            self.finished = True


class AsyncEngine:
    """Serves an :class:`~speculum.engine.LLM` to asyncio code from one owner thread.

    ``metrics``: a :class:`~speculum.server.metrics.ServerMetrics` (or None) updated from
    the engine thread. ``record_steps``: keep (drafted, accepted) per verify step of each
    request (for ``--per-request-spec-decode-metrics detailed``); off, it costs nothing.
    """

    def __init__(self, llm: Any, *, metrics: Any = None, record_steps: bool = False,
                 idle_wait_s: float = 0.5):
        self.llm = llm
        self.metrics = metrics
        self.record_steps = record_steps
        self.idle_wait_s = idle_wait_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        # engine-thread state only
        self._live: dict[str, _Live] = {}
        #: updates of the current step, handed over together at its end (:meth:`_flush`):
        #: at 64 requests a wake-up of the event loop per request per step cost the
        #: server more host time than the step's own bookkeeping
        self._outbox: list[tuple[_Live, EngineUpdate]] = []
        self.num_step_failures = 0

    # -- lifecycle (any thread) -------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="speculum-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the thread; requests still held get an error (the server is stopping)."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_live_requests(self) -> int:
        """Requests the engine thread holds (added, not yet finished or aborted)."""
        return len(self._live)

    # -- requests (asyncio side) ------------------------------------------------------
    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams, *,
                          stream: bool, num_prompt_tokens: int, arrival: float | None = None) -> RequestStream:
        """Queue a request and wait until the engine thread accepted it.

        Raises what ``LLM.add_request`` raised (``RequestError`` for a bad request), or
        :class:`EngineStoppedError`. ``stream=False`` sends only the final output.
        """
        if not self.is_alive or self._stopping:
            raise EngineStoppedError("the engine is not running (the server is stopping)")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        live = _Live(request_id, loop, q, stream, num_prompt_tokens,
                     arrival if arrival is not None else time.perf_counter())
        self._send(("add", live, prompt, params))
        rs = RequestStream(request_id, q)
        try:
            first = await rs.get()
        except BaseException:  # cancelled while waiting (client gone, server stopping)
            self.abort(request_id)
            raise
        if first.kind == "error":
            raise first.error
        return rs

    def abort(self, request_id: str) -> None:
        """Abort a request (thread safe, idempotent): the engine frees its KV at once."""
        self._send(("abort", request_id))

    def _send(self, cmd: tuple) -> None:
        self._inbox.put(cmd)
        self._wake.set()

    # -- the engine thread --------------------------------------------------------------
    def _run(self) -> None:
        log.debug("engine thread started")
        while not self._stopping:
            if not self.llm.has_unfinished_requests():
                self._wake.wait(self.idle_wait_s)
            self._wake.clear()
            if self._stopping:
                break
            self._drain()
            self._flush()  # "added" before the step runs: a client's wait for it ends now
            if self.llm.has_unfinished_requests():
                self._step()
            self._flush()
            self._update_gauges()
        self._drain()
        self._fail_all(EngineStoppedError("the server is shutting down"), "abort")
        self._flush()
        log.debug("engine thread stopped")

    def _drain(self) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                self._add(*cmd[1:])
            else:
                self._abort(cmd[1])

    def _push(self, live: _Live, update: EngineUpdate) -> None:
        self._outbox.append((live, update))

    def _flush(self) -> None:
        """Hand the queued updates over: one wake-up per event loop, in the order queued."""
        if not self._outbox:
            return
        out, self._outbox = self._outbox, []
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for live, update in out:
            by_loop.setdefault(live.loop, []).append((live.queue, update))
        for loop, items in by_loop.items():
            deliver(loop, items)

    def _add(self, live: _Live, prompt: Any, params: SamplingParams) -> None:
        if self._stopping:
            self._push(live, EngineUpdate("error", error=EngineStoppedError("the server is shutting down")))
            return
        try:
            self.llm.add_request(live.request_id, prompt, params)
        except Exception as exc:  # a bad request never takes the engine down
            self._push(live, EngineUpdate("error", error=exc))
            return
        if self.record_steps:
            live.steps = []
        self._live[live.request_id] = live
        if self.metrics is not None:
            self.metrics.count_prompt_tokens(live.num_prompt_tokens)
        self._push(live, EngineUpdate("added"))

    def _abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is None:  # finished already, or never added
            return
        try:
            self.llm.abort_request(request_id)
        except Exception:
            log.exception("aborting request %s failed", request_id)
        self._record_finished(live, "abort", time.perf_counter())
        self._push(live, EngineUpdate("output", finished=True, finish_reason="abort",
                               num_prompt_tokens=live.num_prompt_tokens, num_output_tokens=live.num_sent,
                               metrics=live.metrics, steps=live.steps))
        log.debug("aborted request %s", request_id)

    def _step(self) -> None:
        try:
            outputs = self.llm.step()
        except Exception as exc:
            self.num_step_failures += 1
            log.exception("engine step failed; aborting the %d requests it held and serving on", len(self._live))
            self._fail_all(EngineStepError(f"the engine failed while running this request: {exc!r}"), "error")
            return
        now = time.perf_counter()
        generated = 0
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:  # not a server request (nobody to tell)
                continue
            ids = out.token_ids
            new = ids[live.num_sent:]
            lps = out.outputs[0].logprobs
            new_lps = list(lps[live.num_sent: len(ids)]) if lps is not None else None
            generated += len(new)
            if new:
                if live.first_token_time is None:
                    live.first_token_time = now
                    if self.metrics is not None:
                        self.metrics.observe_first_token(now - live.arrival)
                elif self.metrics is not None:
                    self.metrics.observe_inter_token(now - live.last_token_time)
                live.last_token_time = now
            live.num_sent = len(ids)
            live.metrics = out.metrics
            if live.steps is not None:
                m = out.metrics
                live.steps.append((m.num_draft_tokens - live.prev_drafted, m.num_accepted_tokens - live.prev_accepted))
                live.prev_drafted, live.prev_accepted = m.num_draft_tokens, m.num_accepted_tokens
            if out.finished and out.finish_reason == "error":  # this request failed; the engine serves on
                del self._live[out.request_id]
                self._record_finished(live, "error", now)
                self._push(live, EngineUpdate("error", error=EngineStepError(f"the request failed: {out.error}")))
                continue
            if out.finished:
                del self._live[out.request_id]
                reason = out.finish_reason or "stop"
                # counters first: a client that has its answer finds it in /metrics
                self._record_finished(live, reason, now)
                self._push(live, EngineUpdate(
                    "output", new_token_ids=list(new), finished=True, finish_reason=reason,
                    stop_reason=out.outputs[0].stop_reason, text=out.text, token_ids=list(ids),
                    num_prompt_tokens=live.num_prompt_tokens, num_output_tokens=len(ids),
                    metrics=out.metrics, steps=live.steps, new_logprobs=new_lps,
                    logprobs=list(lps) if lps is not None else None,
                    cumulative_logprob=out.outputs[0].cumulative_logprob, prompt_logprobs=out.prompt_logprobs))
            elif live.stream and new:
                self._push(live, EngineUpdate("output", new_token_ids=list(new), new_logprobs=new_lps))
        if self.metrics is not None and generated:
            self.metrics.count_step_tokens(generated)

    def _fail_all(self, error: BaseException, reason: str) -> None:
        now = time.perf_counter()
        for rid, live in list(self._live.items()):
            del self._live[rid]
            try:
                self.llm.abort_request(rid)
            except Exception:
                log.exception("aborting request %s failed", rid)
            self._record_finished(live, reason, now)
            self._push(live, EngineUpdate("error", error=error))

    def _record_finished(self, live: _Live, reason: str, now: float) -> None:
        if self.metrics is None:
            return
        try:
            self.metrics.record_finished(
                finish_reason=reason, num_prompt_tokens=live.num_prompt_tokens, num_output_tokens=live.num_sent,
                spec=live.metrics, arrival=live.arrival, first_token=live.first_token_time, finish=now)
        except Exception:  # metrics never take the engine down
            log.exception("recording metrics of request %s failed", live.request_id)

    def _update_gauges(self) -> None:
        if self.metrics is None:
            return
        try:
            self.metrics.set_scheduler_state(self.llm.num_running, self.llm.num_waiting, kv_cache_usage(self.llm))
            counts = getattr(getattr(self.llm, "loop", None), "k_counts", None)
            if counts is not None:
                self.metrics.count_speculation_lengths(counts)
        except Exception:
            log.exception("updating gauges failed")


def kv_cache_usage(llm: Any) -> float:
    """Fraction of the KV cache in use (0..1).

    A budgeted allocator reports its own usage; the simple one (no budget) is measured
    against its largest use, ``max_num_seqs * max_model_len`` tokens.
    """
    alloc = getattr(getattr(llm, "target", None), "allocator", None)
    if alloc is None:
        return 0.0
    if getattr(alloc, "capacity_tokens", None):
        return float(alloc.usage())
    used = getattr(alloc, "used_tokens", None)
    if used is None:
        return 0.0
    return min(1.0, used / max(1, llm.max_num_seqs * llm.max_model_len))
