"""Prefill time of prompts whose lengths are all different (every chat request), batch 1:
SDPA with cuDNN's fused attention allowed (torch's default on an H100/H200) against without
it (speculum's default since 2026-12-03). A SmolLM2-135M-shaped model with random weights;
the two variants take turns, each on lengths the other never sees (cuDNN's plans are cached
per shape, so a length seen once is cheap the second time); prints the median and mean
time to the first token, and writes JSON.

    python scripts/device/prefill_shapes.py [--prompts 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from profile_generation import smollm2_random  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=40, help="prompts per variant")
    ap.add_argument("--tiny", action="store_true", help="2 layers of width 64 (a dry run on the CPU)")
    ap.add_argument("--json")
    a = ap.parse_args()
    from speculum.backends.torch.native import attention
    from speculum.engine import LLM
    from speculum.sampling import SamplingParams
    model = smollm2_random(Path("/tmp/smol_rand_tiny" if a.tiny else "/tmp/smol_rand"), a.tiny)
    llm = LLM(str(model), dtype="bfloat16" if torch.cuda.is_available() else "float32", max_model_len=2048)
    rng = random.Random(0)
    lengths = rng.sample(range(40, 1200), 2 * a.prompts)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5] * 32}], params)  # warm-up (graphs, kernels)
    keep = attention.sdpa_kernel
    times: dict[str, list[float]] = {"cudnn allowed": [], "no cudnn": []}
    for i, n in enumerate(lengths):
        name = "cudnn allowed" if i % 2 == 0 else "no cudnn"
        attention.sdpa_kernel = None if name == "cudnn allowed" else keep
        prompt = {"prompt_token_ids": [rng.randrange(3, 49000) for _ in range(n)]}
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate([prompt], params)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times[name].append((time.perf_counter() - t0) * 1e3)
    attention.sdpa_kernel = keep
    res = {name: {"median_ms": round(statistics.median(t), 2), "mean_ms": round(statistics.fmean(t), 2),
                  "max_ms": round(max(t), 2), "prompts": len(t)} for name, t in times.items()}
    print(f"{'variant':<15} {'median ms':>10} {'mean ms':>10} {'max ms':>10}")
    for name, r in res.items():
        print(f"{name:<15} {r['median_ms']:>10} {r['mean_ms']:>10} {r['max_ms']:>10}")
    if a.json:
        Path(a.json).write_text(json.dumps({"device": torch.cuda.get_device_name() if torch.cuda.is_available()
                                            else "cpu", "results": res}, indent=2))


if __name__ == "__main__":
    main()
