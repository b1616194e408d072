"""Request models (pydantic, unknown fields rejected) and response objects in OpenAI's shape.

Extensions beyond OpenAI's fields, as in vLLM: ``top_k``, ``stop_token_ids``,
``ignore_eos`` and ``return_token_ids`` (adds ``token_ids`` / ``prompt_token_ids`` to
each choice).
"""

from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from speculum.sampling import SamplingParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, description="0 is greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="extension: 0 or -1 disables")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, description="extension")
    ignore_eos: bool = Field(False, description="extension")
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    return_token_ids: bool = Field(False, description="extension: token ids in each choice")

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"only n=1 is supported (got {v}); send n separate requests instead")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0:
            raise ValueError(f"penalties are not supported; leave it unset or 0 (got {v})")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        if v is not None and any(not s for s in ([v] if isinstance(v, str) else v)):
            raise ValueError("stop strings must not be empty")
        return v

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_tokens=max_tokens, stop=self.stop_list,
                              stop_token_ids=self.stop_token_ids or (), ignore_eos=self.ignore_eos,
                              seed=self.seed)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


PromptType = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``."""

    prompt: PromptType
    max_tokens: int = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(p, (list, str)) and not p for p in v)):
            raise ValueError("the prompt is empty; give a string, strings, or token ids")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported; leave it false")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v is not None:
            raise ValueError("logprobs are not supported; leave it null")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: one string / token-id list each."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool) -> bool:
        if v:
            raise ValueError("logprobs are not supported; leave it false")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, v):
        if v is not None:
            raise ValueError("top_logprobs is not supported; leave it null")
        return v

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


REQUEST_MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


# -- responses (plain dicts in OpenAI's shape) ------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _envelope(obj: str, request_id: str, model: str, created: int | None, choices: list[dict],
              usage_: dict | None, metrics: dict | None) -> dict:
    """The fields every response and stream chunk share."""
    out = {"id": request_id, "object": obj, "created": created or int(time.time()), "model": model,
           "choices": choices, "system_fingerprint": None}
    if usage_ is not None:
        out["usage"] = usage_
    if metrics is not None:
        out["metrics"] = metrics
    return out


def _choice(index: int, body: dict, finish_reason: str | None, token_ids: list[int] | None,
            prompt_token_ids: list[int] | None = None) -> dict:
    c: dict[str, Any] = {"index": index, **body, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        c["token_ids"] = token_ids
    if prompt_token_ids is not None:
        c["prompt_token_ids"] = prompt_token_ids
    return c


def completion_response(request_id: str, model: str, choices: list[dict], usage_: dict,
                        metrics: dict | None = None, created: int | None = None) -> dict:
    return _envelope("text_completion", request_id, model, created, choices, usage_, metrics)


def chat_response(request_id: str, model: str, choices: list[dict], usage_: dict,
                  metrics: dict | None = None, created: int | None = None) -> dict:
    return _envelope("chat.completion", request_id, model, created, choices, usage_, metrics)


def completion_chunk(request_id: str, model: str, created: int, choices: list[dict],
                     usage_: dict | None = None, metrics: dict | None = None) -> dict:
    return _envelope("text_completion", request_id, model, created, choices, usage_, metrics)


def chat_chunk(request_id: str, model: str, created: int, choices: list[dict],
               usage_: dict | None = None, metrics: dict | None = None) -> dict:
    return _envelope("chat.completion.chunk", request_id, model, created, choices, usage_, metrics)


def completion_choice(index: int, text: str, finish_reason: str | None, token_ids: list[int] | None = None,
                      prompt_token_ids: list[int] | None = None) -> dict:
    return _choice(index, {"text": text}, finish_reason, token_ids, prompt_token_ids)


def chat_choice(index: int, content: str, finish_reason: str | None, token_ids: list[int] | None = None,
                prompt_token_ids: list[int] | None = None) -> dict:
    return _choice(index, {"message": {"role": "assistant", "content": content}}, finish_reason, token_ids,
                   prompt_token_ids)


def chat_chunk_choice(index: int, delta: dict, finish_reason: str | None, token_ids: list[int] | None = None) -> dict:
    return _choice(index, {"delta": delta}, finish_reason, token_ids)
