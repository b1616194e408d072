"""Many concurrent requests with n-gram speculation on a tiny model.

Every request completes exactly once, greedy outputs equal the offline engine's, and the
/metrics counters equal the sums of the per-request speculation metrics. (The 500-request,
concurrency-32 version of the same check: scripts/serve_consistency.py.)
"""

from __future__ import annotations

import asyncio
import time

import httpx

from speculum import LLM, SamplingParams
from speculum.bench.consistency import repetitive_prompts, run_consistency_check
from speculum.server.app import create_app
from speculum.server.runner import ServerThread

NUM_REQUESTS, CONCURRENCY, MAX_TOKENS = 100, 16, 24


def test_concurrent_requests_complete_once_match_offline_and_metrics_add_up(tiny_llama):
    llm = LLM(str(tiny_llama), speculative_config={"method": "ngram", "num_speculative_tokens": 4},
              dtype="float32", device="cpu", max_num_seqs=CONCURRENCY)
    prompts = repetitive_prompts(NUM_REQUESTS, seed=1)
    offline = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    app = create_app(llm, model_names=["tiny"], spec_metrics_level="summary", log_interval_s=0)
    with ServerThread(app) as server:
        report = asyncio.run(run_consistency_check(server.url, prompts, max_tokens=MAX_TOKENS,
                                                   concurrency=CONCURRENCY, expected=[o.token_ids for o in offline]))
        deadline = time.monotonic() + 5
        while app.state.engine.num_live_requests and time.monotonic() < deadline:
            time.sleep(0.01)
        assert httpx.get(server.url + "/health").status_code == 200
    assert report["problems"] == []
    assert report["ok"]
    assert report["completed"] == report["unique_ids"] == NUM_REQUESTS and report["failed"] == 0
    assert report["mismatched_outputs"] == 0
    c = report["counters"]
    assert c["spec_decode_num_draft_tokens_total"]["sum"] > 0, "ngram never drafted: the check would be vacuous"
    assert c["spec_decode_num_accepted_tokens_total"]["sum"] > 0
    assert c["request_success_total"]["metrics"] == NUM_REQUESTS
    assert app.state.engine.num_live_requests == 0 and not llm.has_unfinished_requests()
