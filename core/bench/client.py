"""One streamed request, timed on the client: TTFT, the gaps between chunks, end-to-end."""

from __future__ import annotations

import json
import time
from typing import Any

import attrs
import httpx


@attrs.define
class RequestResult:
    """The client-side view of one request."""

    ok: bool
    #: seconds from sending to the first chunk that carried output
    ttft: float | None = None
    #: seconds between consecutive chunks that carried output (one chunk may hold several tokens)
    itl: list[float] = attrs.field(factory=list)
    latency: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    error: str | None = None
    #: the response's metrics.speculative_decoding, when the server adds it
    spec: dict | None = None

    @property
    def tpot(self) -> float | None:
        """(latency - TTFT) / (output tokens - 1): decode time per token after the first."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def build_payload(endpoint: str, model: str, prompt: str | list[int], max_tokens: int, temperature: float,
                  ignore_eos: bool, extra_body: dict | None) -> dict:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra_body or {})
    return body


async def send_request(client: httpx.AsyncClient, url: str, payload: dict, headers: dict | None = None) -> RequestResult:
    """POST ``payload`` with ``stream: true`` and time the server-sent events."""
    start = time.perf_counter()
    res = RequestResult(ok=False)
    last = None
    chunks = 0
    parts: list[str] = []
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:300]}"
                res.latency = time.perf_counter() - start
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = f"stream error: {obj['error'].get('message')}"
                    break
                now = time.perf_counter()
                for ch in obj.get("choices") or ():
                    text = ch.get("text")
                    if text is None:
                        text = (ch.get("delta") or {}).get("content") or ""
                    ntok = len(ch.get("token_ids") or ())
                    if text or ntok:
                        parts.append(text)
                        chunks += max(ntok, 1)
                        if res.ttft is None:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
                if obj.get("usage"):
                    res.prompt_tokens = obj["usage"].get("prompt_tokens", 0)
                    res.output_tokens = obj["usage"].get("completion_tokens", 0)
                spec = (obj.get("metrics") or {}).get("speculative_decoding")
                if spec:
                    res.spec = spec
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.latency = time.perf_counter() - start
    res.text = "".join(parts)
    if not res.output_tokens:
        res.output_tokens = chunks  # servers without usage: one token per chunk
    res.ok = res.error is None
    return res
