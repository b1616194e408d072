"""Step cost of candidate draft-model shapes, measured, and the shape to train.

``python -m speculum.train.draft_shapes [--model TARGET] [--layers 1,2,3,4,6] [--widths 384,576,768]
[--k 4] [--json FILE]`` builds each candidate Llama (random weights: step time does not
depend on their values) with the target's vocabulary, runs it through the native
runner exactly as the draft_model method does (CUDA graphs on a GPU, batch 1, a context
of ``--context`` tokens) and times one draft forward of 1 token and of 2 tokens (the
catch-up after a verify step that accepted one draft). The target's shape is timed the
same way, decoding 1 token and verifying ``k + 1``.

A chain of ``k`` drafts costs ``t_draft(2) + (k - 1) t_draft(1)``; a speculative step
costs that plus ``t_target(k + 1)`` and yields MAL tokens where plain decoding yields one
per ``t_target(1)``, so the draft pays off above the *break-even* acceptance length
``(t_target(k + 1) + chain) / t_target(1)``. The recommended shape is the largest (most
parameters) whose break-even stays at or below ``--max-break-even`` (default 1.6: with the
acceptance length of 2.2 aimed at, at least 1.37x). Prints a table, writes JSON with
every row and ``"recommended"`` (what ``speculum train draft --shape FILE`` reads).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Sequence

import torch

from speculum.bench.step import SHAPES

#: the default target's shape (SmolLM2-135M-Instruct)
SMOLLM2 = SHAPES["smollm2-135m"]


def target_arch(model: str | None):
    """The target's LlamaArch: from a checkpoint's config.json, or SmolLM2-135M's shape."""
    from speculum.backends.torch import LlamaArch, arch_from_config
    if not model:
        return LlamaArch(**SMOLLM2)
    from speculum.proposers.head_checkpoint import read_config
    p = Path(model)
    if p.suffix == ".gguf":
        from speculum.model_source import resolve_model_path
        p = resolve_model_path(str(p))
    return arch_from_config(read_config(p))


def candidate(target, layers: int, width: int, mlp: float = 1.0):
    """A draft shape: ``layers`` x ``width``, the target's vocabulary, head size and query /
    KV head ratio, an MLP of the target's width ratio (rounded to 64) times ``mlp``."""
    import attrs
    heads = max(1, width // target.head_dim)
    kv = max(1, heads * target.num_kv_heads // target.num_heads)
    while heads % kv:
        kv -= 1
    base = target.intermediate_size if width == target.hidden_size else \
        width * target.intermediate_size / target.hidden_size
    inter = max(64, 64 * round(base * mlp / 64))
    return attrs.evolve(target, num_layers=layers, hidden_size=width, intermediate_size=inter, num_heads=heads,
                        num_kv_heads=kv, head_dim=width // heads)


def time_forward(arch, query_lens: Sequence[int], device, dtype, context: int, iters: int) -> dict[int, float]:
    """Milliseconds per native-runner forward of batch 1 for each query length (graphed on CUDA)."""
    from speculum.backends.torch import NativeRunner, random_native
    from speculum.kv import PagedKVAllocator
    model = random_native(arch, dtype, device)
    max_len = context + max(query_lens) + 16
    runner = NativeRunner(model, max_model_len=max_len)
    runner.attach_cache(PagedKVAllocator("shape", -(-max_len // 16) + 2, 16, max_len))
    runner.allocator.allocate(0, context)
    out = {}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for q in query_lens:
        tok = torch.randint(0, arch.vocab_size, (1, q), device=device)
        for _ in range(3):  # capture and warm up
            runner.forward([0], tok, [q])
            runner.truncate(0, context)
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            runner.forward([0], tok, [q])
            runner.truncate(0, context)
        sync()
        out[q] = (time.perf_counter() - t0) / iters * 1e3
    runner.remove(0)
    del runner, model
    return out


def params_of(arch) -> int:
    """Parameters of a Llama of this shape (embedding counted once when tied)."""
    H, I, V = arch.hidden_size, arch.intermediate_size, arch.vocab_size
    attn = H * (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim + arch.num_heads * arch.head_dim * H
    layer = attn + 3 * H * I + 2 * H
    return arch.num_layers * layer + V * H * (1 if arch.tie_word_embeddings else 2) + H


def measure(target, layers: Sequence[int], widths: Sequence[int], k: int = 4, context: int = 512, iters: int = 50,
            device: str = "auto", dtype: str = "bfloat16", max_break_even: float = 1.6,
            mlps: Sequence[float] = (1.0,)) -> dict:
    """Time the target and every candidate shape; returns the table and the recommendation."""
    from speculum.backends.torch import resolve_device, resolve_dtype
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    t = time_forward(target, (1, k + 1), dev, dt, context, iters)
    rows = []
    for L in layers:
        for W, mlp in [(w, m) for w in widths for m in mlps]:
            arch = candidate(target, L, W, mlp)
            d = time_forward(arch, (1, 2), dev, dt, context, iters)
            chain = d[2] + (k - 1) * d[1]
            rows.append({"num_layers": L, "hidden_size": arch.hidden_size, "intermediate_size": arch.intermediate_size,
                         "num_heads": arch.num_heads, "num_kv_heads": arch.num_kv_heads, "params": params_of(arch),
                         "ms_q1": round(d[1], 4), "ms_q2": round(d[2], 4), "chain_ms": round(chain, 4),
                         "break_even_mal": round((t[k + 1] + chain) / t[1], 3)})
    fits = [r for r in rows if r["break_even_mal"] <= max_break_even]
    best = max(fits, key=lambda r: (r["params"], -r["chain_ms"])) if fits else min(rows, key=lambda r: r["chain_ms"])
    keys = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads")
    return {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "dtype": str(dt),
            "k": k, "context": context, "target": {"num_layers": target.num_layers, "hidden_size": target.hidden_size,
                                                   "ms_q1": round(t[1], 4), f"ms_q{k + 1}": round(t[k + 1], 4)},
            "max_break_even": max_break_even, "rows": rows, "recommended": {k_: best[k_] for k_ in keys}}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m speculum.train.draft_shapes", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="target checkpoint (default: SmolLM2-135M-Instruct's shape)")
    p.add_argument("--layers", default="1,2,3,4,6")
    p.add_argument("--widths", default="384,576,768")
    p.add_argument("--mlp-widths", default="1", metavar="X[,X...]",
                   help="MLP widths to try, as multiples of the target's MLP-to-width ratio (e.g. 1,2,3: at batch 1 "
                        "a layer's cost is mostly its launches, so a wider MLP adds capacity almost for free)")
    p.add_argument("--k", type=int, default=4, help="chain length")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-break-even", type=float, default=1.6)
    p.add_argument("--json", default="draft_shapes.json")
    a = p.parse_args(argv)
    res = measure(target_arch(a.model), [int(x) for x in a.layers.split(",")], [int(x) for x in a.widths.split(",")],
                  a.k, a.context, a.iters, a.device, a.dtype, a.max_break_even,
                  [float(x) for x in a.mlp_widths.split(",")])
    t = res["target"]
    print(f"target ({t['num_layers']} x {t['hidden_size']}) on {res['device']}: {t['ms_q1']:.3f} ms decode, "
          f"{t[f'ms_q{a.k + 1}']:.3f} ms verify of {a.k + 1}")
    print(f"{'layers':>6} {'width':>5} {'mlp':>5} {'params':>8} {'ms q=1':>7} {'ms q=2':>7} "
          f"{'chain k=' + str(a.k):>10} {'break-even MAL':>14}")
    for r in res["rows"]:
        print(f"{r['num_layers']:>6} {r['hidden_size']:>5} {r['intermediate_size']:>5} {r['params'] / 1e6:>7.1f}M "
              f"{r['ms_q1']:>7.3f} {r['ms_q2']:>7.3f} {r['chain_ms']:>10.3f} {r['break_even_mal']:>14.2f}")
    print(f"recommended: {res['recommended']}")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
