"""Re-score the head on training's own eval set (run1201c MT-bench answers: 80 first-turn +
80 second-turn conversations, answers <= 384 tokens) with training's exact code path
(Eagle3Trainer.loss -> chain_loss, Batch as DistillData.batch builds it, max_len 640),
but with target states recomputed on the CPU (fp32, or a bf16 runner).

Subsets: all (training's figure), kind 0 (first turn) / 4 (second turn), and answers cut
to their first 128 tokens (what `speculum bench` measures).

Usage: OMP_NUM_THREADS=1 .venv/bin/python results/gap/measure_eval.py [float32|bfloat16]
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
from safetensors import safe_open  # noqa: E402
from speculum import LLM  # noqa: E402
from speculum.backends.torch.heads import TargetParts  # noqa: E402
from speculum.train.base import Score  # noqa: E402
from speculum.train.data import Batch  # noqa: E402
from speculum_eagle.formats import load_eagle3  # noqa: E402
from speculum_eagle.train import Eagle3Trainer  # noqa: E402

DTYPE = sys.argv[1] if len(sys.argv) > 1 else "float32"
SHARD = "/work/main/results/run1201c/answers/SmolLM2-135M-Instruct.Q4_1-4fc9db252913-60c788e8e534/shard_00000.safetensors"
OUT = Path("/work/main/results/gap")
MAX_LEN = 640

f = safe_open(SHARD, "pt")
tokens = f.get_tensor("tokens").long()
offs = f.get_tensor("offsets").long()
plens = f.get_tensor("prompt_lens").long()
kinds = f.get_tensor("kind").long()

llm = LLM(dtype=DTYPE, device="cpu", threads=1, seed=0)
runner = llm.target
tp = TargetParts.from_runner(runner)
head = load_eagle3(Path("/work/main/results/run1201c/eagle3"), TargetParts(tp.embed.float(), tp.lm_head.float(),
                                                                          tp.num_layers))
head = head.float().eval().requires_grad_(False)
target = TargetParts(tp.embed.float(), tp.lm_head.float(), tp.num_layers)
layers = (-1,) + tuple(head.feature_layers)
trainer = Eagle3Trainer()
args = argparse.Namespace(num_positions=4, loss_on="answer", step_decay=0.8)


def batch_of(toks, hid, P, max_len=MAX_LEN):
    """DistillData.batch for one sequence (prompt start cut beyond max_len)."""
    n = len(toks)
    start = max(0, n - max_len)
    T = n - start
    t = torch.tensor(toks[start:]).unsqueeze(0)
    flat = torch.arange(start, n)
    valid = (flat < n - 1).unsqueeze(0)
    answer_next = ((flat + 1 >= P) & (flat < n - 1)).unsqueeze(0)
    h = {l: v[start:n].float().unsqueeze(0) for l, v in hid.items()}
    return Batch(t, h, valid, answer_next, torch.tensor([True]))


subsets = {k: Score.zeros(4) for k in ("all", "kind0", "kind4", "all_128", "kind0_128", "kind4_128")}
t0 = time.time()
with torch.no_grad():
    for i in range(len(plens)):
        s, e, P, kd = int(offs[i]), int(offs[i + 1]), int(plens[i]), int(kinds[i])
        toks = tokens[s:e].tolist()
        sid = -777
        hid = runner.add_many([sid], [toks[:-1]], hidden_layers=layers)[sid]
        runner.remove(sid)
        hid = {l: torch.cat([h.float(), h.new_zeros(1, h.shape[1]).float()]) for l, h in hid.items()}
        hid = {l: h.to(torch.bfloat16).float() for l, h in hid.items()}  # training stores bf16
        sc = trainer.loss(head, batch_of(toks, hid, P), target, args)[1]
        n128 = min(e - s, P + 128)
        sc128 = trainer.loss(head, batch_of(toks[:n128], {l: torch.cat([h[:n128 - 1], h.new_zeros(1, h.shape[1])])
                                                          for l, h in hid.items()}, P), target, args)[1]
        tag = "kind0" if kd == 0 else "kind4"
        for name, x in (("all", sc), (tag, sc), ("all_128", sc128), (tag + "_128", sc128)):
            subsets[name] = subsets[name] + x
        if i % 20 == 0:
            print(i, f"{time.time() - t0:.0f}s", subsets["all"].accuracy(), flush=True)
res = {k: dict(accuracy=v.accuracy(), acceptance=v.acceptance(), mal_replay=v.acceptance_length(),
               anchors=int(v.count[0])) for k, v in subsets.items()}
print(json.dumps(res, indent=1))
json.dump(res, open(OUT / f"measure_eval_{DTYPE}.json", "w"), indent=1)
