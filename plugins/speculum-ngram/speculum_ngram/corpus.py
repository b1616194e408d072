"""A corpus of the target's earlier answers for n-gram lookup to fall back on.

Prompt lookup finds nothing to draft on most steps of open-ended answers: on MT-bench
(SmolLM2-135M, 256 tokens, k = 4) only about a third of the steps draft, 1.67 tokens per
target forward. Where the request itself has no earlier occurrence of its suffix, the
target's answers to other requests often do (phrases, list markup, code idioms): looked up
there, with the continuation voted over the occurrences (the most frequent next token among
those that agree so far, as suffix decoding does over earlier outputs), the same replay
gives 2.12 (``scripts/ngram_ceiling.py --corpus``, a corpus of the target's answers to the
training prompts and its own requests, 9.7 M tokens). Drafts stay drafts: the verifier
keeps only what the target would have produced.

A corpus file is a 1-D ``.npy`` of int32 token ids, streams separated by -1 (``build``);
``Corpus`` indexes its n-grams once (per n, the windows' hashes sorted, with the position
after each), and a lookup is a binary search per n from the longest down.

    python -m speculum_ngram.corpus build --answers <answers cache>... --out corpus.npy
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

_P = np.int64(1_000_003)  # window hash: sum of token * P^i, wrapping in int64; matches are checked


class Corpus:
    """The n-grams (``n_min`` to ``n_max``) of a token array (streams separated by -1)."""

    def __init__(self, tokens: np.ndarray, n_min: int = 2, n_max: int = 5, max_votes: int = 512):
        self.toks = np.concatenate([np.asarray(tokens, dtype=np.int64), np.full(n_max + 8, -1, dtype=np.int64)])
        self.n_min, self.n_max, self.max_votes = max(1, n_min), n_max, max_votes
        self.index: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        t, T = self.toks, len(self.toks)
        for n in range(self.n_min, n_max + 1):
            cols = [t[j: T - n + 1 + j] for j in range(n)]
            h = np.zeros(T - n + 1, dtype=np.int64)
            with np.errstate(over="ignore"):
                for c in cols:
                    h = h * _P + c
            ok = np.all(np.stack(cols) >= 0, axis=0)
            after = (np.flatnonzero(ok) + n).astype(np.int64)  # the position after each window
            hs = h[ok]
            order = np.argsort(hs, kind="stable")  # equal hashes keep position order
            self.index[n] = (hs[order], after[order])

    def __len__(self) -> int:
        return int((self.toks >= 0).sum())

    def draft(self, context: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens after the longest suffix of ``context`` (n from ``n_max`` down)
        that occurs in the corpus, voted token by token over its latest ``max_votes``
        occurrences; [] when none occurs."""
        ctx = np.asarray(context[-self.n_max:], dtype=np.int64)
        for n in range(min(self.n_max, len(ctx)), self.n_min - 1, -1):
            suffix = ctx[-n:]
            key = np.int64(0)
            with np.errstate(over="ignore"):
                for x in suffix:
                    key = key * _P + x
            hs, after = self.index[n]
            lo, hi = np.searchsorted(hs, key, "left"), np.searchsorted(hs, key, "right")
            if hi <= lo:
                continue
            pos = after[lo: hi][-self.max_votes:]
            match = np.ones(pos.size, dtype=bool)
            for j in range(n):  # a hash collision is not a match
                match &= self.toks[pos - n + j] == suffix[j]
            pos = pos[match]
            out: list[int] = []
            while pos.size and len(out) < k:
                nxt = self.toks[pos]
                vals, counts = np.unique(nxt[nxt >= 0], return_counts=True)
                if not vals.size:
                    break
                best = int(vals[counts.argmax()])
                out.append(best)
                pos = pos[nxt == best] + 1
            if out:
                return out
        return []


@functools.lru_cache(maxsize=4)
def load_corpus(path: str, n_min: int, n_max: int) -> Corpus:
    """The corpus of a ``.npy`` file, indexed once per process (engines share it)."""
    p = Path(path)
    if not p.is_file():
        from speculum.errors import ConfigError
        raise ConfigError(f"n-gram corpus {path!r} not found: build one with `python -m speculum_ngram.corpus build "
                          "--answers <answers cache> --out corpus.npy` (the caches of `speculum train`)")
    return Corpus(np.load(p), n_min, n_max)


def answered_prompts(cache: str | Path) -> str:
    """The prompt file an answers cache answered (its ``meta.json``)."""
    meta = json.loads((Path(cache) / "meta.json").read_text())
    return str(meta.get("spec", {}).get("prompts", ""))


def build(answer_dirs: Sequence[str], out: str, answers_only: bool = False) -> dict:
    """Write the token streams of answers caches (``$SPECULUM_CACHE/distill/...``, or folders
    exported by ``python -m speculum.train.distill export``) as a corpus file."""
    from speculum.datasets import is_eval_set
    from speculum.errors import ConfigError
    from speculum.train.data import DistillData
    parts, streams = [], 0
    for d in answer_dirs:
        if is_eval_set(answered_prompts(d)):  # MT-bench's answers would draft MT-bench's answers
            raise ConfigError(f"{d}: answers to {Path(answered_prompts(d)).name}, an evaluation set: a corpus must "
                              "not hold them (build it from the training answers' caches)")
        data = DistillData.load(Path(d), layers=())  # token ids only
        off, pl, toks = data.offsets.tolist(), data.prompt_lens.tolist(), data.tokens.numpy()
        for i in range(len(pl)):
            parts += [toks[off[i] + (pl[i] if answers_only else 0): off[i + 1]].astype(np.int32),
                      np.array([-1], dtype=np.int32)]
            streams += 1
    arr = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    np.save(out, arr)
    return {"streams": streams, "tokens": int((arr >= 0).sum()), "bytes": int(arr.nbytes), "out": out}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m speculum_ngram.corpus", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="a corpus file from answers caches")
    b.add_argument("--answers", action="append", default=[], help="an answers cache folder (repeatable)")
    b.add_argument("--cache-root", default=None,
                   help="every answers cache in this folder (e.g. $SPECULUM_CACHE/distill) but those of evaluation sets")
    b.add_argument("--out", required=True, help="the .npy to write")
    b.add_argument("--answers-only", action="store_true", help="leave the prompts out")
    args = ap.parse_args(argv)
    from speculum.datasets import is_eval_set
    from speculum.errors import ConfigError
    dirs = list(args.answers)
    if args.cache_root:
        dirs += [str(d) for d in sorted(Path(args.cache_root).iterdir())
                 if (d / "meta.json").is_file() and not is_eval_set(answered_prompts(d))]
    if not dirs:
        print("error: no answers cache given (--answers DIR or --cache-root DIR)", file=sys.stderr)
        return 2
    try:
        print(json.dumps(build(dirs, args.out, args.answers_only)))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
