"""One benchmark run: send the prompts at a Poisson rate (or all at once) under a concurrency cap.

The summary keys follow ``vllm bench serve``'s JSON: ``mean_ttft_ms``, ``p99_tpot_ms``,
``output_throughput`` and so on, plus ``spec_decode`` scraped from the server's /metrics.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from typing import Sequence

import httpx

from speculum.bench.client import RequestResult, build_payload, send_request
from speculum.bench.prom import scrape, spec_decode_delta

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def _headers(api_key: str | None) -> dict | None:
    return {"Authorization": f"Bearer {api_key}"} if api_key else None


async def served_model(client: httpx.AsyncClient, base_url: str, api_key: str | None = None) -> str:
    """The first model name in the server's /v1/models."""
    r = await client.get(base_url.rstrip("/") + "/v1/models", headers=_headers(api_key))
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def run_benchmark(base_url: str, prompts: Sequence[str | list[int]], *, endpoint: str = "chat",
                        model: str | None = None, max_tokens: int = 128, temperature: float = 0.0,
                        ignore_eos: bool = False, request_rate: float = math.inf,
                        max_concurrency: int | None = None, api_key: str | None = None,
                        extra_body: dict | None = None, seed: int = 0, timeout_s: float = 600.0) -> dict:
    """Send every prompt once; return the summary (see :func:`summarize`)."""
    base_url = base_url.rstrip("/")
    url = base_url + ENDPOINTS[endpoint]
    headers = _headers(api_key)
    limits = httpx.Limits(max_connections=max_concurrency or max(len(prompts), 1), max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        model = model or await served_model(client, base_url, api_key)
        before = await scrape(client, base_url, headers)
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        rng = random.Random(seed)

        async def one(prompt) -> RequestResult:
            payload = build_payload(endpoint, model, prompt, max_tokens, temperature, ignore_eos, extra_body)
            if sem is None:
                return await send_request(client, url, payload, headers)
            async with sem:
                return await send_request(client, url, payload, headers)

        tasks = []
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts):
            tasks.append(asyncio.ensure_future(one(prompt)))
            if math.isfinite(request_rate) and i < len(prompts) - 1:
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        after = await scrape(client, base_url, headers)
    summary = summarize(results, duration)
    summary.update(request_rate=request_rate if math.isfinite(request_rate) else "inf",
                   max_concurrency=max_concurrency, endpoint=endpoint, model=model, max_tokens=max_tokens,
                   spec_decode=spec_decode_delta(before, after))
    return summary


def _stats(name: str, values: list[float]) -> dict:
    ms = [v * 1000.0 for v in values]
    if not ms:
        return {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"p99_{name}_ms": None}
    return {f"mean_{name}_ms": statistics.fmean(ms), f"median_{name}_ms": statistics.median(ms),
            f"p99_{name}_ms": percentile(ms, 99)}


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default)."""
    s = sorted(values)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    summary = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": [r.error for r in results if not r.ok][:5],
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
    }
    summary.update(_stats("ttft", [r.ttft for r in ok if r.ttft is not None]))
    summary.update(_stats("tpot", [r.tpot for r in ok if r.tpot is not None]))
    summary.update(_stats("itl", [x for r in ok for x in r.itl]))
    summary.update(_stats("e2el", [r.latency for r in ok]))
    return summary
