"""A running request: its tokens, sampling state, stop checks and metrics."""

from __future__ import annotations

import time

import attrs
import torch

from speculum.interfaces import SequenceView
from speculum.logits_process import NO_RULES, TokenRules, needs_processing
from speculum.metrics import SpecDecodeMetrics
from speculum.sampling import SamplingParams
from speculum.spec_length import Acceptance
from speculum.tokenizer import Tokenizer


@attrs.define(eq=False)
class Sequence:
    request_id: str
    seq_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    max_model_len: int
    token_ids: list[int] = attrs.field(init=False)
    metrics: SpecDecodeMetrics = attrs.field(factory=SpecDecodeMetrics)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    #: why the request failed (``finish_reason == "error"``)
    error: str | None = None
    #: drafts are proposed for this request (off: plain decoding in the same batch)
    speculative: bool = True
    #: the most drafts per step for this request (its num_speculative_tokens); None: the engine's k
    max_k: int | None = None
    #: token-id form of bad_words / min_tokens (resolved when the request was added)
    rules: TokenRules = NO_RULES
    #: running acceptance of its drafts (what speculation length "auto" reads)
    acceptance: Acceptance = attrs.field(factory=Acceptance)
    #: per output token: (token id, logprob, rank, top ids, top logprobs) when logprobs were asked
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    #: per prompt token (None for the first) when prompt_logprobs were asked; filled at prefill
    prompt_logprobs: list | None = None
    #: index of this sample among its request's n / best_of samples
    index: int = 0
    #: the seed of its sampling noise (the request's, or drawn by the engine); None when greedy
    seed: int | None = None
    #: whether its logits go through speculum.logits_process (set from params and rules)
    processed: bool = attrs.field(init=False, default=False)
    text: str | None = None
    arrival_time: float = attrs.field(factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    def __attrs_post_init__(self):
        self.token_ids = list(self.prompt_token_ids)
        self.processed = needs_processing(self.params, self.rules)
        if self.params.logprobs is not None:
            self.logprobs = []
            self.cumulative_logprob = 0.0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def room(self) -> int:
        """How many more tokens this sequence may emit."""
        return min(self.params.max_tokens - self.num_output_tokens, self.max_model_len - len(self.token_ids))

    def view(self) -> SequenceView:
        return SequenceView(self.seq_id, self.token_ids, self.num_prompt_tokens, self.generator)

    def append(self, tokens: list[int], tokenizer: Tokenizer) -> int:
        """Append emitted tokens one by one, stopping at the first stop condition.

        Returns how many were kept. A stop inside the run cuts it there.
        """
        p = self.params
        kept = 0
        for tok in tokens:
            self.token_ids.append(tok)
            kept += 1
            if self.first_token_time is None:
                self.first_token_time = time.perf_counter()
            if not p.ignore_eos and tok in tokenizer.eos_token_ids:
                self._finish("stop", None)
                break
            if tok in p.stop_token_ids:
                self._finish("stop", tok)
                break
            if p.stop and self._check_stop_strings(tokenizer):
                break
            if self.room() <= 0:
                self._finish("length", None)
                break
        return kept

    def record_logprobs(self, entries: list) -> None:
        """Logprobs of the tokens just appended (one entry per kept token)."""
        if self.logprobs is None:
            return
        self.logprobs.extend(entries)
        self.cumulative_logprob += sum(e[1] for e in entries)

    def _check_stop_strings(self, tokenizer: Tokenizer) -> bool:
        text = tokenizer.decode(self.output_token_ids)
        # search only the tail that the last token can have completed
        longest = max(len(s) for s in self.params.stop)
        start = max(0, len(text) - longest - 16)
        best = None
        for s in self.params.stop:
            i = text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        self.text = text[: best[0]]
        self._finish("stop", best[1])
        return True

    def _finish(self, reason: str, stop_reason) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finish_time = time.perf_counter()

    def abort(self) -> None:
        if not self.finished:
            self._finish("abort", None)

    def fail(self, message: str) -> None:
        """Finish with ``finish_reason="error"`` (the request only; the engine serves on)."""
        if not self.finished:
            self.error = message
            self._finish("error", None)
