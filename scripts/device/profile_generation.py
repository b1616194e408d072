"""Where batched generation's time goes (issue 15's self-distillation throughput): a
SmolLM2-135M-shaped model with random weights (no model file), ``speculum.LLM`` at
``--batch`` sequences, kept full for ``--seconds`` (prompts of 100-300 random tokens,
answers of 50-384, ignore_eos), greedy and sampled rows mixed as the data mix does;
prints tokens/s, steps/s, the mean running batch and the host profile (cProfile).

    python scripts/device/profile_generation.py [--batch 512] [--seconds 30] [--sampled 0.6] [--profile] [--torch-profile 10] [--cudnn-too 3]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import time
from pathlib import Path

import torch


def smollm2_random(path: Path, tiny: bool = False) -> Path:
    """SmolLM2-135M's shape with random weights; ``tiny``: 2 layers of width 64 (a CPU dry run)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    if (path / "config.json").exists():
        return path
    shape = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
             if tiny else dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                               num_key_value_heads=3))
    cfg = LlamaConfig(vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, **shape)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(path))
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--sampled", type=float, default=0.6, help="share of sampled rows")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--torch-profile", type=int, default=0, metavar="STEPS",
                    help="after the timed part, STEPS more steps under torch.profiler: the top ops by device time")
    ap.add_argument("--cudnn-too", type=int, default=0, metavar="ROUNDS",
                    help="then ROUNDS pairs of windows (--seconds / ROUNDS each) in turn: without cuDNN's "
                         "attention (the default) and with it; ms per step of each and their ratio")
    ap.add_argument("--tiny", action="store_true", help="2 layers of width 64 (a dry run on the CPU)")
    ap.add_argument("--json")
    a = ap.parse_args()
    from speculum.engine import LLM
    from speculum.sampling import SamplingParams
    model = smollm2_random(Path("/tmp/smol_rand_tiny" if a.tiny else "/tmp/smol_rand"), a.tiny)
    llm = LLM(str(model), dtype="bfloat16" if torch.cuda.is_available() else "float32", max_num_seqs=a.batch,
              max_model_len=2048)
    rng = random.Random(0)
    n = 0

    def add():
        nonlocal n
        T = rng.random() < a.sampled
        llm.add_request(f"r{n}", {"prompt_token_ids": [rng.randrange(3, 49152) for _ in range(rng.randrange(100, 300))]},
                        SamplingParams(temperature=0.8 if T else 0.0, max_tokens=rng.randrange(50, 384),
                                       ignore_eos=True, seed=n if T else None))
        n += 1

    for _ in range(a.batch):
        add()
    for _ in range(5):
        llm.step(include_running=False)
    def timed(seconds: float) -> tuple[int, int, int, float]:
        """(steps, finished tokens, summed running rows, seconds) of the batch kept full."""
        steps = toks = running = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            while llm.num_waiting < a.batch // 8:
                add()
            running += llm.num_running if hasattr(llm, "num_running") else 0
            for out in llm.step(include_running=False):
                toks += len(out.token_ids)
            steps += 1
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return steps, toks, running, time.perf_counter() - t0

    def figures(steps: int, toks: int, running: int, dt: float) -> dict:
        return {"seconds": round(dt, 1), "steps": steps, "ms_per_step": round(dt / steps * 1e3, 2),
                "finished_tokens_per_s": round(toks / dt), "mean_running": round(running / steps, 1)}

    pr = cProfile.Profile() if a.profile else None
    if pr:
        pr.enable()
    res = {"batch": a.batch, "sampled": a.sampled, **figures(*timed(a.seconds))}
    if pr:
        pr.disable()
    print(json.dumps(res))
    if a.cudnn_too:  # the same generation with cuDNN's attention allowed, windows in turn
        from speculum.backends.torch.native import attention
        keep, sums = attention.sdpa_kernel, {"no cudnn": [0, 0, 0, 0.0], "cudnn allowed": [0, 0, 0, 0.0]}
        for r in range(2 * a.cudnn_too):
            name = "cudnn allowed" if r % 2 else "no cudnn"
            attention.sdpa_kernel = None if r % 2 else keep
            sums[name] = [x + y for x, y in zip(sums[name], timed(a.seconds / a.cudnn_too))]
        attention.sdpa_kernel = keep
        res["cudnn_ab"] = {name: figures(*v) for name, v in sums.items()}
        res["cudnn_ab"]["ms_per_step_ratio"] = round(res["cudnn_ab"]["cudnn allowed"]["ms_per_step"]
                                                     / res["cudnn_ab"]["no cudnn"]["ms_per_step"], 3)
        print(json.dumps(res["cudnn_ab"]))
    if pr:
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
        print(s.getvalue()[:6000])
    if a.torch_profile:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=acts) as prof:
            t1 = time.perf_counter()
            for _ in range(a.torch_profile):
                while llm.num_waiting < a.batch // 8:
                    add()
                llm.step(include_running=False)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall = (time.perf_counter() - t1) / a.torch_profile
        key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        ev = prof.key_averages()
        # the kernels' own time only (an op's self device time repeats its kernels': summing
        # every row counted them twice, 1.37x the profiler's total on 2026-12-03)
        from torch.autograd import DeviceType
        busy = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
        res.update(profiled_ms_per_step=round(wall * 1e3, 2), device_busy_ms_per_step=round(busy / 1e3 / a.torch_profile, 2))
        print(json.dumps({k: res[k] for k in ("profiled_ms_per_step", "device_busy_ms_per_step")}))
        print(ev.table(sort_by=key, row_limit=25, max_name_column_width=60))
        print(ev.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
