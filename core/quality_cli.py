"""``speculum verify-quality``: the command line of :mod:`speculum.quality`."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "verify-quality", help="check on a prompt set that speculation leaves the output unchanged",
        description="Run a prompt set (default: MT-bench) without and with speculation: greedy exact-match rate, "
                    "the first divergence of each differing output and its cause (a near-tie in the target's logits "
                    "or a real mismatch); with --samples, a two-sample test per position and the mean target "
                    "log-probability of each side. Exits 1 when a verifier that claims losslessness fails.")
    p.add_argument("--model", default=None, help="target: transformers directory or .gguf (default: SmolLM2-135M)")
    p.add_argument("--speculative-config", required=True, metavar="JSON",
                   help='the speculation to check, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                        '(its acceptance_method is the verifier under test)')
    p.add_argument("--dataset", default=None, metavar="JSONL",
                   help='one {"prompt": "text" or [token ids]} per line (default: the shipped MT-bench questions)')
    p.add_argument("--num-prompts", type=int, default=16, help="prompts to run")
    p.add_argument("--no-chat", action="store_true", help="text prompts as plain text, not chat messages")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--tie-margin", type=float, default=None,
                   help="a divergence is a near-tie when the target's top two log-probabilities differ by at most "
                        "this (default: 1e-3 in float32, 0.1 in bfloat16/float16)")
    p.add_argument("--samples", type=int, default=0, help="sampled check: samples per prompt and side (0: greedy only)")
    p.add_argument("--positions", type=int, default=4, help="sampled check: tokens per sample (one test each)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampled check: temperature")
    p.add_argument("--top-k", type=int, default=0, help="sampled check: top-k (0: off)")
    p.add_argument("--alpha", type=float, default=1e-3, help="sampled check: run-wide false-alarm rate (Bonferroni)")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--max-num-seqs", type=int, default=16, help="sequences decoded together")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled check")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="import MODULE and register it as a plugin in this process (e.g. a verifier under "
                        "development); repeatable")
    p.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON")
    from speculum.cli import add_backend_args
    add_backend_args(p)
    p.set_defaults(func=cmd_verify_quality)
    return p


def _prompts(args) -> tuple[list, list[str]]:
    from speculum.bench.datasets import load_prompts
    raw = load_prompts(args.dataset, args.num_prompts)
    prompts, labels = [], []
    for p in raw:
        if isinstance(p, str):
            prompts.append(p if args.no_chat else [{"role": "user", "content": p}])
            labels.append(p.replace("\n", " ")[:40])
        else:
            prompts.append({"prompt_token_ids": p})
            labels.append(f"{len(p)} token ids")
    return prompts, labels


def cmd_verify_quality(args) -> int:
    from speculum.cli import engine_options
    from speculum.config import SpeculativeConfig
    from speculum.engine import LLM
    from speculum.quality import format_report, run_quality

    spec = SpeculativeConfig.from_cli(args.speculative_config)
    plugins = [importlib.import_module(m) for m in args.plugin]
    common = dict(model=args.model, dtype=args.dtype, device=args.device, seed=args.seed,
                  max_num_seqs=args.max_num_seqs, plugins=plugins, **engine_options(args))
    prompts, labels = _prompts(args)
    base = LLM(**common)
    fast = LLM(speculative_config=spec, **common)
    margin = args.tie_margin
    if args.batch_invariant:
        # the mode promises identity: a divergence is a failure whatever the logits' gap
        margin = -1.0  # below any log-probability gap: no divergence is excused as a near-tie
        print("verify-quality: batch-invariant mode: greedy identity is the check (every divergence fails)",
              file=sys.stderr, flush=True)
    elif margin is None:
        margin = 1e-3 if str(base.backend.dtype) == "torch.float32" else 0.1
    report = run_quality(base, fast, prompts, max_tokens=args.max_tokens, tie_margin=margin, samples=args.samples,
                         positions=args.positions, temperature=args.temperature, top_k=args.top_k, alpha=args.alpha,
                         seed=args.seed, progress=lambda m: print(f"verify-quality: {m}", file=sys.stderr, flush=True))
    print(format_report(report, labels))
    if args.json:
        out = {"speculative_config": spec.to_dict(), "tie_margin": margin, "dtype": str(base.backend.dtype),
               "batch_invariant": bool(args.batch_invariant),
               "labels": labels, **report.as_dict()}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
        print(f"wrote {args.json}")
    return 1 if report.failed else 0
