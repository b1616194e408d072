"""Which BLAS library each GEMM of a captured verify step calls, chosen by timing on the device.

PyTorch sends a bf16/fp16 ``F.linear`` to cuBLAS, whose heuristic picks the kernel by the
shape. For the few-row GEMMs of a verify step it does not always pick the fastest one
cuBLASLt has: on the H200, Llama-3-8B's shape, 33 rows, the attention output projection
took 11.4 us through cuBLAS and 9.6 through cuBLASLt, the MLP's down projection 34.1 and
31.3, while at 17 rows cuBLASLt's down projection was the slower (35.3 against 33.1) and
at one row the two are the same (``scripts/device/profile_step.py --shape llama3-8b``).
No fixed rule wins everywhere, so :class:`GemmPlan` times both, once per (rows, weight
shape), before a CUDA graph of that many rows is captured, and the graph keeps the faster:
``speculum bench step --shape llama3-8b``, batch 1, a 33-token verify went from 1.097x to
1.055-1.059x a 1-token decode (docs/benchmarks.md, twenty-seventh session).

Each timing cycles through copies of the weight past the L2 cache (:data:`COLD_BYTES`), as
a forward reads each layer's weight from memory; decode steps (one row, :data:`MIN_ROWS`)
keep PyTorch's choice. The choice is made per device and process, so two runs may pick
differently where the libraries are within noise of each other (their bf16 results can
then differ in the last bit). ``SPECULUM_GEMM_TUNE=0`` in the environment turns the timing
off: every GEMM goes where PyTorch sends it. The batch-invariant mode has its own Triton
GEMM and no plan.

On a CPU the plan holds oneDNN's prepacked copy of each fp32 weight instead (:meth:`GemmPlan.pack`):
with ``F.linear`` (MKL) a target forward of 3 tokens cost 2.06x one of 1 token on this project's
AMD EPYC, so speculation did not pay there; through the prepacked copies 1.04x (one thread,
``scripts/cpu_step_cost.py --unpacked``; docs/benchmarks.md, fortieth session). A weight whose
only reader is the plan can give its dense storage back (:meth:`GemmPlan.release`), so the copy
replaces it rather than doubling it; :meth:`GemmPlan.restore` brings the dense values back.
``SPECULUM_GEMM_TUNE=0`` turns it off too.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

#: the alternatives to PyTorch's default (cuBLAS); the default is always a candidate
ALTERNATIVES = ("cublaslt",)
#: an alternative must be this much faster than the default to be chosen (timing noise)
MARGIN = 0.02


def tuning_enabled() -> bool:
    return os.environ.get("SPECULUM_GEMM_TUNE", "1") != "0"


@contextlib.contextmanager
def blas(backend: str | None):
    """PyTorch's preferred BLAS library set to ``backend`` (None: unchanged) inside."""
    if backend is None:
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(backend)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def capture(fns: list[Callable[[], object]], backend: str | None = None, warmup: int = 1) -> torch.cuda.CUDAGraph:
    """One CUDA graph of the calls ``fns`` under ``backend`` (the first called ``warmup`` times
    on a side stream before)."""
    with blas(backend):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(warmup):
                fns[0]()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in fns:
                fn()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, replays: int = 3, calls: int = 1) -> float:
    """Microseconds per call of a captured ``graph`` holding ``calls`` calls, replayed
    ``replays`` times after one untimed replay."""
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / (calls * replays)


def graph_us(fns: list[Callable[[], object]], backend: str | None, replays: int = 3) -> float:
    """Microseconds per call of the ``fns`` under ``backend``: all of them captured in one
    CUDA graph (so launch gaps do not count), replayed ``replays`` times after one untimed
    replay."""
    return replay_us(capture(fns, backend), replays, len(fns))


Timer = Callable[[list[Callable[[], object]], "str | None"], float]
#: bytes of weight copies a timing cycles through: more than an H200's 50 MB of L2, so each
#: GEMM reads its weight from memory as it does in a forward (one small weight called ten
#: times in a row stays in L2 and times a different kernel than the forward runs)
COLD_BYTES = 128 << 20
#: a decode step (one row per sequence) keeps PyTorch's choice: the plan is for verify steps
MIN_ROWS = 2


def packable(weight: torch.Tensor) -> bool:
    """Whether :meth:`GemmPlan.pack` takes ``weight``: fp32 on a CPU, torch built with oneDNN,
    tuning not turned off (bf16 packing needs AVX-512 or AVX-NE-CONVERT and was not measured)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and torch.backends.mkldnn.is_available() and tuning_enabled())


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` from oneDNN's prepacked copy of ``weight``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")


class GemmPlan:
    """Per (rows, out features, in features, dtype): the BLAS library a linear layer's GEMM
    takes (None: PyTorch's default). Empty until :meth:`tune` fills it, and then only for
    the row counts it was tuned for; every other call goes the default way. On a CPU,
    :meth:`pack` gives weights a prepacked oneDNN copy that every row count uses."""

    def __init__(self, timer: Timer = graph_us) -> None:
        self.choice: dict[tuple[int, int, int, torch.dtype], str | None] = {}
        self.timings: dict[tuple[int, int, int, torch.dtype], dict[str, float]] = {}
        #: id(weight) -> (weight, its data pointer and version when packed, oneDNN's copy); holding
        #: the weight keeps its id from being reused by another tensor
        self.packed: dict[int, tuple[torch.Tensor, int, int, torch.Tensor]] = {}
        #: id(weight) of the weights whose dense storage :meth:`release` gave back
        self.released: set[int] = set()
        self._timer = timer

    def pack(self, weights: Iterable[torch.Tensor]) -> int:
        """oneDNN's prepacked copy of each :func:`packable` weight, for :meth:`linear`; returns
        the bytes the copies hold. A weight changed after (moved, cast, written in place) goes
        the default way again: a stale copy is never used; so does one that needs a gradient
        (the prepacked product has none)."""
        added = 0
        for w in weights:
            if id(w) in self.packed or not packable(w):
                continue
            try:
                copy = torch.ops.mkldnn._reorder_linear_weight(w.detach())
            except RuntimeError as exc:  # a CPU or build oneDNN cannot pack for
                log.warning("GEMM plan: %d x %d weight not packed for oneDNN (%s); F.linear kept",
                            w.shape[0], w.shape[1], str(exc).splitlines()[0][:200])
                return added
            self.packed[id(w)] = (w, w.data_ptr(), w._version, copy)
            added += w.numel() * w.element_size()
        return added

    @torch.no_grad()
    def release(self, weights: Iterable[torch.Tensor]) -> int:
        """Give back the dense storage of packed weights that nothing but :meth:`linear` reads
        (each becomes an empty tensor; its prepacked copy holds the values); returns the bytes
        freed. A weight not packed, or whose copy is stale, is kept. A released weight needs no
        gradient (none could reach it) and goes through its copy whatever its data pointer."""
        freed = 0
        for w in weights:
            if id(w) in self.released or (copy := self._packed(w)) is None:  # not packed, or stale
                continue
            self.released.add(id(w))
            freed += w.numel() * w.element_size()
            w.requires_grad_(False)
            w.data = torch.empty(0, dtype=w.dtype, device=w.device)
            # no data pointer matches -1: dense values put back by anything but restore() are
            # not the copy's, so they go through F.linear
            self.packed[id(w)] = (w, -1, -1, copy)
        return freed

    @torch.no_grad()
    def restore(self) -> None:
        """Dense values back into every released weight, from its prepacked copy (the same
        values: oneDNN's reorder only moves them); the copies stay valid for :meth:`linear`."""
        for key in self.released:
            w, _, _, copy = self.packed[key]
            w.data = copy.to_dense()  # the copy keeps the weight's shape
            self.packed[key] = (w, w.data_ptr(), w._version, copy)
        self.released.clear()

    def _packed(self, weight: torch.Tensor) -> torch.Tensor | None:
        hit = self.packed.get(id(weight))
        if hit is None:
            return None
        if id(weight) in self.released and weight.numel() == 0:
            return hit[3]
        if hit[1] != weight.data_ptr() or hit[2] != weight._version:
            return None
        if weight.requires_grad and torch.is_grad_enabled():
            return None
        return hit[3]

    def tune(self, weights: Iterable[torch.Tensor], rows: int) -> None:
        """Time each distinct weight shape's GEMM at ``rows`` rows (at least :data:`MIN_ROWS`)
        under the default library and each alternative, cycling through copies of the weight
        (:data:`COLD_BYTES`); keep the fastest (an alternative only if :data:`MARGIN` faster)."""
        for w in weights:
            key = (rows, w.shape[0], w.shape[1], w.dtype)
            if key in self.choice or rows < MIN_ROWS:
                continue
            try:
                times = self._time(w, rows)
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                # no room for the copies, or a library this GPU or build lacks: PyTorch's choice
                log.warning("GEMM plan: %d x %d at %d rows not timed (%s); PyTorch's BLAS choice kept",
                            w.shape[0], w.shape[1], rows, str(exc).splitlines()[0][:200])
                self.choice[key] = None
                continue
            best = min(ALTERNATIVES, key=times.__getitem__)
            self.choice[key] = best if times[best] < times["default"] * (1 - MARGIN) else None
            self.timings[key] = times

    def _time(self, w: torch.Tensor, rows: int) -> dict[str, float]:
        x = torch.randn(rows, w.shape[1], device=w.device, dtype=w.dtype)
        copies = [w] + [w.clone() for _ in range(min(255, COLD_BYTES // (w.numel() * w.element_size())))]
        fns = [(lambda c=c: F.linear(x, c)) for c in (copies * 10)[:max(10, len(copies))]]
        times = {"default": self._timer(fns, None)}
        for b in ALTERNATIVES:
            times[b] = self._timer(fns, b)
        return times

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear`` through the library chosen for ``x``'s row count and ``weight``'s shape
        (oneDNN's prepacked copy of ``weight`` where :meth:`pack` made one)."""
        if self.packed and (copy := self._packed(weight)) is not None:
            return _onednn_linear(x, copy, bias)
        if not self.choice:
            return F.linear(x, weight, bias)
        rows = x.numel() // x.shape[-1]
        backend = self.choice.get((rows, weight.shape[0], weight.shape[1], weight.dtype))
        if backend is None:
            return F.linear(x, weight, bias)
        with blas(backend):
            return F.linear(x, weight, bias)

    def summary(self) -> dict[str, str]:
        """``"rows x N x K" -> library`` for the shapes where an alternative was chosen."""
        return {f"{r}x{n}x{k}": b for (r, n, k, _), b in self.choice.items() if b is not None}


__all__ = ["ALTERNATIVES", "COLD_BYTES", "GemmPlan", "MIN_ROWS", "blas", "capture", "graph_us", "packable",
           "replay_us", "tuning_enabled"]
