"""``speculum bench states``: what the hidden states of one training batch cost.

Training batches (`speculum train`, length-bucketed as the trainer draws them) of a
distillation cache, gathered from recorded states (``--states disk``, where the cache has
them) and made online (``--states online``) at each ``--chunks`` prefill chunk: ms per
batch, median and 90th percentile, and how far the online states are from the recorded
ones. Prints a table and writes JSON.
"""

from __future__ import annotations

import json
import random
import statistics
import time
import types
from pathlib import Path

import torch

WARMUP = 2  # batches made before timing (first shapes, allocator growth)


def add_parser(sub) -> None:
    p = sub.add_parser("states", help="ms per training batch: hidden states read from a cache against made online")
    p.add_argument("cache", nargs="+", help="distillation cache folders ($SPECULUM_CACHE/distill/<model>-<key>)")
    p.add_argument("--model", default=None, help="the target the cache was made with (default: SmolLM2-135M-Instruct)")
    p.add_argument("--layers", default="-1",
                   help="target layers, comma separated (-1: the final state; EAGLE-3 on the default model: "
                        "1,14,26,-1; a list that starts with a minus is written --layers=-1,0)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per batch (speculum train --batch-size)")
    p.add_argument("--max-len", type=int, default=640, help="tokens per sequence (speculum train --max-len)")
    p.add_argument("--batches", type=int, default=20, help="batches timed per source")
    p.add_argument("--chunks", default="512,2048", help="prefill chunks of the online engine, comma separated")
    p.add_argument("--max-model-len", type=int, default=2048, help="context of the online engine")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda")
    p.add_argument("--dtype", default="auto", help="the online engine's dtype (auto: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of the batch order")
    p.add_argument("--json", default="results/bench_states.json", help="where the JSON goes")
    p.set_defaults(func=run)


def _timed(data, batches, max_len: int, device) -> tuple[list[float], object]:
    """Seconds of each batch after the warm-up, and the first batch."""
    cuda = torch.device(device).type == "cuda"
    out, first = [], None
    for i, ids in enumerate(batches):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        b = data.batch(ids, max_len, device)
        if cuda:
            torch.cuda.synchronize()
        if i >= WARMUP:
            out.append(time.perf_counter() - t0)
        if first is None:
            first = b
    return out, first


def run(args) -> int:
    import attrs

    from speculum.backends.torch import resolve_device
    from speculum.model_source import resolve_model_path
    from speculum.train.data import cache_shards
    from speculum.train.generate import release_engines
    from speculum.train.loop import length_buckets, load_data
    from speculum.train.online import online_states

    layers = tuple(sorted(int(x) for x in args.layers.split(",") if x.strip()))
    chunks = [int(x) for x in args.chunks.split(",") if x.strip()]
    device = resolve_device(args.device)
    shards = [f for d in args.cache for f in cache_shards(d)]
    recorded = load_data(Path(args.cache[0]), layers, shards, device)
    answers = attrs.evolve(recorded, hidden={})  # the same tokens, read once
    batches = length_buckets(answers, list(range(len(answers))), args.batch_size, random.Random(args.seed))
    batches = batches[: args.batches + WARMUP]
    tokens = statistics.mean(answers.num_tokens(b) for b in batches)
    rows, ref = [], None
    if set(recorded.hidden) == set(layers):
        times, ref = _timed(recorded, batches, args.max_len, device)
        rows.append({"source": "recorded", "prefill_chunk": None, "seconds": times})
    del recorded
    spec = types.SimpleNamespace(model=str(resolve_model_path(args.model)), seed=0)
    for c in chunks:
        src = online_states(spec, layers, device, None, args.dtype, args.batch_size, args.max_model_len,
                            prefill_chunk=c)  # the source training uses, at chunk c
        times, first = _timed(attrs.evolve(answers, states=src), batches, args.max_len, device)
        diff = None if ref is None else max(float((first.hidden[l] - ref.hidden[l]).abs().max()) for l in layers)
        rows.append({"source": "online", "prefill_chunk": c, "seconds": times, "max_abs_diff_to_recorded": diff})
        release_engines()
    base = statistics.median(rows[0]["seconds"]) if rows and rows[0]["source"] == "recorded" else None
    print(f"{len(batches) - WARMUP} batches of {args.batch_size} sequences ({tokens:.0f} tokens on average), layers "
          f"{list(layers)}, {device}")
    print(f"{'states':>10} {'chunk':>6} {'ms median':>10} {'ms p90':>8} {'x recorded':>11} {'max diff':>9}")
    for r in rows:
        s = sorted(r["seconds"])
        r["ms_median"] = 1e3 * statistics.median(s)
        r["ms_p90"] = 1e3 * s[min(len(s) - 1, int(0.9 * len(s)))]
        r["x_recorded"] = None if base is None else statistics.median(s) / base
        diff = r.get("max_abs_diff_to_recorded")
        print(f"{r['source']:>10} {r['prefill_chunk'] or '-':>6} {r['ms_median']:>10.1f} {r['ms_p90']:>8.1f} "
              f"{'-' if r['x_recorded'] is None else format(r['x_recorded'], '.2f'):>11} "
              f"{'-' if diff is None else format(diff, '.4f'):>9}")
    if base is None:
        print(f"(the cache holds no states of layers {list(layers)}: online only)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({
        "device": str(device), "gpu": torch.cuda.get_device_name() if torch.device(device).type == "cuda" else None,
        "layers": list(layers), "batch_size": args.batch_size, "max_len": args.max_len,
        "batches": len(batches) - WARMUP, "mean_tokens_per_batch": tokens, "cache": [str(d) for d in args.cache],
        "rows": rows}, indent=2))
    print(f"wrote {args.json}")
    return 0
