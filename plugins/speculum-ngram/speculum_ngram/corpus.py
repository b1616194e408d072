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

A corpus file is a 1-D ``.npy`` of int32 token ids, streams separated by -1 (``build``), or
of uint16 ids with 65535 between streams (``build --compact``: half the size). ``Corpus``
votes every n-gram's continuation once, at load (per n, the distinct n-grams' hashes sorted,
the n-grams and their continuations beside them; a large corpus's tables are cached on disk,
so a later process reads them instead), and a lookup is a binary search per n
from the longest down, on the host (:meth:`Corpus.draft`) or, for drafts made on the device
from the verdict, in the n-gram kernel (:mod:`speculum_ngram.kernels`). The plugin ships one
corpus, for the default model's tokenizer (``corpora/``; ``options.corpus: "shipped"``).

    python -m speculum_ngram.corpus build --answers <answers cache>... --out corpus.npy
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import io
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

log = logging.getLogger(__name__)

_P = np.int64(1_000_003)  # window hash: sum of token * P^i, wrapping in int64; matches are checked
#: the tables' layout and vote, part of a cached table's key: a change leaves older files unread
TABLE_VERSION = 1
#: corpora of fewer tokens build their tables in well under a second: not cached on disk
CACHE_MIN_TOKENS = 200_000


class Corpus:
    """The n-grams (``n_min`` to ``n_max``) of a token array (streams separated by -1), each
    with its voted continuation of up to ``depth`` tokens, computed once for all of them.

    A lookup (:meth:`draft` on the host, :meth:`on` for the device) is then a binary search
    per n from the longest down and one row read: no vote at drafting time (on the H200 the
    per-call vote cost 0.24 ms a step, more than the lookup's yield was worth in some
    categories). Per n the table holds the distinct n-grams' hashes (sorted), the n-grams
    themselves (a hash collision is not a match) and their continuations (-1 padded).
    """

    def __init__(self, tokens: np.ndarray, n_min: int = 2, n_max: int = 5, max_votes: int = 512, depth: int = 8):
        self.n_min, self.n_max, self.max_votes, self.depth = max(1, n_min), n_max, max_votes, depth
        toks = np.concatenate([np.asarray(tokens, dtype=np.int64), np.full(n_max + depth + 2, -1, dtype=np.int64)])
        self.num_tokens = int((toks >= 0).sum())
        #: per n: (sorted hashes [G], n-grams [G, n] int32, continuations [G, depth] int32)
        self.tables: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {
            n: _voted_table(toks, n, depth, max_votes) for n in range(self.n_min, n_max + 1)}
        self._devices: dict[str, "DeviceCorpus"] = {}

    def __len__(self) -> int:
        return self.num_tokens

    def draft(self, context: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens after the longest suffix of ``context`` (n from ``n_max`` down)
        that occurs in the corpus, voted token by token over its latest ``max_votes``
        occurrences (the most frequent next token among the occurrences that agree so far,
        the smallest id on a tie); [] when none occurs."""
        if k > self.depth:
            raise ValueError(f"this corpus table holds continuations of {self.depth} tokens, {k} asked")
        ctx = np.asarray(context[-self.n_max:], dtype=np.int64)
        for n in range(min(self.n_max, len(ctx)), self.n_min - 1, -1):
            suffix = ctx[-n:]
            hs, grams, cont = self.tables[n]
            key = _hash(suffix)
            i = int(np.searchsorted(hs, key))
            if i < len(hs) and hs[i] == key and np.array_equal(grams[i], suffix):
                c = cont[i, :k]
                return c[c >= 0].tolist()
        return []

    def save(self, path: Path) -> None:
        """The tables to ``path`` (``.npz``), written whole or not at all; an OSError where the
        disk would keep less than three times their size free."""
        arrays = {f"{k}{n}": a for n, t in self.tables.items() for k, a in zip(("hs", "grams", "cont"), t)}
        meta = np.array([TABLE_VERSION, self.n_min, self.n_max, self.max_votes, self.depth, self.num_tokens])
        path.parent.mkdir(parents=True, exist_ok=True)
        size = sum(a.nbytes for a in arrays.values())
        if shutil.disk_usage(path.parent).free < 4 * size:
            raise OSError(f"{size >> 20} MB of tables and only {shutil.disk_usage(path.parent).free >> 20} MB free")
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                np.savez(f, meta=meta, **arrays)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: Path) -> "Corpus":
        """The corpus whose tables :meth:`save` wrote to ``path``."""
        with np.load(path) as z:
            version, n_min, n_max, max_votes, depth, num_tokens = (int(x) for x in z["meta"])
            if version != TABLE_VERSION:
                raise ValueError(f"table version {version}, this code reads {TABLE_VERSION}")
            tables = {n: (z[f"hs{n}"], z[f"grams{n}"], z[f"cont{n}"]) for n in range(n_min, n_max + 1)}
        corpus = cls.__new__(cls)  # the tables are made already: not __init__'s vote
        corpus.n_min, corpus.n_max, corpus.max_votes, corpus.depth = n_min, n_max, max_votes, depth
        corpus.num_tokens, corpus.tables, corpus._devices = num_tokens, tables, {}
        return corpus

    def on(self, device) -> "DeviceCorpus":
        """The tables on ``device`` (copied once per device)."""
        key = str(device)
        if key not in self._devices:
            self._devices[key] = DeviceCorpus(self, device)
        return self._devices[key]


def _hash(gram: np.ndarray) -> np.int64:
    """The window hash of one n-gram (oldest token first), as the table's."""
    key = np.int64(0)
    with np.errstate(over="ignore"):
        for x in gram:
            key = key * _P + np.int64(x)
    return key


def _voted_table(t: np.ndarray, n: int, depth: int, max_votes: int):
    """(hashes, n-grams, continuations) of every distinct n-gram of ``t`` (-1 separated,
    padded with -1 at the end) that some token follows, its continuation voted over its
    latest ``max_votes`` occurrences: per step, for every n-gram at once, the most frequent
    next token among the occurrences still agreeing (smallest id on a tie), and those
    occurrences move on one token."""
    T = len(t)
    cols = [t[j: T - n + 1 + j] for j in range(n)]
    h = np.zeros(T - n + 1, dtype=np.int64)
    with np.errstate(over="ignore"):
        for c in cols:
            h = h * _P + c
    ok = np.all(np.stack(cols) >= 0, axis=0)
    after = np.flatnonzero(ok) + n  # the position after each window
    hs = h[ok]
    order = np.argsort(hs, kind="stable")  # equal hashes keep position order
    hs, after = hs[order], after[order]
    new = np.r_[True, hs[1:] != hs[:-1]] if hs.size else np.zeros(0, dtype=bool)
    gid = np.cumsum(new) - 1
    starts = np.flatnonzero(new)
    G = starts.size
    ends = np.r_[starts[1:], hs.size]
    keep = ends[gid] - np.arange(hs.size) <= max_votes  # each n-gram's latest occurrences
    g, pos = gid[keep], after[keep]
    cont = np.full((G, depth), -1, dtype=np.int32)
    V = int(t.max()) + 1 if T else 1
    for step in range(depth):
        v = t[pos]
        good = v >= 0
        if not good.any():
            break
        u, c = np.unique(g[good] * V + v[good], return_counts=True)  # (n-gram, next token) pairs
        ug, uv = u // V, u % V
        o = np.lexsort((uv, -c, ug))  # per n-gram: the most frequent next token, the smallest on a tie
        first = o[np.r_[True, ug[o][1:] != ug[o][:-1]]]
        best = np.full(G, -1, dtype=np.int64)
        best[ug[first]] = uv[first]
        cont[ug[first], step] = uv[first]
        sel = good & (v == best[g])  # occurrences at a separator, or of an n-gram that stopped, stop
        g, pos = g[sel], pos[sel] + 1
    last = ends - 1  # each n-gram's latest occurrence gives its tokens
    grams = np.stack([t[after[last] - n + j] for j in range(n)], axis=1).astype(np.int32) if G else \
        np.zeros((0, n), dtype=np.int32)
    has = cont[:, 0] >= 0  # an n-gram followed only by separators drafts nothing: a shorter one is tried
    return hs[starts][has], grams[has], cont[has]


class DeviceCorpus:
    """A :class:`Corpus`'s tables on one device, every n's in one tensor each: hashes [G],
    n-grams [G, n_max] (-1 padded), continuations [G, depth]; ``off[n]``, ``cnt[n]``: where
    n's rows start and how many. Looked up for a batch at once by :meth:`lookup` (torch
    ops) or inside the n-gram kernel (:func:`speculum_ngram.kernels.ngram_draft`)."""

    def __init__(self, corpus: Corpus, device):
        import torch
        self.n_min, self.n_max, self.depth = corpus.n_min, corpus.n_max, corpus.depth
        ns = sorted(corpus.tables)
        sizes = [len(corpus.tables[n][0]) for n in ns]
        cnt = np.zeros(self.n_max + 1, dtype=np.int64)
        cnt[ns] = sizes
        off = np.zeros(self.n_max + 1, dtype=np.int64)
        off[ns] = np.cumsum([0] + sizes)[:-1]
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device, torch.int64)  # noqa: E731
        self.hs = t(np.concatenate([corpus.tables[n][0] for n in ns]))
        self.grams = t(np.concatenate([np.pad(corpus.tables[n][1], ((0, 0), (0, self.n_max - n)), constant_values=-1)
                                       for n in ns]))
        self.cont = t(np.concatenate([corpus.tables[n][2] for n in ns]))
        self.off, self.cnt = t(off), t(cnt)
        self._spans = {n: (int(off[n]), int(off[n] + cnt[n])) for n in ns}
        #: binary search iterations that cover the largest table
        self.steps = int(cnt.max()).bit_length() + 1
        # P^j wrapped to int64, j = 0 .. n_max - 1 (the newest token has j = 0)
        pw, x = [], np.int64(1)
        with np.errstate(over="ignore"):
            for _ in range(self.n_max):
                pw.append(x)
                x = x * _P
        self.powers = torch.tensor(np.array(pw, dtype=np.int64), device=device)

    def lookup(self, suffix, length, k: int):
        """([B, k] drafts, -1 padded; [B] found) for ``suffix`` [B, n_max] (column j the
        (j+1)-th newest token) of contexts of ``length`` [B] tokens: :meth:`Corpus.draft`
        for every row."""
        import torch
        B = suffix.shape[0]
        out = torch.full((B, k), -1, dtype=torch.int64, device=suffix.device)
        found = torch.zeros(B, dtype=torch.bool, device=suffix.device)
        for n in range(self.n_max, self.n_min - 1, -1):
            lo, hi = self._spans[n]
            if hi == lo:
                continue
            hs, grams, cont = self.hs[lo:hi], self.grams[lo:hi, :n], self.cont[lo:hi]
            key = (suffix[:, :n] * self.powers[:n]).sum(1)
            i = torch.searchsorted(hs, key).clamp_max(hi - lo - 1)
            hit = (hs[i] == key) & (grams[i] == suffix[:, :n].flip(1)).all(1) & (length >= n) & ~found
            out = torch.where(hit.view(B, 1), cont[i, :k], out)
            found |= hit
        return out, found


#: corpora shipped with the plugin: ``<name>.npy`` with ``<name>.json`` (its tokenizer's
#: vocabulary size and a probe text's token ids, what it was made from and how)
SHIPPED = Path(__file__).resolve().parent / "corpora"
#: the separator of a compact (uint16) corpus file
_SEP16 = 65535


def read_tokens(path) -> np.ndarray:
    """A corpus file's token ids as int64, -1 between streams (int32 files as written by
    ``build``; uint16 ones, ``build --compact``, with 65535 between streams)."""
    a = np.load(path)
    out = a.astype(np.int64)
    if a.dtype == np.uint16:
        out[a == _SEP16] = -1
    return out


def shipped_corpus(tokenizer, vocab_size: int) -> str:
    """The path of the corpus shipped for this tokenizer (``options.corpus: "shipped"``)."""
    from speculum.errors import ConfigError
    names = []
    for meta_path in sorted(SHIPPED.glob("*.json")):
        meta = json.loads(meta_path.read_text())
        names.append(meta.get("target", meta_path.stem))
        if meta.get("vocab_size") != vocab_size:
            continue
        try:
            same = tokenizer is not None and list(tokenizer.encode(meta["probe"])) == meta["probe_ids"]
        except Exception:  # a tokenizer that cannot encode text: not this one
            same = False
        if same:
            return str(meta_path.with_suffix(".npy"))
    raise ConfigError(f"no n-gram corpus is shipped for this target's tokenizer (shipped: {', '.join(names) or 'none'}); "
                      "build one from its answers: `python -m speculum_ngram.corpus build --answers <answers cache> "
                      "--out corpus.npy` (the caches of `speculum train`), then give its path as options.corpus")


def table_cache(path: Path, n_min: int, n_max: int, depth: int, max_votes: int = 512,
                data: bytes | None = None) -> Path:
    """Where the tables of corpus file ``path`` are cached (``$SPECULUM_CACHE/ngram/``), keyed
    by the file's contents (``data`` when the caller has read them already), the n-gram range,
    the continuation depth, the vote and :data:`TABLE_VERSION`."""
    from speculum import cache_root
    h = hashlib.sha1(path.read_bytes() if data is None else data)
    h.update(json.dumps([TABLE_VERSION, n_min, n_max, depth, max_votes]).encode())
    return cache_root() / "ngram" / f"{path.stem}-{h.hexdigest()[:16]}.npz"


@functools.lru_cache(maxsize=4)
def load_corpus(path: str, n_min: int, n_max: int, depth: int = 8) -> Corpus:
    """The corpus of a ``.npy`` file, made once per process (engines share it). Its tables are
    voted the first time (the shipped corpus: ~20-30 s and 1.7 GB on one CPU core) and, for a
    corpus of :data:`CACHE_MIN_TOKENS` or more, cached on disk (:func:`table_cache`; the
    shipped corpus's: 318 MB, read back in well under a second)."""
    p = Path(path)
    if not p.is_file():
        from speculum.errors import ConfigError
        raise ConfigError(f"n-gram corpus {path!r} not found: build one with `python -m speculum_ngram.corpus build "
                          "--answers <answers cache> --out corpus.npy` (the caches of `speculum train`), or use "
                          '"shipped" for the default model\'s')
    t0 = time.perf_counter()
    raw = p.read_bytes()  # read once: hashed for the cache's key, and parsed on a miss
    cache = table_cache(p, n_min, n_max, depth, data=raw)
    if cache.is_file():
        try:
            corpus = Corpus.load(cache)
        except Exception as exc:  # a partial or foreign file: voted again and rewritten
            log.warning("n-gram corpus %s: cached tables %s unreadable (%s): voting them again", p.name, cache, exc)
        else:
            log.info("n-gram corpus %s: %d tokens, tables read from %s in %.1f s", p.name, len(corpus), cache,
                     time.perf_counter() - t0)
            return corpus
    tokens = read_tokens(io.BytesIO(raw))
    log.info("n-gram corpus %s: %d tokens; voting every %d- to %d-gram's continuation (once: ~20-30 s and 1.7 GB "
             "for the shipped corpus on one CPU core, then cached)", p.name, int((tokens >= 0).sum()), n_min, n_max)
    corpus = Corpus(tokens, n_min, n_max, depth=depth)
    log.info("n-gram corpus %s: %d n-grams in %.1f s", p.name, sum(len(t[0]) for t in corpus.tables.values()),
             time.perf_counter() - t0)
    if len(corpus) >= CACHE_MIN_TOKENS:
        try:
            corpus.save(cache)
        except OSError as exc:
            log.warning("n-gram corpus %s: tables not cached in %s (%s): the next process votes them again",
                        p.name, cache, exc)
        else:
            log.info("n-gram corpus %s: tables cached in %s", p.name, cache)
    return corpus


def answered_prompts(cache: str | Path) -> str:
    """The prompt file an answers cache answered (its ``meta.json``)."""
    meta = json.loads((Path(cache) / "meta.json").read_text())
    return str(meta.get("spec", {}).get("prompts", ""))


def build(answer_dirs: Sequence[str], out: str, answers_only: bool = False, compact: bool = False) -> dict:
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
    if compact:  # uint16, 65535 between streams: half the size (vocabularies under 65,535 tokens)
        if arr.size and arr.max() >= _SEP16:
            raise ConfigError(f"--compact needs token ids below {_SEP16}; this vocabulary has {int(arr.max()) + 1}")
        arr = np.where(arr < 0, _SEP16, arr).astype(np.uint16)
    np.save(out, arr)
    return {"streams": streams, "tokens": int(arr.size - streams), "bytes": int(arr.nbytes), "out": out}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m speculum_ngram.corpus", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="a corpus file from answers caches")
    b.add_argument("--answers", action="append", default=[], help="an answers cache folder (repeatable)")
    b.add_argument("--cache-root", default=None,
                   help="every answers cache in this folder (e.g. $SPECULUM_CACHE/distill) but those of evaluation sets")
    b.add_argument("--out", required=True, help="the .npy to write")
    b.add_argument("--answers-only", action="store_true", help="leave the prompts out")
    b.add_argument("--compact", action="store_true", help="uint16 token ids (half the size; vocabularies < 65,535)")
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
        print(json.dumps(build(dirs, args.out, args.answers_only, args.compact)))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
