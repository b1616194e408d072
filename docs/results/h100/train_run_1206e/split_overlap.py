"""How much of the thirty-eighth session's validation split the heads had trained on before.

Reconstructs the trainer's split before 2026-12-06 (the prompt groups shuffled in the order the
shards list them) on the answers of the twenty-eighth session (train_run_1204e/answers.tgz,
unpacked in /tmp/ans_old) and on this session's (answers.tgz here, unpacked in /tmp/ans), and
counts the new validation sequences that were on the training side before. Run from the repo
root: .venv/bin/python docs/results/h100/train_run_1206e/split_overlap.py
(2026-12-06: 973 of 1,383; the prompt-hash split of the new data: 1,365 validation sequences.)
"""
import glob, json, random, sys
from pathlib import Path
import torch
from safetensors import safe_open
from speculum.train.data import DistillData

def load(root):
    # shards as the trainer lists them: the --data rows' cache (self prompts, c9cc...) first, then the prompts' (adc7...)
    dirs = [d for d in sorted(glob.glob(root + "/answers/*/")) if "8beb8e3e390e" not in d]
    dirs = sorted(dirs, key=lambda d: 0 if "c9cca1fcb1ce" in d else 1)
    toks, offs, plens, pidx, parts, at = [], [0], [], [], [], 0
    for p, d in enumerate(dirs):
        shards = json.loads(Path(d, "meta.json").read_text())["shards"]
        for n in shards:
            with safe_open(str(Path(d) / n), "pt") as h:
                t = h.get_tensor("tokens").long(); toks.append(t)
                offs += (h.get_tensor("offsets")[1:] + at).tolist(); at += t.numel()
                plens.append(h.get_tensor("prompt_lens").long()); pi = h.get_tensor("prompt_index").long(); pidx.append(pi)
                parts.append(torch.full_like(pi, p))
    return DistillData(torch.cat(toks), torch.tensor(offs), torch.cat(plens), torch.cat(pidx), {}, part=torch.cat(parts))

def old_split(data, frac=0.05, seed=0):
    groups = {}
    for i, row in enumerate(data.prompt_index.tolist()):
        groups.setdefault(row, []).append(i)
    keys = list(groups); random.Random(seed + 1).shuffle(keys)
    n_val = min(max(1, round(len(keys) * frac)), len(keys) - 1)
    return keys[n_val:], keys[:n_val], groups

def content(data, i):
    s, P = int(data.offsets[i]), int(data.prompt_lens[i])
    return (int(data.part[i]), int(data.prompt_index[i]))

old, new = load("/tmp/ans_old"), load("/tmp/ans")
print("sequences", len(old), len(new))
ot, ov, og = old_split(old); nt, nv, ng = old_split(new)
# sequences (identified by (part, row)) in the new validation that the old split trained on
old_train_seqs = {content(old, i) for k in ot for i in og[k]}
new_val_seqs = [content(new, i) for k in nv for i in ng[k]]
print("old split: new validation sequences", len(new_val_seqs), "of them trained on under the old split:",
      sum(s in old_train_seqs for s in new_val_seqs))
tr, va = new.split(0.05, 0)
print("prompt-hash split: validation", len(va), "train", len(tr))
