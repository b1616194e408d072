"""A static Medusa tree calibrated on the target's own answers (Medusa's ``medusa_choices``).

Medusa's heads draft independently of each other: head ``i`` reads the target's state
``h_t`` and ranks candidates for the token ``i + 2`` places ahead. So whether a static tree
(paths of top-k ranks) accepts ``d`` tokens at a position depends only on the ranks
``(r_1, ..., r_d)`` of the true next tokens under heads ``0..d-1``: the tree accepts the
longest prefix of that rank tuple it contains. A node's contribution to the mean
acceptance length is the share of positions whose rank tuple starts with its path, so
the best tree of ``N`` nodes for a set of answers is the ``N`` most frequent rank
prefixes (a child is never more frequent than its parent: the set is a tree).

This script answers calibration prompts with the target (greedy, never MT-bench: the
training prompts by default), reads the heads' ranks along the answers
(teacher-forced), and prints that tree as a ``speculative_token_tree`` config, with the
acceptance length it expects on the calibration answers, against the chain and the
dynamic tree of the same budget on the same positions where computable:

    python scripts/medusa_tree.py --num-prompts 64 --nodes 32 --json medusa_tree.json
    speculum bench offline --method "$(python -c 'import json;print(json.dumps(json.load(open("medusa_tree.json"))["config"]))')"
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target (default: the default model)")
    ap.add_argument("--heads", default=None, help="Medusa checkpoint (default: the shipped heads)")
    ap.add_argument("--prompts", default=None, help="JSONL with 'prompt' (default: the training prompts)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--nodes", type=int, default=32, help="tree nodes (num_draft_tokens)")
    ap.add_argument("--depth", type=int, default=None, help="deepest level (default: every head)")
    ap.add_argument("--max-rank", type=int, default=16, help="ranks past this count as a miss")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the config and the counts here")
    args = ap.parse_args()

    from speculum import LLM, SamplingParams
    from speculum.datasets import train_prompts_path

    spec = {"method": "medusa", "num_speculative_tokens": 1}
    if args.heads:
        spec["model"] = args.heads
    llm = LLM(args.model, speculative_config=spec, device="cpu", dtype="float32", max_num_seqs=16)
    heads = llm.proposer.heads
    D = min(args.depth or heads.num_heads, heads.num_heads)
    rows = [json.loads(line) for line in Path(args.prompts or train_prompts_path()).read_text().split("\n") if line.strip()]
    random.Random(args.seed).shuffle(rows)
    chats = [[{"role": "user", "content": r["prompt"]}] for r in rows[: args.num_prompts]]
    outs = llm.generate(chats, SamplingParams(temperature=0, max_tokens=args.max_tokens))
    runner = llm.target  # teacher-forced states from the engine's own target (idle between calls)
    counts: Counter = Counter()
    positions = 0
    for n, o in enumerate(outs):
        toks = list(o.prompt_token_ids) + list(o.token_ids)
        P = len(o.prompt_token_ids)
        sid = 10**9 + n  # ids past the engine's own requests
        h = runner.add(sid, toks, hidden_layers=(-1,))[-1]  # [len, H]: h[t] produced toks[t + 1]
        runner.remove(sid)
        with torch.inference_mode():  # the heads on the answer's states only: [D, len - P + 1, V]
            logits = torch.stack([heads.logits(i, h[P - 1:]) for i in range(D)])
        for t in range(P - 1, len(toks) - 2):  # states inside the answer with a token 2 ahead
            ranks = []
            for i in range(D):
                j = t + i + 2
                if j >= len(toks):
                    break
                row = logits[i, t - P + 1]
                r = int((row > row[toks[j]]).sum())
                if r >= args.max_rank:
                    break
                ranks.append(r)
            positions += 1
            for d in range(1, len(ranks) + 1):
                counts[tuple(ranks[:d])] += 1
    best = sorted(counts.items(), key=lambda kv: (-kv[1], len(kv[0]), kv[0]))[: args.nodes]
    paths = sorted((p for p, _ in best), key=lambda p: (len(p), p))
    expected = 1 + sum(c for _, c in best) / max(positions, 1)
    chain = 1 + sum(counts.get(tuple([0] * d), 0) for d in range(1, D + 1)) / max(positions, 1)
    config = {"method": "medusa", "speculative_token_tree": [list(p) for p in paths]}
    if args.heads:
        config["model"] = args.heads
    print(f"{len(outs)} answers, {positions} positions; expected acceptance length on them: "
          f"chain k={D} {chain:.2f}, this {len(paths)}-node tree {expected:.2f}")
    print("depths:", dict(sorted(Counter(len(p) for p in paths).items())))
    print(json.dumps(config))
    if args.json:
        Path(args.json).write_text(json.dumps({"config": config, "positions": positions, "expected": expected,
                                               "chain": chain, "counts": {",".join(map(str, p)): c
                                                                          for p, c in counts.most_common(200)}},
                                              indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
