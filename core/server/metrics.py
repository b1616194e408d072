"""Prometheus metrics of one server (its own ``CollectorRegistry``), and the periodic log line.

Names follow vLLM's with the prefix ``speculum:`` (docs/serving.md lists them all).
Speculation counters are updated from each request's :class:`SpecDecodeMetrics` when it
leaves the engine (finished, aborted or failed), so their sums equal the sums of the
per-request figures exactly.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from speculum.metrics import SpecDecodeMetrics

log = logging.getLogger("speculum.server")

PREFIX = "speculum:"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """The server's Prometheus collectors plus plain totals for the periodic log line.

    Methods are called from the engine thread; prometheus_client is thread safe and the
    totals are guarded by a lock.
    """

    def __init__(self, model_name: str, num_speculative_tokens: int = 0):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, labels = self.registry, ["model_name"]

        def counter(name, doc, extra=()):
            return Counter(PREFIX + name, doc, labels + list(extra), registry=r)

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, labels, registry=r)

        def hist(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r)

        self.num_drafts = counter("spec_decode_num_drafts", "Verify steps that carried at least one draft token.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.num_emitted_tokens = counter("spec_decode_num_emitted_tokens",
                                          "Tokens emitted by verification (accepted + one per step).")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Verify steps in which the draft token at this position was accepted.",
                                        ["position"])
        self.drafts_per_pos = counter("spec_decode_num_drafts_per_pos",
                                      "Drafts that reached this position (the denominator of per-position "
                                      "acceptance).", ["position"])
        self.acceptance_rate = gauge("spec_decode_draft_acceptance_rate",
                                     "Accepted / drafted tokens since the server started (absent until "
                                     "something was drafted).")
        self.length_steps = counter("spec_decode_speculation_length_steps",
                                    "Engine steps run at each speculation length k (the k chosen per step: "
                                    "fixed, by batch size, or auto; k=0 ran without drafts).", ["k"])
        self.request_success = counter("request_success", "Requests that left the engine, by finish reason.",
                                       ["finished_reason"])
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that left the engine.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of requests that left the engine.")
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first output token.", TTFT_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds",
                         "Per request: (last token - first token) / (output tokens - 1).", TOKEN_BUCKETS)
        self.itl = hist("inter_token_latency_seconds",
                        "Time between two engine steps that gave a request new tokens.", TOKEN_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for a place in the batch.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV cache usage, 0..1 (1 = full).")
        # touch every labelled series so /metrics shows them at zero from the start
        for c in (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, self.num_emitted_tokens,
                  self.prompt_tokens, self.generation_tokens):
            c.labels(model_name)
        for reason in ("stop", "length", "abort", "error"):
            self.request_success.labels(model_name, reason)
        for pos in range(num_speculative_tokens):
            self.accepted_per_pos.labels(model_name, str(pos))
            self.drafts_per_pos.labels(model_name, str(pos))
        for k in range(num_speculative_tokens + 1):
            self.length_steps.labels(model_name, str(k))
        self._length_seen: list[int] = []
        # the acceptance rate gauge stays absent until something is drafted (no rate, not 0)
        for g in (self.running, self.waiting, self.kv_usage):
            g.labels(model_name)
        self._lock = threading.Lock()
        self.totals = SpecDecodeMetrics()
        self.total_requests = 0
        self.tokens_generated_live = 0  # per step, for the log line's throughput
        self.prompt_tokens_live = 0  # per admitted request, likewise
        self.num_running = 0
        self.num_waiting = 0
        self.kv_cache_usage = 0.0

    # -- from the engine thread -----------------------------------------------------------
    def observe_first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.itl.labels(self.model_name).observe(seconds)

    def count_prompt_tokens(self, n: int) -> None:
        """Prompt tokens of a request the engine accepted (the log line's prompt throughput)."""
        with self._lock:
            self.prompt_tokens_live += n

    def count_step_tokens(self, n: int) -> None:
        """Tokens generated by one engine step (the log line's generation throughput)."""
        with self._lock:
            self.tokens_generated_live += n

    def record_finished(self, *, finish_reason: str, num_prompt_tokens: int, num_output_tokens: int,
                        spec: SpecDecodeMetrics | None, arrival: float, first_token: float | None,
                        finish: float) -> None:
        """Count a request that left the engine (with its final speculation counts)."""
        m = self.model_name
        self.request_success.labels(m, finish_reason).inc()
        self.prompt_tokens.labels(m).inc(num_prompt_tokens)
        self.generation_tokens.labels(m).inc(num_output_tokens)
        self.e2e.labels(m).observe(finish - arrival)
        if first_token is not None and num_output_tokens > 1:
            self.tpot.labels(m).observe((finish - first_token) / (num_output_tokens - 1))
        with self._lock:
            self.total_requests += 1
            if spec is not None:
                self.totals.merge(spec)
            drafted, accepted = self.totals.num_draft_tokens, self.totals.num_accepted_tokens
        if spec is None or not spec.num_steps:
            return
        self.num_drafts.labels(m).inc(spec.num_drafts)
        self.num_draft_tokens.labels(m).inc(spec.num_draft_tokens)
        self.num_accepted_tokens.labels(m).inc(spec.num_accepted_tokens)
        self.num_emitted_tokens.labels(m).inc(spec.num_emitted_tokens)
        for pos, n in enumerate(spec.accepted_per_position):
            self.accepted_per_pos.labels(m, str(pos)).inc(n)
        for pos, n in enumerate(spec.drafts_per_position):
            self.drafts_per_pos.labels(m, str(pos)).inc(n)
        if drafted:
            self.acceptance_rate.labels(m).set(accepted / drafted)

    def count_speculation_lengths(self, k_counts: list[int]) -> None:
        """The engine's steps per speculation length so far (its ``loop.k_counts``)."""
        seen = self._length_seen
        for k, n in enumerate(k_counts):
            before = seen[k] if k < len(seen) else 0
            if n > before:
                self.length_steps.labels(self.model_name, str(k)).inc(n - before)
        self._length_seen = list(k_counts)

    def set_scheduler_state(self, running: int, waiting: int, kv_usage: float) -> None:
        m = self.model_name
        self.running.labels(m).set(running)
        self.waiting.labels(m).set(waiting)
        self.kv_usage.labels(m).set(kv_usage)
        self.num_running, self.num_waiting, self.kv_cache_usage = running, waiting, kv_usage

    # -- readers ------------------------------------------------------------------------
    def render(self) -> bytes:
        """The Prometheus text exposition of this server's registry."""
        return generate_latest(self.registry)

    def snapshot(self) -> dict:
        with self._lock:
            return {"requests": self.total_requests, "prompt_tokens": self.prompt_tokens_live,
                    "generation_tokens": self.tokens_generated_live,
                    "draft_tokens": self.totals.num_draft_tokens, "accepted_tokens": self.totals.num_accepted_tokens,
                    "drafts": self.totals.num_drafts}


class StatsLogger:
    """Logs one line every ``interval_s`` while the server is busy: throughput, queue, acceptance.

    Throughput counts prompt tokens when a request is accepted and generated tokens as
    they come; acceptance covers the requests that finished in the interval.
    """

    def __init__(self, metrics: ServerMetrics, interval_s: float = 10.0, speculative: bool = True):
        self.metrics = metrics
        self.interval_s = interval_s
        self.speculative = speculative
        self._last = metrics.snapshot()
        self._last_t = time.monotonic()

    def line(self) -> str | None:
        """The line for the interval since the previous call, or None when idle."""
        now, snap = time.monotonic(), self.metrics.snapshot()
        prev, dt = self._last, max(now - self._last_t, 1e-9)
        self._last, self._last_t = snap, now
        m = self.metrics
        if snap == prev and not m.num_running and not m.num_waiting:
            return None
        d = {k: snap[k] - prev[k] for k in snap}
        text = (f"prompt throughput: {d['prompt_tokens'] / dt:.1f} tokens/s, generation throughput: "
                f"{d['generation_tokens'] / dt:.1f} tokens/s, finished: {d['requests']}, running: {m.num_running}, "
                f"waiting: {m.num_waiting}, KV cache usage: {100 * m.kv_cache_usage:.1f}%")
        if self.speculative:
            rate = d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else None
            mal = 1 + d["accepted_tokens"] / d["drafts"] if d["drafts"] else None
            text += (f", draft acceptance rate: {'-' if rate is None else f'{rate:.3f}'}"
                     f", mean acceptance length: {'-' if mal is None else f'{mal:.2f}'}")
        return text

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            line = self.line()
            if line:
                log.info("%s", line)
