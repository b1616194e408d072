"""Device: what a speculative engine whose auto policy drafts nothing costs over no speculation
at batch 64 (engine level, no server). Prints tok/s per config in alternating runs and a
profile of the last run of each. Usage: python scripts/device/auto_overhead.py MODEL [N]"""
import cProfile
import io
import pstats
import sys
import time

import speculum.spec_length as sl
from speculum import LLM, SamplingParams
from speculum.testing import mt_bench_prompts

model = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 384
chats = [[{"role": "user", "content": r["turns"][0]}] for r in mt_bench_prompts()]  # 80 questions
prompts = (chats * (n // len(chats) + 1))[:n]
params = SamplingParams(max_tokens=128, temperature=0)
AUTO = {"method": "ngram", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": "auto"}
configs = {"none": None, "auto": AUTO, "sched0": {**AUTO, "num_speculative_tokens_per_batch_size": {"1-4096": 0}}}
llms = {name: LLM(model, speculative_config=spec, max_num_seqs=64, seed=0) for name, spec in configs.items()}
for llm in llms.values():
    llm.generate(prompts[:64], params)
orig = sl.AutoLength._choose
for rep in range(3):
    for name in list(configs) + ["auto0"]:
        llm = llms["auto" if name == "auto0" else name]
        sl.AutoLength._choose = (lambda self, seqs: 0) if name == "auto0" else orig
        prof = cProfile.Profile() if rep == 2 else None
        t = time.perf_counter()
        if prof: prof.enable()
        outs = llm.generate(prompts, params)
        if prof: prof.disable()
        dt = time.perf_counter() - t
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        counts = list(getattr(llm.loop, "k_counts", []))
        print(f"{name:7s} rep {rep}: {toks / dt:8.1f} tok/s ({toks} tokens, {dt:.2f} s) k_counts {counts}", flush=True)
        if prof:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
            print("\n".join(s.getvalue().splitlines()[4:32]))
