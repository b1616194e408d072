"""Host cost of the n-gram proposer's per-sequence index (:class:`SuffixIndex`): a row's
first draft (the whole context indexed) and a steady step (two new tokens), by context
length. Prints a table and writes JSON. Run with one thread and nothing else running:

    OMP_NUM_THREADS=1 python scripts/bench_ngram_index.py --json ngram_index.json
"""

from __future__ import annotations

import argparse
import json
import random
import time

from speculum_ngram.proposer import SuffixIndex

try:  # token trees (TreeSuffixIndex) are newer than this script
    from speculum_ngram.proposer import TreeSuffixIndex
except ImportError:
    TreeSuffixIndex = None


def measure(L: int, rounds: int, steps: int, seed: int = 0, tree: tuple[int, int] | None = None) -> dict:
    """Chain drafts of 4 (n = 2..5), or with ``tree`` = (M, D) the up to M continuations of D
    tokens of a token-tree step (TreeSuffixIndex keeping M ends per n-gram)."""
    rng = random.Random(seed)
    toks = [rng.randrange(0, 2000) for _ in range(L)]
    if tree is None:
        make, draft = (lambda t: SuffixIndex(t, 2, 5)), (lambda ix: ix.draft(4))
    else:
        m, d = tree
        make, draft = (lambda t: TreeSuffixIndex(t, 2, 5, m)), (lambda ix: ix.continuations(d, m))
    t = time.perf_counter()
    for _ in range(rounds):
        draft(make(list(toks)))
    first = (time.perf_counter() - t) / rounds
    ix = make(list(toks))
    draft(ix)
    new = [[rng.randrange(0, 2000) for _ in range(2)] for _ in range(steps)]
    t = time.perf_counter()
    for pair in new:
        ix.tokens.extend(pair)
        draft(ix)
    steady = (time.perf_counter() - t) / steps
    return {"context": L, "tree": list(tree) if tree else None, "first_draft_us": 1e6 * first,
            "steady_step_us": 1e6 * steady}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="100,300,2000")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--tree", default="8:4", help="also a token-tree step of M continuations of D tokens "
                    "(M:D; empty: none)")
    ap.add_argument("--json")
    args = ap.parse_args()
    trees = [None] + ([tuple(int(v) for v in args.tree.split(":"))] if args.tree and TreeSuffixIndex else [])
    rows = [measure(int(L), args.rounds, args.steps, tree=tr) for tr in trees for L in args.lengths.split(",")]
    print(f"{'draft':>8}  {'context':>8}  {'first draft (us)':>16}  {'steady step (us)':>16}")
    for r in rows:
        what = "chain 4" if r["tree"] is None else "tree {}:{}".format(*r["tree"])
        print(f"{what:>8}  {r['context']:>8}  {r['first_draft_us']:>16.1f}  {r['steady_step_us']:>16.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "n_min": 2, "n_max": 5}, f, indent=1)


if __name__ == "__main__":
    main()
