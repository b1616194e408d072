"""Request models (pydantic, unknown fields rejected) and response objects in OpenAI's shape.

Extensions beyond OpenAI's fields, as in vLLM: ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``bad_words``, ``prompt_logprobs``,
``stop_token_ids``, ``ignore_eos`` and ``return_token_ids`` (adds ``token_ids`` /
``prompt_token_ids`` to each choice); speculum's own: ``speculative`` (false: this
request runs without drafts) and ``num_speculative_tokens`` (at most the server's).
Every field works with speculation on (docs/serving.md).
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
    n: int = Field(1, ge=1, description="samples per prompt")
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    repetition_penalty: float = Field(1.0, gt=0.0, description="extension: 1 disables")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="extension")
    min_tokens: int = Field(0, ge=0, description="extension: EOS and stop_token_ids held back until then")
    bad_words: list[str] | None = Field(None, description="extension: words never generated")
    prompt_logprobs: int | None = Field(None, ge=0, description="extension: top-n logprobs of prompt tokens")
    speculative: bool = Field(True, description="extension: false runs this request without speculation")
    num_speculative_tokens: int | None = Field(None, ge=0, description="extension: at most the server's k")
    return_token_ids: bool = Field(False, description="extension: token ids in each choice")

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

    @property
    def top_logprobs_n(self) -> int | None:
        """Top-n logprobs per generated token (None: none asked)."""
        return None

    @property
    def samples(self) -> int:
        """Engine requests per prompt (best_of where given, else n)."""
        return self.n

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's parameters of one sample (``n`` / ``best_of`` are the server's: it
        sends one engine request per sample, see serving.py)."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_tokens=max_tokens, stop=self.stop_list,
                              stop_token_ids=self.stop_token_ids or (), ignore_eos=self.ignore_eos,
                              seed=self.seed, n=self.n, best_of=getattr(self, "best_of", None),
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, min_p=self.min_p,
                              logit_bias=self.logit_bias or (), min_tokens=self.min_tokens,
                              bad_words=self.bad_words or (), logprobs=self.top_logprobs_n,
                              prompt_logprobs=self.prompt_logprobs, speculative=self.speculative,
                              num_speculative_tokens=self.num_speculative_tokens)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


PromptType = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``."""

    prompt: PromptType
    max_tokens: int = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, description="top-n logprobs of each generated token")
    best_of: int | None = Field(None, ge=1, description="samples drawn; the n with the highest cumulative "
                                                        "logprob are returned")

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

    @property
    def top_logprobs_n(self) -> int | None:
        return self.logprobs

    @property
    def samples(self) -> int:
        return self.best_of or self.n

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
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def top_logprobs_n(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

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
            prompt_token_ids: list[int] | None = None, logprobs: dict | None = None) -> dict:
    c: dict[str, Any] = {"index": index, **body, "logprobs": logprobs, "finish_reason": finish_reason}
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
                      prompt_token_ids: list[int] | None = None, logprobs: dict | None = None,
                      prompt_logprobs: list | None = None) -> dict:
    c = _choice(index, {"text": text}, finish_reason, token_ids, prompt_token_ids, logprobs)
    if prompt_logprobs is not None:
        c["prompt_logprobs"] = prompt_logprobs
    return c


def chat_choice(index: int, content: str, finish_reason: str | None, token_ids: list[int] | None = None,
                prompt_token_ids: list[int] | None = None, logprobs: dict | None = None) -> dict:
    return _choice(index, {"message": {"role": "assistant", "content": content}}, finish_reason, token_ids,
                   prompt_token_ids, logprobs)


def chat_chunk_choice(index: int, delta: dict, finish_reason: str | None, token_ids: list[int] | None = None,
                      logprobs: dict | None = None) -> dict:
    return _choice(index, {"delta": delta}, finish_reason, token_ids, logprobs=logprobs)


# -- logprobs in OpenAI's two shapes ---------------------------------------------------
def _token_text(decode, tok: int) -> str:
    return decode([tok]) if decode is not None else f"token_id:{tok}"


def _top(d: dict, n: int) -> list[tuple[int, Any]]:
    """The top-n (token id, Logprob) of one position's dict, likeliest first."""
    return sorted(((t, lp) for t, lp in d.items() if lp.rank is not None and lp.rank <= n),
                  key=lambda x: (-x[1].logprob, x[1].rank))[:n]


def completion_logprobs(entries: list[dict], decode, top_n: int, offset: int = 0) -> dict:
    """The completions API's ``{tokens, token_logprobs, top_logprobs, text_offset}``
    from per-token ``{token id: Logprob}`` dicts (the emitted token first)."""
    tokens, lps, tops, offsets = [], [], [], []
    for d in entries:
        tok = next(iter(d))
        text = _token_text(decode, tok)
        tokens.append(text)
        lps.append(d[tok].logprob)
        tops.append({_token_text(decode, t): lp.logprob for t, lp in _top(d, top_n)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: list[dict], decode, top_n: int) -> dict:
    """The chat API's ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    def one(t: int, lp) -> dict:
        text = _token_text(decode, t)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}
    content = []
    for d in entries:
        tok = next(iter(d))
        content.append({**one(tok, d[tok]), "top_logprobs": [one(t, lp) for t, lp in _top(d, top_n)]})
    return {"content": content}


def prompt_logprobs_json(entries: list | None) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or
    ``{token id: {logprob, rank, decoded_token}}``."""
    if entries is None:
        return None
    return [None if d is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in d.items()} for d in entries]
