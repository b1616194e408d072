"""``speculum bench serve``: benchmark a running server, or ``--compare`` baseline vs speculation.

Only argparse is imported here; httpx and matplotlib load when the command runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from pathlib import Path

#: further ``speculum bench`` subcommands: modules with ``add_parser(bench_subparsers)``
OTHER_COMMANDS = ("speculum.bench.offline", "speculum.bench.scaling", "speculum.bench.step", "speculum.bench.soak",
                  "speculum.bench.backends", "speculum.bench.verifiers", "speculum.bench.states")


def _rate(text: str) -> float:
    text = text.strip().lower()
    if text in ("inf", "infinity"):
        return math.inf
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a request rate is a positive number or inf, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"a request rate must be > 0 (or inf), got {text!r}")
    return v


def _rates(text: str) -> list[float]:
    return [_rate(t) for t in text.split(",") if t.strip()]


def _counts(text: str) -> list[int]:
    try:
        counts = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--num-prompts is a count or one count per sweep rate (e.g. 40,40,256), "
                                         f"got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--num-prompts must be >= 1, got {text!r}")
    return counts


def rate_counts(rates: list[float], counts: list[int]) -> list[tuple[float, int]]:
    """(rate, prompts sent at it), low load first: one count for every rate, or one per rate
    in the order ``--sweep`` gave them (a high rate needs more prompts to last long enough
    to measure: 40 prompts all at once finish in half a second)."""
    from speculum.errors import ConfigError
    if len(counts) == 1:
        counts = counts * len(rates)
    elif len(counts) != len(rates):
        raise ConfigError(f"--num-prompts has {len(counts)} counts for {len(rates)} request rates; give one count, "
                          "or one per rate of --sweep in the same order")
    return sorted(zip(rates, counts), key=lambda rc: rc[0])


def add_parser(sub) -> argparse.ArgumentParser:
    bench = sub.add_parser("bench", help="benchmarks: serve (load-test an OpenAI-compatible server) and more")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    p = bsub.add_parser("serve", help="send MT-bench to a server; TTFT, TPOT, ITL, throughput, acceptance",
                        description="Load-test an OpenAI-compatible server (ours or any) with streamed requests. "
                                    "See docs/serving.md.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (ignored with --compare)")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                   help="chat: /v1/chat/completions (prompts as one user message); completions: /v1/completions")
    p.add_argument("--model", default=None,
                   help="model name to request (default: the server's first); with --compare, the model to serve")
    p.add_argument("--dataset", default=None, metavar="JSONL",
                   help='one {"prompt": "text" or [token ids]} per line (default: MT-bench questions)')
    p.add_argument("--num-prompts", type=_counts, default=[32], metavar="N[,N2,...]",
                   help="requests sent per request rate (default 32); with --sweep, one count per rate in the same "
                        "order may be given, e.g. --sweep 1,32,inf --num-prompts 32,256,320")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request")
    p.add_argument("--temperature", type=float, default=0.0, help="temperature of every request (0: greedy)")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (fixed output lengths)")
    p.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--sweep", type=_rates, default=None, metavar="R1,R2,...",
                   help="run once per request rate, e.g. 1,2,4,8 (inf allowed)")
    p.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (default: none)")
    p.add_argument("--extra-body", default=None, metavar="JSON",
                   help='fields added to every request, e.g. \'{"top_k": 1}\'')
    p.add_argument("--result-json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--warmup", type=int, default=2, help="requests sent (and not counted) before each sweep")
    p.add_argument("--no-warmup-burst", dest="warmup_burst", action="store_false",
                   help="skip the uncounted burst before each sweep (default: when the sweep includes all-at-once "
                        "or --max-concurrency > 1, the prompts are first sent all at once, up to the concurrency "
                        "limit, so the batch sizes and context lengths the measured runs reach are compiled and "
                        "captured as CUDA graphs before any run is timed, for every server alike)")
    c = p.add_argument_group("--compare: start both servers here")
    c.add_argument("--compare", action="store_true",
                   help="start `speculum serve` without and with --speculative-config, sweep both, plot, and "
                        "print a baseline vs speculation table")
    c.add_argument("--speculative-config", action="append", default=None, metavar="JSON",
                   help="speculation of the second server (the first runs without); repeatable: one more server "
                        'per config, side by side (e.g. "auto" and a fixed k)')
    c.add_argument("--max-num-seqs", type=int, default=32, help="for the servers --compare starts")
    c.add_argument("--dtype", default="auto", help="of the servers --compare starts")
    c.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads of each server (default: the servers' own rule, speculum.threads)")
    c.add_argument("--device", default="auto", help="of the servers --compare starts")
    from speculum.cli import add_batch_invariant_arg
    add_batch_invariant_arg(c)
    c.add_argument("--no-overlap", action="store_true",
                   help="start the servers with --no-overlap (the 'before' of overlapped steps)")
    c.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="start every server N times, in turns (baseline, each config, baseline, ...), and pool "
                        "each rate's N runs into one (speculum.bench.pool): a served engine's throughput at high "
                        "load moves between server processes by more than the effects measured (default: 1)")
    c.add_argument("--plot-dir", default=None, help="where the PNGs go (default: beside --result-json, or .)")
    c.add_argument("--server-log-dir", default=None, help="keep each server's log here")
    p.set_defaults(func=cmd_bench_serve)
    for name in OTHER_COMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.add_parser(bsub)
    return p


def cmd_bench_serve(args) -> int:
    import asyncio

    from speculum.bench import report
    from speculum.bench.datasets import load_prompts
    from speculum.errors import ConfigError

    plan = rate_counts(args.sweep or [args.request_rate], args.num_prompts)  # low load first; inf last
    extra = json.loads(args.extra_body) if args.extra_body else None
    if extra is not None and not isinstance(extra, dict):
        raise ConfigError("--extra-body must be a JSON object")
    prompts = load_prompts(args.dataset, max(n for _, n in plan))
    if args.endpoint == "chat" and any(not isinstance(p, str) for p in prompts):
        raise ConfigError("token-id prompts need --endpoint completions")
    if args.compare:
        return _compare(args, prompts, plan, extra)

    runs = asyncio.run(_sweep(args.base_url, prompts, plan, args, extra, args.model))
    for r in runs:
        print(report.run_table(r))
    if len(runs) > 1:
        print(report.sweep_table(runs))
    if args.result_json:
        from speculum.bench.compare import write_json
        write_json(args.result_json, {"base_url": args.base_url, "num_prompts": _count_json(plan), "runs": runs})
        print(f"wrote {args.result_json}")
    return 0 if all(r["failed"] == 0 for r in runs) else 1


def _count_json(plan: list[tuple[float, int]]) -> int | list[int]:
    """``num_prompts`` of the result JSON: one count, or one per rate (low load first)."""
    counts = [n for _, n in plan]
    return counts[0] if len(set(counts)) == 1 else counts


async def _sweep(base_url: str, prompts, plan: list[tuple[float, int]], args, extra, model) -> list[dict]:
    from speculum.bench.runner import run_benchmark

    common = dict(endpoint=args.endpoint, model=model, max_tokens=args.max_tokens, temperature=args.temperature,
                  ignore_eos=args.ignore_eos, max_concurrency=args.max_concurrency, api_key=args.api_key,
                  extra_body=extra, seed=args.seed, timeout_s=args.timeout)
    if args.warmup:
        await run_benchmark(base_url, prompts[: args.warmup], **{**common, "max_tokens": min(args.max_tokens, 8)})
    if args.warmup_burst and (any(r == math.inf for r, _ in plan) or (args.max_concurrency or 0) > 1):
        # a shape first met in a timed run (a batch of 40, contexts past 256 tokens) would be
        # captured there: 0.1-0.5 s inside an all-at-once run that lasts about a second
        n = min(len(prompts), args.max_concurrency or len(prompts))
        print(f"bench: warm-up burst of {n} prompts to {base_url} (not counted)", file=sys.stderr, flush=True)
        await run_benchmark(base_url, prompts[:n], **{**common, "request_rate": math.inf})
    runs = []
    for rate, n in plan:
        print(f"bench: {n} prompts at rate {rate} to {base_url}", file=sys.stderr, flush=True)
        runs.append(await run_benchmark(base_url, prompts[:n], request_rate=rate, **common))
    return runs


def config_label(cfg: dict) -> str:
    """A short name for a speculative config: method and k (or its schedule)."""
    method = cfg.get("method") or cfg.get("model") or "spec"
    k = cfg.get("num_speculative_tokens")
    sched = cfg.get("num_speculative_tokens_per_batch_size")
    if sched == "auto":
        return f"{method}(auto,k<={k})"
    if sched is not None:
        return f"{method}(by batch,k<={k})"
    return f"{method}(k={k})"


def _compare(args, prompts, plan: list[tuple[float, int]], extra) -> int:
    import asyncio

    from speculum.bench import report
    from speculum.bench.compare import plot, served, write_json
    from speculum.config import SpeculativeConfig
    from speculum.errors import ConfigError

    specs = [v for v in (args.speculative_config or []) if SpeculativeConfig.from_cli(v) is not None]
    if not specs:
        raise ConfigError("--compare needs --speculative-config (it compares speculation against none)")
    name = args.model or "default"
    log_dir = Path(args.server_log_dir) if args.server_log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    labels = []
    for v in specs:
        label = config_label(json.loads(v))
        while label in labels:
            label += "'"
        labels.append(label)
    if args.repeats < 1:
        raise ConfigError(f"--repeats {args.repeats}: give 1 or more")
    sweeps: dict[str, list] = {}
    for rep in range(args.repeats):
        for i, (label, spec) in enumerate([("baseline", None)] + list(zip(labels, specs))):
            turn = f" (repeat {rep + 1} of {args.repeats})" if args.repeats > 1 else ""
            print(f"bench: starting the {label} server{turn}", file=sys.stderr, flush=True)
            log_name = ("baseline" if spec is None else ("speculative" if i == 1 else f"speculative-{i}")) \
                + (f"-r{rep + 1}" if rep else "")
            with served(args.model, spec, served_name=name, max_num_seqs=args.max_num_seqs, dtype=args.dtype,
                        extra_args=(["--threads", str(args.threads)] if args.threads else [])
                        + (["--batch-invariant"] if args.batch_invariant else [])
                        + (["--no-overlap"] if args.no_overlap else []) or None,
                        device=args.device, log_path=log_dir / f"{log_name}.log" if log_dir else None) as url:
                sweeps.setdefault(label, []).append(asyncio.run(_sweep(url, prompts, plan, args, extra, name)))
    from speculum.bench.pool import pool_runs
    results = {label: pool_runs(runs) for label, runs in sweeps.items()}
    base = results["baseline"]
    print("== baseline")
    print(report.sweep_table(base))
    comparisons = {}
    for label in labels:
        print(f"== speculation: {label}")
        print(report.sweep_table(results[label]))
        comparisons[label] = report.compare_rows(base, results[label])
        print(f"== what to look for, {label} (ratio > 1: speculation is better)")
        print(report.compare_table(comparisons[label]))
    if len(labels) > 1 or args.repeats > 1:
        print("== output throughput against no speculation, per request rate"
              + (f" ({args.repeats} repeats pooled)" if args.repeats > 1 else ""))
        print(report.ratio_table(base, {label: results[label] for label in labels}))
    if args.repeats > 1:
        for rep in range(args.repeats):
            print(f"== repeat {rep + 1} alone")
            print(report.ratio_table(sweeps["baseline"][rep], {label: sweeps[label][rep] for label in labels}))
    plot_dir = Path(args.plot_dir) if args.plot_dir else (Path(args.result_json).parent if args.result_json else Path("."))
    paths = plot(base, [(label, results[label]) for label in labels], plot_dir,
                 title=Path(args.model).name if args.model else "default model")
    print("plots: " + ", ".join(str(p) for p in paths))
    if args.result_json:
        first = labels[0]
        write_json(args.result_json, {
            "model": args.model, "speculative_config": json.loads(specs[0]), "num_prompts": _count_json(plan),
            "max_concurrency": args.max_concurrency, "repeats": args.repeats, "baseline": {"runs": base},
            "speculative": {"runs": results[first]}, "comparison": comparisons[first],
            "configs": [{"label": label, "speculative_config": json.loads(v), "runs": results[label],
                         "comparison": comparisons[label],
                         "throughput_ratio": report.throughput_ratios(base, results[label])}
                        for label, v in zip(labels, specs)],
            **({"repeat_runs": sweeps} if args.repeats > 1 else {})})
        print(f"wrote {args.result_json}")
    return 0
