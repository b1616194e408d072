"""Where a tree step's time goes on the GPU, against a chain's (host ops and kernels).

python3 scripts/device/profile_tree_step.py MODEL '{"method":"eagle3","num_speculative_tokens":4}' '{...tree...}'
Prints, per config, torch-profiler tables of the ops by host time and the kernels by GPU
time over a few MT-bench answers (after an untimed warm-up), per loop step.
"""
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from speculum import LLM, SamplingParams
from speculum.testing import mt_bench_chat_prompts

model = sys.argv[1]
prompts = mt_bench_chat_prompts(4)
params = SamplingParams(temperature=0, max_tokens=128)
for cfg in sys.argv[2:]:
    llm = LLM(model, speculative_config=json.loads(cfg), dtype="bfloat16", max_num_seqs=1)
    llm.generate(prompts, params)  # warm-up: graphs of every shape used below
    s0 = llm.loop._steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts[:2], params)
        torch.cuda.synchronize()
    n = llm.loop._steps - s0
    print(f"=== {cfg}: {n} loop steps; totals below are per the whole run (divide by {n})")
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
    print(ka.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
    del llm
    torch.cuda.empty_cache()
