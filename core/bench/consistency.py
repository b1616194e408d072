"""A serving consistency check: many concurrent requests, each answered exactly once, and
/metrics equal to the sum of the per-request figures.

Needs a speculum server started with ``--per-request-spec-decode-metrics summary`` (or
detailed) and greedy, token-id prompts (so it works on tokenizer-less tiny models).
Used by tests/test_server_concurrency.py and scripts/serve_consistency.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Sequence

import httpx

from speculum.bench.prom import scrape

SUMMED = {  # /metrics counter -> per-request field
    "spec_decode_num_drafts_total": "num_drafts",
    "spec_decode_num_draft_tokens_total": "num_draft_tokens",
    "spec_decode_num_accepted_tokens_total": "num_accepted_tokens",
    "spec_decode_num_emitted_tokens_total": "num_emitted_tokens",
}


def repetitive_prompts(n: int, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    """Token-id prompts of 4..48 tokens with repeated phrases (so n-gram lookup finds matches)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        phrase = [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 6))]
        target = rng.randrange(4, 48)
        body: list[int] = []
        while len(body) < target:
            body += phrase if rng.random() < 0.5 else [rng.randrange(3, vocab)]
        prompts.append(body)
    return prompts


async def _one(client: httpx.AsyncClient, url: str, i: int, prompt: list[int], max_tokens: int, stream: bool) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "return_token_ids": True,
            "stream": stream}
    if not stream:
        r = await client.post(url, json=body)
        if r.status_code != 200:
            return {"index": i, "error": f"HTTP {r.status_code}: {r.text[:200]}"}
        d = r.json()
        ch = d["choices"]
        return {"index": i, "id": d["id"], "finals": sum(c["finish_reason"] is not None for c in ch),
                "token_ids": ch[0].get("token_ids"), "usage": d["usage"],
                "spec": (d.get("metrics") or {}).get("speculative_decoding")}
    body["stream_options"] = {"include_usage": True}
    out = {"index": i, "id": None, "finals": 0, "token_ids": [], "usage": None, "spec": None, "done": 0}
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            return {"index": i, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] += 1
                continue
            d = json.loads(line[6:])
            if "error" in d:
                return {"index": i, "error": d["error"]["message"]}
            if out["id"] not in (None, d["id"]):
                out["error"] = "chunks of two different ids in one stream"
            out["id"] = d["id"]
            for c in d["choices"]:
                out["token_ids"] += c.get("token_ids") or []
                out["finals"] += c["finish_reason"] is not None
            if d.get("usage"):
                out["usage"] = d["usage"]
            if (d.get("metrics") or {}).get("speculative_decoding"):
                out["spec"] = d["metrics"]["speculative_decoding"]
    return out


async def run_consistency_check(base_url: str, prompts: Sequence[list[int]], *, max_tokens: int = 32,
                                concurrency: int = 32, expected: Sequence[list[int]] | None = None,
                                timeout_s: float = 600.0) -> dict:
    """Send every prompt once (alternately streamed and not) at ``concurrency``; check everything.

    Returns a report: ``ok``, the counts, the counter comparison and up to 10 ``problems``.
    """
    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        before = await scrape(client, base_url)
        sem = asyncio.Semaphore(concurrency)

        async def limited(i, p):
            async with sem:
                return await _one(client, url, i, list(p), max_tokens, stream=i % 2 == 0)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(limited(i, p) for i, p in enumerate(prompts)))
        duration = time.perf_counter() - t0
        after = await scrape(client, base_url)
    problems: list[str] = []
    ok = [r for r in results if "error" not in r]
    problems += [f"request {r['index']}: {r['error']}" for r in results if "error" in r]
    ids = [r["id"] for r in ok]
    if len(set(ids)) != len(ids):
        problems.append(f"{len(ids) - len(set(ids))} duplicated response ids")
    for r in ok:
        if r["finals"] != 1:
            problems.append(f"request {r['index']}: {r['finals']} final choices (expected exactly 1)")
        if r.get("done", 1) != 1:
            problems.append(f"request {r['index']}: {r['done']} [DONE] markers")
        if r["usage"] is None or r["usage"]["completion_tokens"] != len(r["token_ids"]):
            problems.append(f"request {r['index']}: usage {r['usage']} disagrees with {len(r['token_ids'])} tokens")
        if r["spec"] is None:
            problems.append(f"request {r['index']}: no metrics.speculative_decoding (start the server with "
                            "--per-request-spec-decode-metrics summary)")
    mismatched = 0
    if expected is not None:
        for r in ok:
            if r["token_ids"] != list(expected[r["index"]]):
                mismatched += 1
                if mismatched <= 3:
                    problems.append(f"request {r['index']}: output differs from the offline engine")
    counters = {}
    if before is None or after is None:
        problems.append("the server has no /metrics")
    else:
        specs = [r["spec"] for r in ok if r["spec"]]
        for counter, field in SUMMED.items():
            counters[counter] = {"metrics": after[counter] - before[counter], "sum": sum(s[field] for s in specs)}
        counters["request_success_total"] = {"metrics": after["request_success_total"] - before["request_success_total"],
                                             "sum": len(ok)}
        counters["prompt_tokens_total"] = {"metrics": after["prompt_tokens_total"] - before["prompt_tokens_total"],
                                           "sum": sum(r["usage"]["prompt_tokens"] for r in ok if r["usage"])}
        counters["generation_tokens_total"] = {
            "metrics": after["generation_tokens_total"] - before["generation_tokens_total"],
            "sum": sum(r["usage"]["completion_tokens"] for r in ok if r["usage"])}
        width = max(len(after["accepted_per_pos"]), max((len(s["accepted_per_position"]) for s in specs), default=0))
        pos_sum = [sum(s["accepted_per_position"][i] for s in specs if i < len(s["accepted_per_position"]))
                   for i in range(width)]
        pos_metrics = [after["accepted_per_pos"][i] - (before["accepted_per_pos"][i] if i < len(before["accepted_per_pos"]) else 0)
                       if i < len(after["accepted_per_pos"]) else 0 for i in range(width)]
        counters["spec_decode_num_accepted_tokens_per_pos_total"] = {"metrics": pos_metrics, "sum": pos_sum}
        for name, c in counters.items():
            if c["metrics"] != c["sum"]:
                problems.append(f"{name}: /metrics says {c['metrics']}, the responses sum to {c['sum']}")
    return {
        "ok": not problems,
        "requests": len(prompts),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "unique_ids": len(set(ids)),
        "mismatched_outputs": mismatched if expected is not None else None,
        "duration_s": duration,
        "output_tokens": sum(len(r["token_ids"]) for r in ok),
        "counters": counters,
        "problems": problems[:10],
    }
