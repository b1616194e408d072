"""``speculum bench backends``: the same ``LLM(...)`` code on several backends, tokens/s side by side.

For each backend and each speculative config (none first, then every ``--method``), the
engine is built with one argument changed, ``backend=...``. A first pass over the prompts
compiles / captures every step shape that occurs (JAX jit, CUDA graphs); the timed pass
repeats it, so the figures are steady-state decoding. Greedy outputs of every backend are
compared with the first backend's. Prints a table and writes JSON.

``--separate-processes`` runs each backend in a fresh process (one after the other), so
neither sees the other's allocator caches or libraries; their results are merged here.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("backends", help="tokens/s of the same LLM(...) code on several backends (torch, jax)")
    p.add_argument("--backend", default="torch,jax", help="comma separated backends (default: torch,jax)")
    p.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--method", action="append", default=[], metavar="JSON",
                   help='a speculative config (repeatable), e.g. \'{"method":"ngram","num_speculative_tokens":4}\'')
    p.add_argument("--num-prompts", type=int, default=10, help="MT-bench questions (first turns), in order")
    p.add_argument("--dataset", default=None, metavar="JSONL", help="prompts instead of MT-bench")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt at most")
    p.add_argument("--batch-size", type=int, default=1, help="max_num_seqs")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on a GPU), float32, bfloat16")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda")
    p.add_argument("--separate-processes", action="store_true",
                   help="run each backend in a fresh process (cleanest on a GPU shared by torch and JAX)")
    p.add_argument("--json", default="results/bench_backends.json", help="where the JSON goes")
    p.add_argument("--child-json", default=None, help=argparse.SUPPRESS)  # one backend's raw runs
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from speculum.errors import ConfigError

    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    if not backends:
        raise ConfigError("--backend needs at least one backend name, e.g. torch,jax")
    if args.child_json:
        Path(args.child_json).write_text(json.dumps(run_backend(args, backends[0])))
        return 0
    runs = {b: run_child(args, b) if args.separate_processes else run_backend(args, b) for b in backends}
    rows = merge(runs, backends)
    print(table(rows, backends))
    report = {"backends": backends, "environment": environment(), "model": args.model, "dtype": args.dtype,
              "device": args.device, "batch_size": args.batch_size, "max_tokens": args.max_tokens,
              "num_prompts": args.num_prompts, "separate_processes": args.separate_processes, "results": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    return 0


def run_backend(args: argparse.Namespace, backend: str) -> list[dict]:
    """Every config on ``backend``: one entry per config, with the output token ids."""
    from speculum.bench.datasets import load_prompts
    from speculum.engine import LLM
    from speculum.metrics import SpecDecodeMetrics
    from speculum.sampling import SamplingParams

    texts = load_prompts(args.dataset, args.num_prompts)
    prompts = [[{"role": "user", "content": t}] if isinstance(t, str) else {"prompt_token_ids": t} for t in texts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    out = []
    for cfg in [None] + [json.loads(m) for m in args.method]:
        t0 = time.perf_counter()
        # the one argument that differs between the backends' runs
        llm = LLM(model=args.model, speculative_config=cfg, backend=backend, dtype=args.dtype, device=args.device,
                  max_num_seqs=args.batch_size)
        load_s = time.perf_counter() - t0
        spec = llm.speculative_config
        method = "autoregressive" if spec is None else f"{spec.method}(k={spec.num_speculative_tokens})"
        t0 = time.perf_counter()
        llm.generate(prompts, params)  # compiles / captures every shape the timed pass meets
        first_s = time.perf_counter() - t0
        llm.stats = SpecDecodeMetrics()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        secs = time.perf_counter() - t0
        tokens = sum(len(o.token_ids) for o in outs)
        out.append({"method": method, "config": cfg, "tokens": tokens, "seconds": secs, "tokens_per_s": tokens / secs,
                    "load_s": load_s, "first_pass_s": first_s,
                    "mean_acceptance_length": llm.metrics.mean_acceptance_length,
                    "device": str(llm.backend.device), "token_ids": [o.token_ids for o in outs]})
        print(f"bench backends: {method} on {backend}: {tokens / secs:.1f} tok/s "
              f"(first pass {first_s:.1f} s, load {load_s:.1f} s)", flush=True)
        del llm
        gc.collect()
        _release_gpu_cache()
    return out


def run_child(args: argparse.Namespace, backend: str) -> list[dict]:
    """:func:`run_backend` in a fresh Python process."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "runs.json"
        argv = ["bench", "backends", "--backend", backend, "--num-prompts", str(args.num_prompts),
                "--max-tokens", str(args.max_tokens), "--batch-size", str(args.batch_size), "--dtype", args.dtype,
                "--device", args.device, "--child-json", str(path)]
        argv += ["--model", args.model] if args.model else []
        argv += ["--dataset", args.dataset] if args.dataset else []
        for m in args.method:
            argv += ["--method", m]
        code = "import sys; from speculum.cli import main; sys.exit(main(sys.argv[1:]))"
        subprocess.run([sys.executable, "-c", code, *argv], check=True)
        return json.loads(path.read_text())


def merge(runs: dict[str, list[dict]], backends: list[str]) -> list[dict]:
    """One row per config: each backend's figures, and whether its outputs equal the first's."""
    first = backends[0]
    rows = []
    for i, ref in enumerate(runs[first]):
        row = {"method": ref["method"], "config": ref["config"], "backends": {}}
        for b in backends:
            entry = {k: v for k, v in runs[b][i].items() if k not in ("token_ids", "method", "config")}
            if b != first:
                entry["identical_to_" + first] = runs[b][i]["token_ids"] == ref["token_ids"]
            row["backends"][b] = entry
        rows.append(row)
    return rows


def _release_gpu_cache() -> None:
    """Hand torch's cached GPU memory back, so the next run (JAX has its own allocator)
    finds the card as the previous one did."""
    import torch
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def table(rows: list[dict], backends: list[str]) -> str:
    """One line per method: tokens/s of each backend, the ratio to the first, MAL, identical."""
    first = backends[0]
    head = f"{'method':<22}" + "".join(f" {b + ' tok/s':>12}" for b in backends)
    head += "".join(f" {b + '/' + first:>11} {'same':>5}" for b in backends[1:]) + f" {'MAL':>5}"
    lines = [head]
    for r in rows:
        e = r["backends"]
        line = f"{r['method']:<22}" + "".join(f" {e[b]['tokens_per_s']:>12.1f}" for b in backends)
        for b in backends[1:]:
            same = e[b].get("identical_to_" + first)
            line += f" {e[b]['tokens_per_s'] / e[first]['tokens_per_s']:>11.2f} {'yes' if same else 'NO':>5}"
        mal = e[first]["mean_acceptance_length"]
        lines.append(line + f" {(mal or 1.0):>5.2f}")
    return "\n".join(lines)


def environment() -> dict:
    """What the figures depend on: versions, devices, thread settings, load."""
    import torch
    env = {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "XLA_FLAGS": os.environ.get("XLA_FLAGS"),
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    try:
        import jax
        env["jax"] = jax.__version__
        env["jax_devices"] = [str(d) for d in jax.devices()]
    except ImportError:
        pass
    if hasattr(os, "getloadavg"):
        env["load_average_at_end"] = os.getloadavg()
    return env
