"""The measured cost of a target forward verifying ``q`` tokens for ``B`` sequences.

:func:`profile_verify_cost` times the target runner itself (the graphed path on CUDA,
eager elsewhere) on throw-away sequences of ``context`` tokens, for a grid of batch
sizes and query lengths; :class:`VerifyCost` interpolates between the grid points
(linearly in ``q`` and in ``B``; linear extrapolation past the largest ``B``).
:func:`load_or_profile` caches a profile as JSON under
``$SPECULUM_CACHE/verify_cost/`` (default ``~/.cache/speculum``), keyed by the model,
device, dtype, runner and (on the CPU) threads, so an engine start profiles once per
machine and model. Delete the folder to profile again.

On CUDA every batch bucket up to ``max_num_seqs`` and every ``q`` in ``1..k+1`` is
measured (graph replays, median of 10: well under a second in all); on the CPU a quick
grid (batch sizes 1, 4, 16, ... and ``q`` in 1, 2, k + 1; the fastest of 5 rounds,
since other processes only slow it down) keeps the start short. The profile is made
non-decreasing in ``q`` and ``B`` (:meth:`VerifyCost.monotone`) before use.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Sequence

import attrs
import torch

log = logging.getLogger(__name__)

#: sequence ids the profile borrows (never those of requests: those count up from 0)
PROFILE_SEQ_BASE = -1_000_000
CUDA_BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@attrs.define
class VerifyCost:
    """Seconds per target forward, measured on a grid ``{batch size: {q: seconds}}``."""

    table: dict[int, dict[int, float]]
    #: what was measured (model, device, dtype...) and when
    meta: dict = attrs.field(factory=dict)

    def _at_batch(self, row: dict[int, float], q: int) -> float:
        qs = sorted(row)
        if q in row:
            return row[q]
        lo = max([x for x in qs if x < q], default=qs[0])
        hi = min([x for x in qs if x > q], default=qs[-1])
        if lo == hi:  # outside the measured qs: extrapolate from the two nearest
            lo, hi = (qs[-2], qs[-1]) if q > qs[-1] and len(qs) > 1 else (qs[0], qs[min(1, len(qs) - 1)])
            if lo == hi:
                return row[lo]
        return row[lo] + (row[hi] - row[lo]) * (q - lo) / (hi - lo)

    def __call__(self, batch_size: int, q: int) -> float:
        bs = sorted(self.table)
        if batch_size in self.table:
            return self._at_batch(self.table[batch_size], q)
        lo = max([b for b in bs if b < batch_size], default=None)
        hi = min([b for b in bs if b > batch_size], default=None)
        if lo is None:
            return self._at_batch(self.table[hi], q)
        if hi is None:  # past the grid: extrapolate from its last two batch sizes
            if len(bs) == 1:
                return self._at_batch(self.table[lo], q) * batch_size / lo
            lo, hi = bs[-2], bs[-1]
        a, b = self._at_batch(self.table[lo], q), self._at_batch(self.table[hi], q)
        return max(a + (b - a) * (batch_size - lo) / (hi - lo), 0.0)

    def monotone(self) -> "VerifyCost":
        """The same profile made non-decreasing in q and in B (running maxima): more
        tokens never cost less, so a dip is measurement noise, not a bargain to chase."""
        bs = sorted(self.table)
        qs = sorted({q for row in self.table.values() for q in row})
        table = {B: dict(self.table[B]) for B in bs}
        for B in bs:
            run = 0.0
            for q in qs:
                if q in table[B]:
                    run = table[B][q] = max(run, table[B][q])
        for q in qs:
            run = 0.0
            for B in bs:
                if q in table[B]:
                    run = table[B][q] = max(run, table[B][q])
        return VerifyCost(table, dict(self.meta))

    def as_dict(self) -> dict:
        return {"meta": self.meta, "table": {str(b): {str(q): s for q, s in row.items()} for b, row in self.table.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> "VerifyCost":
        table = {int(b): {int(q): float(s) for q, s in row.items()} for b, row in data["table"].items()}
        return cls(table, dict(data.get("meta", {})))


def grid(device: torch.device, max_num_seqs: int, max_k: int) -> tuple[list[int], list[int]]:
    """(batch sizes, query lengths) to profile on ``device``."""
    if device.type == "cuda":
        batches = [b for b in CUDA_BATCHES if b < max_num_seqs] + [max_num_seqs]
        qs = list(range(1, max_k + 2))
    else:
        batches, b = [], 1
        while b < max_num_seqs:
            batches.append(b)
            b *= 4
        batches.append(max_num_seqs)
        qs = sorted({1, 2, max_k + 1})
    return sorted(set(batches)), qs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_verify_cost(runner, batch_sizes: Sequence[int], query_lens: Sequence[int], context: int = 128,
                        reps: int | None = None, seed: int = 0, statistic: str = "median") -> VerifyCost:
    """Time ``runner.forward`` for every (B, q) of the grid (the median, or ``"min"``, of
    ``reps`` after a warm-up), on ``max(batch_sizes)`` throw-away sequences of ``context``
    random tokens. The grid is walked ``reps`` times round robin, so a disturbance of the
    machine spreads over every shape instead of spoiling one.

    The sequences are removed afterwards; the runner's cache is as it was.
    """
    device = runner.device
    reps = reps or (10 if device.type == "cuda" else 5)
    gen = torch.Generator().manual_seed(seed)
    V = runner.vocab_size
    n = max(batch_sizes)
    ids = [PROFILE_SEQ_BASE - i for i in range(n)]
    prompts = [torch.randint(0, V, (context,), generator=gen).tolist() for _ in range(n)]
    runner.add_many(ids, prompts)
    times: dict[tuple[int, int], list[float]] = {(B, q): [] for B in batch_sizes for q in query_lens}
    toks = {(B, q): torch.randint(0, V, (B, q), generator=gen) for B, q in times}
    try:
        for r in range(reps + 1):  # round 0 warms up (lazy graph capture, allocator)
            for B, q in times:
                _sync(device)
                t0 = time.perf_counter()
                out = runner.forward(ids[:B], toks[(B, q)], [q] * B)
                out.logits[:, -1, :1].sum().item()  # the step's host sync, as in the loop
                dt = time.perf_counter() - t0
                for sid in ids[:B]:
                    runner.truncate(sid, context)
                if r:
                    times[(B, q)].append(dt)
        pick = min if statistic == "min" else statistics.median
        table = {B: {q: pick(times[(B, q)]) for q in query_lens} for B in batch_sizes}
    finally:
        for sid in ids:
            runner.remove(sid)
    return VerifyCost(table, {"context": context, "reps": reps})


def cache_dir() -> Path:
    from speculum.model_source import cache_root
    return cache_root() / "verify_cost"


def cache_key(model_path: Path, device: torch.device, dtype: torch.dtype, runner, max_num_seqs: int, max_k: int,
              context: int) -> dict:
    """What a profile depends on (the JSON file's name hashes it)."""
    model_path = Path(model_path)
    weights = sorted(p for p in model_path.glob("*") if p.suffix in (".safetensors", ".bin", ".gguf", ".json")) \
        if model_path.is_dir() else [model_path]
    stamp = [(p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in weights if p.exists()]
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        import platform
        where = f"cpu:{platform.machine()}:{platform.processor()}:threads={torch.get_num_threads()}"
    return {"model": str(model_path.resolve()), "files": stamp, "device": where, "dtype": str(dtype),
            "runner": type(runner).__name__, "cuda_graphs": bool(getattr(runner, "cuda_graphs", False)),
            "max_num_seqs": max_num_seqs, "max_k": max_k, "context": context, "torch": torch.__version__}


def load_or_profile(runner, model_path: Path, max_num_seqs: int, max_k: int, context: int = 128,
                    use_cache: bool = True) -> VerifyCost:
    """The cached profile of this model on this machine, or a new one (then cached)."""
    device = runner.device
    dtype = getattr(runner, "dtype", None) or getattr(getattr(runner, "model", None), "dtype", None)
    key = cache_key(model_path, device, dtype, runner, max_num_seqs, max_k, context)
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16] + ".json"
    path = cache_dir() / name
    if use_cache and path.is_file():
        try:
            cost = VerifyCost.from_dict(json.loads(path.read_text()))
            log.info("verify cost profile from %s", path)
            return cost
        except (ValueError, KeyError) as exc:
            log.warning("ignoring the unreadable verify cost profile %s (%s)", path, exc)
    batches, qs = grid(device, max_num_seqs, max_k)
    t0 = time.perf_counter()
    # other processes only ever slow a CPU forward down: the fastest of the rounds there
    cost = profile_verify_cost(runner, batches, qs, context=context,
                               statistic="median" if device.type == "cuda" else "min").monotone()
    cost.meta.update(key=key, seconds=time.perf_counter() - t0, created=time.time())
    log.info("profiled the verify cost of %d shapes in %.1f s (cached in %s)", len(batches) * len(qs),
             cost.meta["seconds"], path)
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cost.as_dict(), indent=1))
            tmp.replace(path)
        except OSError as exc:
            log.warning("could not cache the verify cost profile in %s: %s", path, exc)
    return cost


def describe(cost: VerifyCost, max_k: int) -> str:
    """A table of cost(B, q) / cost(B, 1): how much verifying q tokens costs against one."""
    qs = list(range(1, max_k + 2))
    head = f"{'batch':>6} {'1 tok ms':>9} " + " ".join(f"{'q=' + str(q):>6}" for q in qs[1:])
    lines = [head]
    for B in sorted(cost.table):
        one = cost(B, 1)
        lines.append(f"{B:>6} {one * 1e3:>9.2f} " + " ".join(f"{cost(B, q) / one:>6.2f}" for q in qs[1:]))
    return "\n".join(lines)
