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


def measure(L: int, rounds: int, steps: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    toks = [rng.randrange(0, 2000) for _ in range(L)]
    t = time.perf_counter()
    for _ in range(rounds):
        SuffixIndex(list(toks), 2, 5).draft(4)
    first = (time.perf_counter() - t) / rounds
    ix = SuffixIndex(list(toks), 2, 5)
    ix.draft(4)
    new = [[rng.randrange(0, 2000) for _ in range(2)] for _ in range(steps)]
    t = time.perf_counter()
    for pair in new:
        ix.tokens.extend(pair)
        ix.draft(4)
    steady = (time.perf_counter() - t) / steps
    return {"context": L, "first_draft_us": 1e6 * first, "steady_step_us": 1e6 * steady}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="100,300,2000")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = [measure(int(L), args.rounds, args.steps) for L in args.lengths.split(",")]
    print(f"{'context':>8}  {'first draft (us)':>16}  {'steady step (us)':>16}")
    for r in rows:
        print(f"{r['context']:>8}  {r['first_draft_us']:>16.1f}  {r['steady_step_us']:>16.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "n_min": 2, "n_max": 5}, f, indent=1)


if __name__ == "__main__":
    main()
