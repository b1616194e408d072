"""``speculum bench offline``: tokens/s of autoregressive decoding against each method.

Per MT-bench category: tokens/s without speculation and with each method, the speedup
(a ratio measured in the same process), mean acceptance length, and whether outputs are
token-identical (greedy). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch


def add_parser(sub) -> None:
    p = sub.add_parser("offline", help="offline throughput per MT-bench category: autoregressive vs methods")
    p.add_argument("--model", default=None)
    p.add_argument("--method", action="append", default=[], metavar="JSON",
                   help='a speculative config (repeatable), e.g. \'{"method":"ngram","num_speculative_tokens":4}\'')
    p.add_argument("--prompts-per-category", type=int, default=2)
    p.add_argument("--categories", default=None, help="comma separated (default: all)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--runner", default=None, help="auto, native or hf")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--mt-bench", default=None, help="MT-bench JSONL (default: shared/data/mt_bench.jsonl)")
    p.add_argument("--profile", action="store_true",
                   help="also time one step of each config split into draft, verify and host work (first "
                        "prompt of each category, after the throughput run)")
    p.add_argument("--json", default="results/bench_offline.json")
    p.set_defaults(func=run)


def _prompts(args) -> dict[str, list]:
    from speculum.testing import mt_bench_prompts, shared_dir
    path = Path(args.mt_bench) if args.mt_bench else shared_dir() / "data" / "mt_bench.jsonl"
    rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    cats: dict[str, list] = {}
    wanted = set(args.categories.split(",")) if args.categories else None
    for r in rows:
        c = r.get("category", "-")
        if wanted and c not in wanted:
            continue
        if len(cats.setdefault(c, [])) < args.prompts_per_category:
            cats[c].append([{"role": "user", "content": r["turns"][0]}])
    return cats


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _measure(llm, cats, params):
    """Run every category; returns {category: (tokens, seconds, outputs)}."""
    out = {}
    for cat, prompts in cats.items():
        _sync(llm.backend.device)
        t0 = time.perf_counter()
        res = llm.generate(prompts, params)
        _sync(llm.backend.device)
        out[cat] = (sum(len(o.token_ids) for o in res), time.perf_counter() - t0, res)
    return out


def run(args) -> int:
    from speculum.bench.step_profile import config_label, profile_steps, profile_table
    from speculum.engine import LLM
    from speculum.sampling import SamplingParams

    cats = _prompts(args)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    configs = [None] + [json.loads(m) for m in args.method]
    opts = dict(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.batch_size,
                cuda_graphs=not args.enforce_eager)
    if args.runner:
        opts["runner"] = args.runner
    results = []
    base = None
    for cfg in configs:
        llm = LLM(speculative_config=cfg, **opts)
        warm = [p for ps in cats.values() for p in ps][: args.batch_size]
        llm.generate(warm, SamplingParams(temperature=0, max_tokens=min(32, args.max_tokens)))
        llm.stats = type(llm.stats)()
        name = config_label(cfg, llm.speculative_config)
        meas = _measure(llm, cats, params)
        row = {"method": name, "config": cfg, "categories": {}}
        for cat, (ntok, dt, outs) in meas.items():
            m = type(llm.stats)()
            for o in outs:
                m.merge(o.metrics)
            entry = {"tokens": ntok, "seconds": dt, "tokens_per_s": ntok / dt,
                     "mean_acceptance_length": m.mean_acceptance_length,
                     "draft_acceptance_rate": m.draft_acceptance_rate}
            if base is not None:
                b = base["categories"][cat]
                entry["speedup"] = entry["tokens_per_s"] / b["tokens_per_s"]
                entry["identical"] = all(x.token_ids == y.token_ids for x, y in zip(base["_outs"][cat], outs))
            row["categories"][cat] = entry
        tot_tok = sum(v[0] for v in meas.values())
        tot_s = sum(v[1] for v in meas.values())
        row["total"] = {"tokens": tot_tok, "seconds": tot_s, "tokens_per_s": tot_tok / tot_s,
                        "mean_acceptance_length": llm.metrics.mean_acceptance_length,
                        "acceptance_per_position": llm.metrics.acceptance_rate_per_position()}
        if args.profile:
            row["profile"] = profile_steps(llm, [ps[0] for ps in cats.values()], params)
        if base is not None:
            row["total"]["speedup"] = row["total"]["tokens_per_s"] / base["total"]["tokens_per_s"]
            row["total"]["identical"] = all(e["identical"] for e in row["categories"].values())
        else:
            row["_outs"] = {c: v[2] for c, v in meas.items()}
            base = row
        results.append(row)
        device = str(llm.backend.device)
        del llm
        import gc
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    _print_table(results)
    if args.profile:
        print(profile_table(results))
    report = {"device": device, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor(),
              "batch_size": args.batch_size, "max_tokens": args.max_tokens,
              "prompts_per_category": args.prompts_per_category,
              "results": [{k: v for k, v in r.items() if k != "_outs"} for r in results]}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    return 0


def _print_table(results) -> None:
    base = results[0]
    cats = list(base["categories"]) + ["total"]
    head = f"{'category':<12}{'AR tok/s':>10}"
    for r in results[1:]:
        head += f" | {r['method'][:22]:>22} {'tok/s':>7} {'x':>5} {'MAL':>5} {'same':>4}"
    print(head)
    for c in cats:
        b = base["categories"].get(c) or base["total"]
        line = f"{c:<12}{b['tokens_per_s']:>10.1f}"
        for r in results[1:]:
            e = r["categories"].get(c) or r["total"]
            mal = e.get("mean_acceptance_length")
            line += (f" | {'':>22} {e['tokens_per_s']:>7.1f} {e['speedup']:>5.2f} "
                     f"{(mal or 0):>5.2f} {'yes' if e['identical'] else 'NO':>4}")
        print(line)
