"""What ``LLM.generate`` returns."""

from __future__ import annotations

import attrs

from speculum.metrics import SpecDecodeMetrics


@attrs.define
class CompletionOutput:
    """One generated continuation."""

    #: its index among the request's outputs (0 .. n - 1)
    index: int
    #: None while the request runs (decode ``token_ids`` yourself to stream text)
    text: str | None
    token_ids: list[int]
    #: "stop" (EOS, stop string or stop token), "length" (max_tokens / context), "abort",
    #: "error" (this request failed; ``RequestOutput.error`` says why)
    finish_reason: str | None
    #: the stop string or stop token id that ended generation, if any
    stop_reason: str | int | None = None
    #: per output token ``{token id: Logprob}`` (the token and the top-n) when
    #: ``logprobs`` was asked for: the target's raw log-probabilities (speculum.logprobs)
    logprobs: list | None = None
    #: sum of the output tokens' log-probabilities (with logprobs, or best_of > n)
    cumulative_logprob: float | None = None


@attrs.define
class RequestOutput:
    """The result of one request: its prompt, its output and its speculation metrics."""

    request_id: str
    #: the prompt as text: the text given, the rendered chat template, or the decoded ids
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: SpecDecodeMetrics
    #: seconds from admission to the first output token, and to the end
    time_to_first_token: float | None = None
    latency: float | None = None
    #: why the request failed (``finish_reason == "error"``), else None
    error: str | None = None
    #: per prompt token ``{token id: Logprob}`` (None for the first) when ``prompt_logprobs`` was asked for
    prompt_logprobs: list | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
