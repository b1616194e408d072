"""How much an EAGLE-3 head loses to its reduced draft vocabulary, and what the target's tail
(``--draft-tail``) gets back before any training.

Along greedy answers of the target (to training prompts, never MT-bench) it runs the head over
each answer's true features, as its catch-up does, and counts how often its first draft equals
the target's next-but-one token: with the head's own vocabulary only, and with the tail grown
(the map fitted to the head's rows, :meth:`Eagle3Head.fit_tail_map`; a head trained with the
tail, as the shipped one since the twenty-fourth session, is read both ways). It also prints the share
of answer tokens outside the draft vocabulary (a first draft can never be right there).

    OMP_NUM_THREADS=1 python scripts/eagle3_tail_check.py [--head DIR] [--prompts 24] [--max-tokens 128]
    python scripts/eagle3_tail_check.py --answers .answers/answers/<key>   # a train_heads.sh answers cache

CPU, fp32, the default model; ``--json FILE`` writes the figures.
"""

from __future__ import annotations

import argparse
import glob
import json
import random
from pathlib import Path

import torch


def answers_from_cache(folder: str, n: int, max_len: int) -> list[tuple[list[int], int]]:
    """(tokens, prompt length) of the first ``n`` greedy answers of a distill cache shard set."""
    from safetensors.torch import load_file
    out = []
    for f in sorted(glob.glob(str(Path(folder) / "shard_*.safetensors"))):
        s = load_file(f)
        off, pl, temp, tok = s["offsets"], s["prompt_lens"], s["temperature"], s["tokens"].long()
        for i in range(len(pl)):
            if float(temp[i]) == 0 and int(off[i + 1] - off[i]) <= max_len:
                out.append((tok[off[i]: off[i + 1]].tolist(), int(pl[i])))
                if len(out) == n:
                    return out
    return out


def answers_generated(llm, n: int, max_tokens: int, seed: int) -> list[tuple[list[int], int]]:
    """Greedy answers of the target to ``n`` of the shipped training prompts (chat template)."""
    from speculum import SamplingParams
    from speculum.datasets import TRAIN_PROMPTS, data_path, read_jsonl
    rows = read_jsonl(data_path(TRAIN_PROMPTS))
    random.Random(seed).shuffle(rows)
    chats = [[{"role": "user", "content": r["prompt"]}] for r in rows[:n]]
    outs = llm.chat(chats, SamplingParams(temperature=0, max_tokens=max_tokens))
    return [(list(o.prompt_token_ids) + list(o.outputs[0].token_ids), len(o.prompt_token_ids)) for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head", default=None, help="EAGLE-3 head directory (default: the shipped one)")
    p.add_argument("--answers", default=None, help="a distill cache folder (shard_*.safetensors) instead of generating")
    p.add_argument("--prompts", type=int, default=24, help="answers to check")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)

    from speculum import LLM
    from speculum.backends.torch.heads import TargetParts
    from speculum.train.base import chain_unroll
    from speculum.train.data import Batch
    from speculum_eagle.formats import load_eagle3
    from speculum_eagle.proposer import HEADS

    llm = LLM(device="cpu", dtype="float32")
    parts = TargetParts.from_runner(llm.loop.target)
    path = args.head or str(next(Path(HEADS).glob("eagle3-*")))
    head = load_eagle3(Path(path), parts).float().eval()
    head.drop_tail()  # a head trained with the tail (the shipped one), read on its own vocabulary
    answers = answers_from_cache(args.answers, args.prompts, 1024) if args.answers else \
        answers_generated(llm, args.prompts, args.max_tokens, args.seed)
    own_ok = tail_ok = total = outside = 0
    grown = load_eagle3(Path(path), parts).float().eval()
    if grown.tail is None:
        grown.use_target_tail(parts.lm_head)
        grown.fit_tail_map()
    target = llm.loop.target
    for i, (tokens, P) in enumerate(answers):
        sid = 10_000_000 + i
        states = target.add_many([sid], [tokens], hidden_layers=head.feature_layers)[sid]
        target.remove(sid)
        T = len(tokens)
        seq = torch.tensor(tokens).view(1, T)
        batch = Batch(tokens=seq, hidden={k: v.float().unsqueeze(0) for k, v in states.items()},
                      valid=torch.ones(1, T, dtype=torch.bool), answer_next=(torch.arange(T) + 1 >= P).view(1, T))
        t = torch.arange(max(P - 1, 0), T - 2)  # anchors whose next-but-one token is an answer token
        want = seq[0, t + 2]
        with torch.no_grad():  # the two share every weight but the tail: one forward, two readings
            _, out = next(chain_unroll(head, batch, 1))
            own_ok += int((head.greedy(out[0, t]) == want).sum())
            tail_ok += int((grown.greedy(out[0, t]) == want).sum())
        total += t.numel()
        outside += int((~head.t2d[want]).sum())
    res = {"head": path, "answers": len(answers), "anchors": total, "outside_draft_vocabulary": outside / total,
           "first_draft_agreement_own": own_ok / total, "first_draft_agreement_tail": tail_ok / total}
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
