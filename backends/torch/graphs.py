"""CUDA graphs of static-shape functions: capture once, replay with new metadata.

One scheme serves the native runner's decode and verify forwards
(:class:`~speculum.backends.torch.native.runner.NativeRunner`) and the draft heads'
greedy chain and tree drafting (:mod:`speculum.backends.torch.heads.graph`):

- a function of static device buffers (an int64 metadata vector ``meta`` and whatever
  else its owner keeps) is warmed up twice on a side stream, so kernel selection and
  allocator growth stay out of the graph, then captured, all in inference mode;
- the graphs of one owner share one memory pool (:class:`GraphPool`): they never run
  concurrently, so their intermediates may overlap;
- each replay fills a pinned host buffer with the step's metadata and copies it into
  ``meta`` asynchronously (:meth:`StaticGraph.host`, :meth:`StaticGraph.upload`); a
  buffer is refilled only once its previous copy has finished, so the host never waits
  for the device except when every buffer of the graph is still in flight.

Outputs are the graph's own buffers: valid until its next replay.
"""

from __future__ import annotations

from typing import Callable, Generic, Sequence, TypeVar

import numpy as np
import torch

T = TypeVar("T")

#: batch sizes a drafting or verification graph is captured for
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket(n: int, buckets: Sequence[int] = BATCH_BUCKETS) -> int:
    """The smallest of ``buckets`` that holds ``n``; past the largest, the next multiple of it.

    Every size a caller sees is a shape it captures (or compiles) once and keeps: a bucket of
    ``n`` itself past the largest made every batch size from there on a graph of its own, so
    a generation at 512 rows whose batch drifts between 448 and 512 as requests end and
    refill captured a new graph of every layer nearly every step.
    """
    for b in buckets:
        if n <= b:
            return b
    top = buckets[-1]
    return -(-n // top) * top


class StaticGraph(Generic[T]):
    """A captured graph, its outputs and its metadata input with pinned staging buffers."""

    def __init__(self, graph: torch.cuda.CUDAGraph, out: T, meta: torch.Tensor | None, staging: int = 1):
        self.graph = graph
        #: the outputs the function returned at capture (rewritten by each replay)
        self.out = out
        #: the metadata vector the function reads (a static device buffer), or None for a
        #: function whose owner fills its input buffers itself
        self.meta = meta
        staging = staging if meta is not None else 0
        self._host = [torch.zeros(meta.numel(), dtype=meta.dtype).pin_memory() for _ in range(staging)]
        self._done: list[torch.cuda.Event | None] = [None] * staging
        self._turn = 0
        #: the stream replays run on (looked up once: a lookup costs ~20 us of host time)
        self._stream = torch.cuda.current_stream(meta.device) if meta is not None and meta.is_cuda else None

    def host(self) -> np.ndarray:
        """The next pinned staging buffer (a numpy view) to fill with a step's metadata;
        waits until its previous copy to the device has finished."""
        done = self._done[self._turn]
        if done is not None:
            done.synchronize()
        return self._host[self._turn].numpy()

    def upload(self) -> None:
        """Copy the buffer :meth:`host` returned into :attr:`meta` (asynchronously)."""
        i = self._turn
        self.meta.copy_(self._host[i], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(self._stream) if self._stream is not None else ev.record()
        self._done[i] = ev
        self._turn = (i + 1) % len(self._host)

    def replay(self) -> T:
        """Run the graph on the current inputs; returns :attr:`out`."""
        self.graph.replay()
        return self.out


class GraphPool:
    """Captures functions as CUDA graphs into one memory pool shared by all of them."""

    def __init__(self) -> None:
        self._pool = None

    def capture(self, fn: Callable[[], T], meta: torch.Tensor | None = None, staging: int = 1,
                warmup: int = 2) -> StaticGraph[T]:
        """Warm ``fn`` up ``warmup`` times on a side stream, then capture it (inference mode).

        ``fn`` reads its inputs from static buffers, among them ``meta``; the graph gets
        ``staging`` pinned host buffers for ``meta`` (more let the host run further ahead).
        Without ``meta`` the caller copies into the buffers itself before each replay.
        """
        with torch.inference_mode():
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(warmup):  # kernels and allocator, outside the graph
                    fn()
            torch.cuda.current_stream().wait_stream(s)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = fn()
        return StaticGraph(graph, out, meta, staging)
