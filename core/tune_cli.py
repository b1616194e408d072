"""``speculum tune``: the command line of :mod:`speculum.tune`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _ints(text: str) -> list[int]:
    try:
        out = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of integers, e.g. 1,4,16; got {text!r}") from None
    if not out or out[0] < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {text!r}")
    return out


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "tune", help="measure acceptance and verify cost here; recommend a speculation config per load level",
        description="On a prompt sample and this machine: measure each method's acceptance and drafting cost and "
                    "the target's verify cost curve, predict tokens/s for every (method, k) and no speculation at "
                    "each load level, recommend the best, and print the rows of the tuning guide (docs/tuning.md) "
                    "that apply. --check also measures every candidate and prints how close the recommendation "
                    "came to the best measured.")
    p.add_argument("--model", default=None, help="target: transformers directory or .gguf (default: SmolLM2-135M)")
    p.add_argument("--speculative-config", action="append", default=None, metavar="JSON",
                   help="a candidate method (its num_speculative_tokens is replaced by 1..--max-k); repeatable "
                        "(default: ngram, and the shipped EAGLE-3 head for the default model)")
    p.add_argument("--max-k", type=int, default=4, help="longest speculation length tried")
    p.add_argument("--batch-sizes", type=_ints, default=[1, 4, 16], metavar="B1,B2,...",
                   help="load levels: requests decoded together (default 1,4,16)")
    p.add_argument("--dataset", default=None, metavar="JSONL",
                   help='one {"prompt": "text" or [token ids]} per line (default: the shipped MT-bench questions)')
    p.add_argument("--num-prompts", type=int, default=8, help="prompts run at every load level")
    p.add_argument("--no-chat", action="store_true", help="text prompts as plain text, not chat messages")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per prompt (EOS ignored: equal lengths)")
    p.add_argument("--repeats", type=int, default=1,
                   help="measure every configuration this many times (round robin) and keep the fastest: on a "
                        "shared machine other processes only slow runs down")
    p.add_argument("--check", action="store_true",
                   help="measure every candidate as well, and compare the recommendation with the best measured")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON")
    from speculum.cli import add_backend_args
    add_backend_args(p)
    p.set_defaults(func=cmd_tune)
    return p


def _methods(args) -> dict[str, dict]:
    from speculum.cli import DEFAULT_COMPARE, _installed
    from speculum.config import SpeculativeConfig
    from speculum.errors import ConfigError
    from speculum.proposers.first_draft import split_method
    if args.speculative_config:
        cfgs = []
        for v in args.speculative_config:  # k is tune's to choose: it may be left out
            raw = SpeculativeConfig.from_cli(v) if '"num_speculative_tokens"' in v else None
            if raw is None:
                data = json.loads(v) if v.strip().startswith("{") else None
                if not isinstance(data, dict):
                    raise ConfigError(f"--speculative-config must be a JSON object, got {v!r}")
                raw = SpeculativeConfig.from_dict({**data, "num_speculative_tokens": 1})
            cfgs.append(raw.to_dict())
    elif args.model is None:
        # the single methods (a composite's acceptance is its parts' where each drafts)
        cfgs = _installed([dict(c) for c in DEFAULT_COMPARE if len(split_method(c["method"])) == 1])
    else:
        cfgs = [{"method": "ngram", "num_speculative_tokens": 1}]
    out: dict[str, dict] = {}
    for c in cfgs:
        c = {k: v for k, v in c.items() if v is not None and v != {} and k not in
             ("num_speculative_tokens", "num_speculative_tokens_per_batch_size")}
        name = c.get("method") or Path(str(c.get("model"))).name
        while name in out:
            name += "'"
        out[name] = c
    return out


def cmd_tune(args) -> int:
    from speculum.bench.datasets import load_prompts
    from speculum.cli import engine_options
    from speculum.engine import LLM
    from speculum.errors import ConfigError
    from speculum.sampling import SamplingParams
    from speculum.tune import format_report, tune

    if args.max_k < 1:
        raise ConfigError("--max-k must be >= 1")
    methods = _methods(args)
    raw = load_prompts(args.dataset, args.num_prompts)
    prompts = [({"prompt_token_ids": p} if not isinstance(p, str) else
                (p if args.no_chat else [{"role": "user", "content": p}])) for p in raw]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    common = dict(model=args.model, dtype=args.dtype, device=args.device,
                  max_num_seqs=max(args.batch_sizes), **engine_options(args))

    def make(cfg):
        return LLM(speculative_config=cfg, **common)

    print(f"tune: {len(prompts)} prompts x {args.max_tokens} tokens; methods {', '.join(methods)}; k = 1.."
          f"{args.max_k}; batch sizes {', '.join(map(str, args.batch_sizes))}", file=sys.stderr)
    report = tune(make, methods, prompts, params, args.batch_sizes, args.max_k, check=args.check,
                  repeats=max(1, args.repeats),
                  progress=lambda m: print(f"tune: {m}", file=sys.stderr, flush=True))
    print(format_report(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "func"},
                                               **report.as_dict()}, indent=2, default=str))
        print(f"wrote {args.json}")
    if args.check and any(lv.accuracy is not None and lv.accuracy < 0.9 for lv in report.levels):
        return 1
    return 0
