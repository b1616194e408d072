"""``speculum bench offline``: tokens/s of autoregressive decoding against each method.

Per MT-bench category: tokens/s without speculation and with each method, the speedup
(a ratio measured in the same process), mean acceptance length, and whether outputs are
token-identical (greedy; ``--temperature`` above 0 samples instead, every request seeded,
and identity is not asked: sampled outputs follow the target's law, not its draws).
Prints a table and writes JSON. The comparison itself is
:mod:`speculum.bench.methods`, shared with ``speculum generate --compare``.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch


def add_parser(sub) -> None:
    from speculum.cli import add_batch_invariant_arg

    p = sub.add_parser("offline", help="offline throughput per MT-bench category: autoregressive vs methods")
    p.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--method", action="append", default=[], metavar="JSON",
                   help='a speculative config (repeatable), e.g. \'{"method":"ngram","num_speculative_tokens":4}\'')
    p.add_argument("--prompts-per-category", type=int, default=2, help="MT-bench questions per category")
    p.add_argument("--categories", default=None, help="comma separated (default: all)")
    p.add_argument("--max-tokens", type=int, default=256, help="new tokens per prompt at most")
    p.add_argument("--warmup-tokens", type=int, default=None,
                   help="each engine first answers the longest prompts (one per batch slot), then the shortest (pooled above batch 1: "
                        "every prompt at once, as the timed run will), with this many tokens, untimed (default: "
                        "--max-tokens, so that whatever is built per context length is built before timing: on the "
                        "H200 the first config after the baseline ran 10-25%% slower than when it ran later, "
                        "after a 32-token warm-up)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="max_num_seqs of every engine; above 1, every question is submitted at once (one generate "
                        "call), so the batch is reached; tokens/s is then a total, per category only MAL")
    p.add_argument("--per-category-batches", action="store_true",
                   help="with --batch-size above 1: one generate call per category, timed each (the way before "
                        "2026-12-02: no more sequences run together than a category has questions)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy, outputs checked for identity; above 0: sampled (speculative "
                        "sampling and, for trees, recursive rejection over siblings), no identity column")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus filter (default 1: off)")
    p.add_argument("--top-k", type=int, default=0, help="with --temperature: top-k filter (default 0: off)")
    p.add_argument("--seed", type=int, default=0,
                   help="with --temperature: request i of a category is seeded seed + i, the same in every config")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda")
    p.add_argument("--runner", default=None, help="auto, native or hf (default: auto)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: the CPUs not busy with other processes)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--no-overlap", action="store_true",
                   help="no overlapped steps (LLM(overlap=False)): the 'before' of overlap (default: overlap on CUDA)")
    add_batch_invariant_arg(p)
    p.add_argument("--interleave", action="store_true",
                   help="load every config at once and run each category through all of them in turn, so a "
                        "machine whose speed drifts (a shared CPU) slows every config alike (default: one engine "
                        "at a time, all categories); pooled (--batch-size above 1), every config runs the whole "
                        "batch in turn, --rounds times, and reports its median round")
    p.add_argument("--rounds", type=int, default=None,
                   help="with --interleave above batch 1: pooled runs per config, in turns (default 3); the "
                        "median round is reported, every round's seconds are in the JSON")
    p.add_argument("--baseline-again", action="store_true",
                   help="run autoregressive decoding once more after every config (a fresh engine, warmed the same "
                        "way): its ratio to the first run is this run's drift, the noise under every other ratio")
    p.add_argument("--mt-bench", default=None,
                   help="MT-bench style JSONL, or a shipped set by name: mt_bench (the default: the 80 "
                        "questions) or other_tasks (40 prompts of translation, summarization, qa, "
                        "math_reasoning and rag: task types MT-bench lacks)")
    p.add_argument("--profile", action="store_true",
                   help="also time one step of each config split into draft, verify and host work (the first "
                        "question of each category, then more up to --batch-size; after the throughput run)")
    p.add_argument("--json", default="results/bench_offline.json", help="where the JSON goes")
    p.set_defaults(func=run)


def _prompts(args) -> dict[str, list]:
    from speculum.datasets import first_turn, mt_bench, per_category
    wanted = set(args.categories.split(",")) if args.categories else None
    groups = per_category(mt_bench(path=args.mt_bench), args.prompts_per_category, wanted)
    return {c: [[{"role": "user", "content": first_turn(r)}] for r in rows] for c, rows in groups.items()}


def _profile_prompts(groups: dict[str, list], batch_size: int) -> list:
    """The first question of each category, then the next ones in turn until a batch is full."""
    out, i = [], 0
    while len(out) < max(batch_size, len(groups)) and any(i < len(ps) for ps in groups.values()):
        out += [ps[i] for ps in groups.values() if i < len(ps)]
        i += 1
    return out[:max(batch_size, len(groups))]


def _pooled(args) -> bool:
    """Batches above 1 pool every category into one call: a category of 10 questions run on
    its own never fills a batch of 16 (the runs of 2026-12-02 and before did just that)."""
    return args.batch_size > 1 and not args.per_category_batches


def _rounds(args) -> int:
    """Pooled runs per config (``--rounds``; 3 for a pooled ``--interleave`` run, else 1)."""
    pooled_turns = args.interleave and _pooled(args)
    if args.rounds is None:
        return 3 if pooled_turns else 1
    if args.rounds < 1 or (args.rounds > 1 and not pooled_turns):
        raise SystemExit(f"bench offline: --rounds {args.rounds}: rounds are pooled runs in turns; give a number "
                         ">= 1 with --interleave and --batch-size above 1 (not --per-category-batches)")
    return args.rounds


def run(args) -> int:
    from speculum.bench import methods

    groups = _prompts(args)
    rounds = _rounds(args)
    if args.temperature < 0:
        raise SystemExit(f"bench offline: --temperature must be >= 0 (got {args.temperature})")
    if args.temperature > 0 and args.batch_invariant:
        raise SystemExit("bench offline: --batch-invariant checks bitwise identity of greedy outputs; "
                         "drop --temperature (or the flag)")
    params = _params(args)
    opts = dict(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.batch_size,
                cuda_graphs=not args.enforce_eager, threads=args.threads, overlap=not args.no_overlap)
    if args.batch_invariant:
        opts["batch_invariant"] = True
    if args.runner:
        opts["runner"] = args.runner
    devices = []

    def make(cfg):
        from speculum.engine import LLM
        llm = LLM(speculative_config=cfg, **opts)
        devices.append((str(llm.backend.device), llm.threads.threads))
        return llm

    done: list = []
    profile = None
    if args.profile:
        from speculum.bench.step_profile import profile_steps as profile

    measured: list = []  # interleaved: every config's timed figures, known before the first profile

    def after(llm, result):
        if profile is not None:
            result.extra["profile"] = profile(llm, _profile_prompts(groups, args.batch_size), params)
        done.append(result)  # the JSON so far, so a run cut short keeps what it measured
        _write(args, measured or done, devices, partial=True)

    def all_measured(results):
        measured[:] = results
        _write(args, results, devices, partial=True)

    errors: list = []  # a method that fails is reported and skipped: the others' figures stand
    results = methods.compare([json.loads(m) for m in args.method], groups, params, make,
                              warmup_tokens=args.max_tokens if args.warmup_tokens is None else args.warmup_tokens,
                              after=after, errors=errors, interleave=args.interleave, pooled=_pooled(args),
                              baseline_again=args.baseline_again,
                              measured=all_measured, rounds=rounds)
    print(methods.table(results, greedy=args.temperature == 0))
    if args.profile:
        from speculum.bench.step_profile import profile_table
        print(profile_table([r.as_dict() for r in results]))
    base = results[0]
    for r in results[1:]:
        if r.name == methods.AGAIN:
            print("\n".join(drift_lines(results, r)))
        else:
            print(methods.diagnose(base, r))
    for line in methods.load_warnings(results):
        print(line)
    broken = []
    if args.batch_invariant:  # identity is what this mode promises: a difference is a failure, not a caveat
        for r in results[1:]:
            same, n = r.identical(base)
            print(f"bitwise identity (batch-invariant mode), {r.name}: {same}/{n} outputs token-identical to "
                  "autoregressive decoding")
            if same != n:
                broken.append(r.name)
    _write(args, results, devices, errors=errors)
    for c, e in errors:
        print(f"FAILED {json.dumps(c)}: {e}")
    for label in broken:
        print(f"FAILED {label}: the batch-invariant mode changed a token")
    print(f"wrote {args.json}")
    return 1 if errors or broken else 0


def _params(args):
    """Greedy params, or (``--temperature`` > 0) sampled ones seeded ``--seed``: request ``i``
    of a call gets ``seed + i`` (:func:`speculum.bench.methods.per_request`), so a prompt is
    sampled with the same seed in every config."""
    from speculum.sampling import SamplingParams

    if args.temperature == 0:
        return SamplingParams(temperature=0, max_tokens=args.max_tokens)
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                          max_tokens=args.max_tokens)


def _write(args, results, devices, errors=(), partial: bool = False) -> None:
    device, threads = devices[0]
    base = results[0]
    report = {"device": device, "threads": threads,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor(),
              "batch_size": args.batch_size, "max_tokens": args.max_tokens, "batch_invariant": args.batch_invariant,
              "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
              "seed": args.seed if args.temperature > 0 else None,
              "overlap": not args.no_overlap,
              "prompts_per_category": args.prompts_per_category, "partial": partial, "pooled": _pooled(args),
              "interleave": args.interleave, "rounds": _rounds(args),
              "results": [r.as_dict(base, greedy=args.temperature == 0) for r in results],
              "failed": [{"config": c, "error": e} for c, e in errors]}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))


def drift_lines(results, again) -> list[str]:
    """The run's drift (the repeated baseline ``again`` against the first, ``results[0]``) and
    every config's speedup against the repeated baseline too: the two bracket a ratio when
    the first engine of a process runs slower than later ones (every fifteenth-session run
    on the H200: 1.11-1.20x)."""
    x = again.speedup(results[0])
    against = [(r.name, r.speedup(again)) for r in results[1:] if r is not again]
    return [f"drift: autoregressive decoding measured again after every config ran at "
            f"{'-' if x is None else f'{x:.3f}'}x its first run (the same work: ratios of this run "
            "are uncertain by about that much)",
            "against the repeated baseline: " + ", ".join(
                f"{name} {'-' if v is None else f'{v:.2f}'}x" for name, v in against)]
