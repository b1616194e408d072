#!/usr/bin/env python
"""Serving consistency at load: N concurrent requests with n-gram speculation on a tiny model.

Starts an in-process server (uvicorn in a thread) over a random tiny Llama with
``{"method": "ngram", "num_speculative_tokens": 4}``, sends N greedy token-id requests at
concurrency C (every other one streamed), and checks that every request completed exactly
once, that each output equals the offline engine's (``LLM.generate`` on the same engine
before serving) and that the /metrics counters equal the sums of the per-request metrics.

    .venv/bin/python scripts/serve_consistency.py --num-requests 500 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args(argv)

    from speculum import LLM, SamplingParams
    from speculum.bench.consistency import repetitive_prompts, run_consistency_check
    from speculum.server.app import create_app
    from speculum.server.runner import ServerThread
    from speculum.testing import tiny_model_dir

    model = tiny_model_dir(tempfile.mkdtemp(prefix="speculum-tiny-"), "llama", seed=0)
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
    llm = LLM(str(model), speculative_config=spec, dtype="float32", device="cpu", max_num_seqs=args.max_num_seqs)
    prompts = repetitive_prompts(args.num_requests)
    t0 = time.perf_counter()
    offline = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    print(f"offline engine: {len(prompts)} requests in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    app = create_app(llm, model_names=["tiny"], spec_metrics_level="summary", log_interval_s=0)
    with ServerThread(app) as server:
        report = asyncio.run(run_consistency_check(
            server.url, prompts, max_tokens=args.max_tokens, concurrency=args.concurrency,
            expected=[o.token_ids for o in offline]))
        report["engine_requests_left"] = llm.num_running + llm.num_waiting
        if report["engine_requests_left"]:
            report["ok"] = False
            report["problems"].append(f"{report['engine_requests_left']} requests still in the engine")
    report.update(num_requests=args.num_requests, concurrency=args.concurrency, max_tokens=args.max_tokens,
                  speculative_config=spec)
    for name, c in report["counters"].items():
        mark = "==" if c["metrics"] == c["sum"] else "!="
        print(f"  {name:<50} /metrics {c['metrics']} {mark} sum of responses {c['sum']}")
    print(f"requests: {report['requests']}  completed: {report['completed']}  failed: {report['failed']}  "
          f"unique ids: {report['unique_ids']}  outputs differing from offline: {report['mismatched_outputs']}  "
          f"time: {report['duration_s']:.1f} s  output tokens: {report['output_tokens']}")
    print("OK" if report["ok"] else "PROBLEMS:\n  " + "\n  ".join(report["problems"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
