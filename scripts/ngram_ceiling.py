"""How many tokens per target forward n-gram lookup can give on a prompt set, whatever the
step costs: greedy outputs are made once without speculation (batched), then each lookup
variant is replayed over them (lossless greedy speculation emits exactly these tokens, so
a draft's accepted length is its agreement with them). Prints a table, writes JSON.

    python scripts/ngram_ceiling.py --max-tokens 256 --json ngram_ceiling.json
    python scripts/ngram_ceiling.py --outputs ngram_ceiling.json     # replay saved outputs

The ratio of n-gram speculation to autoregressive decoding is at most this figure times
(plain step / speculative step).

``--trees M:N ...`` also replays lookup that drafts a token tree: up to M distinct
continuations (the longest matching suffix first, most recent occurrence first), merged
into a trie of at most N nodes; a step accepts the longest path the answer follows. The
lossless loop verifies such a tree in one forward (docs/trees.md), so this is what
several candidates per step would add over one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def generate(args) -> list[dict]:
    from speculum.datasets import first_turn, mt_bench
    from speculum.engine import LLM
    from speculum.sampling import SamplingParams

    rows = mt_bench(path=args.mt_bench)
    prompts = [[{"role": "user", "content": first_turn(r)}] for r in rows]
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=len(prompts), threads=args.threads)
    t0 = time.perf_counter()
    outs = llm.chat(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens))
    print(f"{len(outs)} answers in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return [dict(category=r["category"], prompt=o.prompt_token_ids, output=list(o.outputs[0].token_ids))
            for r, o in zip(rows, outs)]


def replay(data: list[dict], n_min: int, n_max: int, k: int) -> dict:
    """Steps, tokens and drafting steps of lookup (n_min..n_max, k drafts) over the answers."""
    from speculum_ngram.proposer import SuffixIndex

    steps = tokens = drafted = 0
    for r in data:
        ctx, out = list(r["prompt"]), r["output"]
        index = SuffixIndex(ctx, n_min, n_max)
        i = 0
        while i < len(out):
            d = index.draft(k)
            a = 0
            while a < len(d) and i + a < len(out) and d[a] == out[i + a]:
                a += 1
            n = min(a + 1, len(out) - i)
            ctx.extend(out[i: i + n])
            i += n
            tokens += n
            steps += 1
            drafted += bool(d)
    return dict(n_min=n_min, n_max=n_max, k=k, steps=steps, tokens=tokens, tokens_per_forward=tokens / steps,
                drafting_share=drafted / steps)


def continuations(ctx: list[int], n_min: int, n_max: int, depth: int, m: int) -> list[tuple[int, ...]]:
    """Up to ``m`` distinct continuations (at most ``depth`` tokens) of ``ctx``'s suffix: for n
    from ``n_max`` down to ``n_min``, the tokens after each earlier occurrence of the last n
    tokens, the most recent first."""
    arr = np.asarray(ctx, dtype=np.int64)
    L = arr.shape[0]
    ends = np.flatnonzero(arr[: L - 1] == arr[L - 1]) if L > 1 else np.zeros(0, dtype=np.int64)
    out: list[tuple[int, ...]] = []
    for n in range(min(n_max, L - 1), max(n_min, 1) - 1, -1):
        for e in ends[::-1]:
            if e - n + 1 < 0 or not np.array_equal(arr[e - n + 1: e + 1], arr[L - n:]):
                continue
            c = tuple(arr[e + 1: e + 1 + depth].tolist())
            if c and c not in out:
                out.append(c)
                if len(out) == m:
                    return out
    return out


def trie_nodes(paths: list[tuple[int, ...]]) -> int:
    return len({p[:i] for p in paths for i in range(1, len(p) + 1)})


def replay_tree(data: list[dict], n_min: int, n_max: int, depth: int, m: int, budget: int) -> dict:
    """:func:`replay` for a tree of up to ``m`` continuations, at most ``budget`` nodes."""
    steps = tokens = nodes = 0
    for r in data:
        ctx, out = list(r["prompt"]), r["output"]
        i = 0
        while i < len(out):
            kept: list[tuple[int, ...]] = []
            for c in continuations(ctx, n_min, n_max, depth, m):
                if trie_nodes(kept + [c]) <= budget:
                    kept.append(c)
            nodes += trie_nodes(kept)
            a = 0
            for c in kept:
                j = 0
                while j < len(c) and i + j < len(out) and c[j] == out[i + j]:
                    j += 1
                a = max(a, j)
            n = min(a + 1, len(out) - i)
            ctx.extend(out[i: i + n])
            i += n
            tokens += n
            steps += 1
    return dict(n_min=n_min, n_max=n_max, depth=depth, candidates=m, budget=budget, steps=steps, tokens=tokens,
                tokens_per_forward=tokens / steps, mean_nodes=nodes / steps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--mt-bench", default=None, help="MT-bench style JSONL (default: the 80 shipped questions)")
    p.add_argument("--max-tokens", type=int, default=256, help="new tokens per answer")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--outputs", default=None, help="replay the answers saved in this JSON instead of generating")
    p.add_argument("-k", type=int, nargs="+", default=[2, 4], help="draft lengths to replay")
    p.add_argument("--trees", nargs="*", default=[], metavar="M:N",
                   help="also replay token trees of up to M continuations and N nodes, at each -k as depth")
    p.add_argument("--json", default="results/ngram_ceiling.json", help="where answers and figures go")
    args = p.parse_args(argv)
    data = json.load(open(args.outputs))["answers"] if args.outputs else generate(args)
    rows = [replay(data, lo, hi, k) for k in args.k for lo, hi in ((2, 5), (1, 5), (3, 5), (2, 8))]
    print(f"{'k':>2} {'n':>5} {'tokens/forward':>15} {'drafting share':>15}")
    for r in rows:
        print(f"{r['k']:>2} {r['n_min']}-{r['n_max']:<3} {r['tokens_per_forward']:>15.3f} {r['drafting_share']:>15.2f}")
    trees = []
    for spec in args.trees:
        m, budget = (int(v) for v in spec.split(":"))
        trees += [replay_tree(data, lo, hi, k, m, budget) for k in args.k for lo, hi in ((2, 5), (1, 5))]
    if trees:
        print(f"\n{'depth':>5} {'n':>5} {'M:N':>6} {'tokens/forward':>15} {'nodes/step':>11}")
        for r in trees:
            print(f"{r['depth']:>5} {r['n_min']}-{r['n_max']:<3} {r['candidates']:>3}:{r['budget']:<2} "
                  f"{r['tokens_per_forward']:>15.3f} {r['mean_nodes']:>11.2f}")
    from pathlib import Path
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"answers": data, "replay": rows, "trees": trees}))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
