"""``speculum bench soak --server``: the soak through the OpenAI-compatible server.

An in-process server (uvicorn in a thread) over an engine whose proposer is sabotaged at
random (:class:`~speculum.bench.soak.FaultInjector`) and whose KV budget is at the edge;
``--concurrency`` clients send streamed and plain completions of random lengths (some
past the context: 400), and disconnect at random (mid-stream, or while waiting). At the
end: every request answered or disconnected, none twice; the engine empty and every
KV block back; and the ``/metrics`` counters equal to the sums of the per-request figures
the server recorded as each request left the engine (finished, aborted or failed).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time

import attrs


async def _client(url: str, i: int, rng: random.Random, vocab: int, max_len: int, results: list, timeout: float):
    import httpx

    from speculum.bench.soak import random_prompt
    n = rng.choice([rng.randrange(1, 32), rng.randrange(1, max_len), rng.randrange(max_len - 16, max_len + 8)])
    prompt = random_prompt(rng, max(1, n), vocab)
    body = {"prompt": prompt, "max_tokens": rng.randrange(1, max_len), "ignore_eos": True,
            "temperature": 0.0 if rng.random() < 0.7 else 1.0, "stream": rng.random() < 0.5}
    disconnect = rng.random() < 0.15
    outcome = "?"
    async with httpx.AsyncClient(timeout=timeout) as client:
        try:
            if body["stream"]:
                async with client.stream("POST", url + "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        outcome = f"http_{r.status_code}"
                    else:
                        stop_after = rng.randrange(1, 8) if disconnect else None
                        chunks = 0
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                chunks += 1
                                if stop_after is not None and chunks >= stop_after:
                                    outcome = "disconnected"
                                    break
                                if '"error"' in line:
                                    outcome = "error"
                        else:
                            outcome = outcome if outcome != "?" else "completed"
            else:
                task = asyncio.ensure_future(client.post(url + "/v1/completions", json=body))
                if disconnect:
                    await asyncio.sleep(rng.random() * 0.2)
                    if not task.done():
                        task.cancel()
                        outcome = "disconnected"
                if outcome != "disconnected":
                    r = await task
                    outcome = "completed" if r.status_code == 200 else f"http_{r.status_code}"
        except asyncio.CancelledError:
            outcome = "disconnected"
        except httpx.HTTPError as exc:
            outcome = f"transport_{type(exc).__name__}"
    results.append((i, outcome))


def run_server_soak(args, configs: list[dict]) -> dict:
    from speculum.bench.prom import parse_metrics
    from speculum.bench.soak import FaultInjector, SoakStats, _engine
    from speculum.server.app import create_app
    from speculum.server.runner import ServerThread

    report = {"mode": "server", "concurrency": args.concurrency, "runs": []}
    for cfg in configs:
        llm = _engine(args, cfg, args.kv_blocks)
        rng = random.Random(args.seed)
        stats = SoakStats()
        if llm.proposer is not None:
            llm.loop.proposer = FaultInjector(llm.proposer, args.fault_rate, rng, stats, llm.target.vocab_size)
        app = create_app(llm, model_names=["soak"], spec_metrics_level="summary", log_interval_s=0)
        engine = app.state.engine
        recorded: list[dict] = []
        print(f"soak --server: {json.dumps(cfg)}, {args.num_requests} requests at concurrency {args.concurrency}",
              file=sys.stderr, flush=True)
        with ServerThread(app) as server:
            inner = engine._record_finished

            def record(live, reason, now):  # every request that leaves the engine, with its own figures
                spec = live.metrics
                recorded.append({"id": live.request_id, "reason": reason, "out": live.num_sent,
                                 "prompt": live.num_prompt_tokens,
                                 "spec": None if spec is None else attrs.asdict(spec)})
                return inner(live, reason, now)
            engine._record_finished = record
            results: list = []
            t0 = time.perf_counter()

            async def drive():
                sem = asyncio.Semaphore(args.concurrency)

                async def one(i):
                    async with sem:
                        await _client(server.url, i, random.Random(args.seed * 7919 + i), llm.target.vocab_size,
                                      args.max_model_len, results, timeout=600)
                await asyncio.gather(*(one(i) for i in range(args.num_requests)))
            asyncio.run(drive())
            # let the engine notice the last disconnects and drain
            deadline = time.monotonic() + 60
            while (llm.has_unfinished_requests() or engine.num_live_requests) and time.monotonic() < deadline:
                time.sleep(0.1)
            import httpx
            scraped = parse_metrics(httpx.get(server.url + "/metrics").text)
            stats.seconds = time.perf_counter() - t0
        outcomes: dict = {}
        for _, o in results:
            outcomes[o] = outcomes.get(o, 0) + 1
        ids = [i for i, _ in results]
        stats.requests = len(ids)
        stats.lost = args.num_requests - len(set(ids))
        left_ids = [r["id"] for r in recorded]
        stats.duplicated = len(ids) - len(set(ids)) + len(left_ids) - len(set(left_ids))
        stats.finished = {}
        for r in recorded:
            stats.count(stats.finished, r["reason"])
        stats.aborts = {"client": outcomes.get("disconnected", 0)}
        stats.rejected = sum(v for k, v in outcomes.items() if k.startswith("http_4"))
        stats.preemptions = llm.num_preemptions
        stats.leaked_blocks = sum(c.num_usable_blocks - c.num_free_blocks for c in llm.scheduler.caches)
        mismatch = _compare_counters(scraped, recorded)
        run = {"config": cfg, **attrs.asdict(stats), "outcomes": outcomes, "engine_left": llm.num_running +
               llm.num_waiting, "metrics_mismatch": mismatch, "greedy_completed": 0, "greedy_identical": 0}
        report["runs"].append(run)
        del llm
    return report


def _compare_counters(scraped: dict, recorded: list[dict]) -> list[str]:
    """Differences between /metrics and the sums of the recorded per-request figures."""
    sums = {"spec_decode_num_drafts_total": 0, "spec_decode_num_draft_tokens_total": 0,
            "spec_decode_num_accepted_tokens_total": 0, "spec_decode_num_emitted_tokens_total": 0,
            "generation_tokens_total": 0, "prompt_tokens_total": 0, "request_success_total": len(recorded)}
    per_pos: list[int] = []
    for r in recorded:
        sums["generation_tokens_total"] += r["out"]
        sums["prompt_tokens_total"] += r["prompt"]
        s = r["spec"]
        if s and s["num_steps"]:
            sums["spec_decode_num_drafts_total"] += s["num_drafts"]
            sums["spec_decode_num_draft_tokens_total"] += s["num_draft_tokens"]
            sums["spec_decode_num_accepted_tokens_total"] += s["num_accepted_tokens"]
            sums["spec_decode_num_emitted_tokens_total"] += s["num_emitted_tokens"]
            for i, n in enumerate(s["accepted_per_position"]):
                while len(per_pos) <= i:
                    per_pos.append(0)
                per_pos[i] += n
    out = [f"{k}: /metrics {scraped.get(k)} != sum {v}" for k, v in sums.items() if scraped.get(k) != v]
    got = [int(x) for x in scraped.get("accepted_per_pos", [])]
    while got and got[-1] == 0 and len(got) > len(per_pos):
        got.pop()
    if got[: len(per_pos)] != per_pos:
        out.append(f"accepted per position: /metrics {got} != sum {per_pos}")
    return out
