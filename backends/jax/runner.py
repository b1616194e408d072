"""A :class:`~speculum.interfaces.ModelRunner` over the JAX Llama model and a paged KV cache.

Every forward pads its batch to a few static shapes (rows to a batch bucket, query
tokens to a query bucket, context to a block bucket), so ``jax.jit`` compiles a handful
of programs: prefill chunks, the decode step (q = 1) and the verify steps (q = k + 1).
Positions, write slots and block tables come from the shared
:class:`speculum.kv.PagedKVAllocator`; padding writes into its scratch block 0. Rollback
is a length change in the allocator: rejected slots are overwritten by the next step.
Outputs are torch views of the JAX buffers (:mod:`speculum.backends.jax.convert`).
"""

from __future__ import annotations

import logging
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch

from speculum.backends.jax import model as M
from speculum.backends.jax.checkpoint import LlamaArch
from speculum.backends.jax.convert import host_ints, to_torch, torch_device_of, torch_dtype
from speculum.interfaces import ForwardOutput
from speculum.kv import PagedKVAllocator

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: query lengths up to this compile exactly (decode, verify with k + 1 <= 8)
EXACT_QUERY_LENS = 8
#: the shortest prefill chunk shape (shorter prompts are padded up to it)
MIN_PREFILL_Q = 16


def bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= n; past the largest, the next multiple of it (each size is a
    compiled shape: ``n`` itself compiled again for every batch size past the largest)."""
    for b in buckets:
        if b >= n:
            return b
    return -(-n // buckets[-1]) * buckets[-1]


def query_bucket(q: int, prefill: bool = False) -> int:
    """Padded query length: exact for short (decode/verify) steps, else a power of two."""
    if not prefill and q <= EXACT_QUERY_LENS:
        return q
    return max(MIN_PREFILL_Q if prefill else 1, 1 << (q - 1).bit_length())


class JaxRunner:
    """One loaded model, its KV pools and their allocator (attached by the memory plan)."""

    def __init__(self, params: M.Params, arch: LlamaArch, device: jax.Device, dtype, name: str = "target",
                 max_model_len: int | None = None, prefill_chunk: int = 512):
        self.params = params
        self.arch = arch
        self.name = name
        self.jax_device = device
        self.jax_dtype = jnp.dtype(dtype)
        #: where output tensors live (the torch view of the JAX device)
        self.device = torch_device_of(device)
        self.vocab_size = arch.vocab_size
        self.hidden_size = arch.hidden_size
        self.num_layers = arch.num_layers
        self.max_model_len = max_model_len or arch.max_position_embeddings
        self.prefill_chunk = prefill_chunk
        self.allocator: PagedKVAllocator | None = None  # set by attach_cache (memory plan)
        self.shape: M.ModelShape | None = None
        self.k_pools = self.v_pools = None  # one [slots, Hkv, D] array per layer
        #: the padded step shapes run so far: (rows, query tokens, blocks, hidden layers,
        #: logits?); each is one compiled program
        self.step_shapes: set[tuple] = set()

    @property
    def weight_bytes(self) -> int:
        return M.param_bytes(self.params)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.arch.kv_bytes_per_token * self.jax_dtype.itemsize

    def attach_cache(self, allocator: PagedKVAllocator) -> None:
        """Allocate this runner's K/V pools for ``allocator``'s blocks."""
        self.allocator = allocator
        self.block_size = allocator.block_size
        slots = allocator.num_blocks * allocator.block_size
        a = self.arch
        self.shape = M.ModelShape.of(a, allocator.block_size, self.jax_dtype)
        pool = (slots, a.num_kv_heads, a.head_dim)
        self.k_pools = self.v_pools = None  # free the old pools first
        with jax.default_device(self.jax_device):
            self.k_pools = tuple(jnp.zeros(pool, self.jax_dtype) for _ in range(a.num_layers))
            self.v_pools = tuple(jnp.zeros(pool, self.jax_dtype) for _ in range(a.num_layers))
        max_blocks = -(-self.max_model_len // self.block_size)
        nb, buckets = max(1, 256 // self.block_size), []
        while nb < max_blocks:
            buckets.append(nb)
            nb *= 2
        self._block_buckets = buckets + [max_blocks]

    def _alloc(self) -> PagedKVAllocator:
        if self.allocator is None:
            raise RuntimeError(f"the {self.name} runner has no KV cache yet: call the backend's plan_memory first")
        return self.allocator

    # -- ModelRunner ----------------------------------------------------------------------
    def length(self, seq_id: int) -> int:
        return self._alloc().length(seq_id)

    def add(self, seq_id: int, token_ids: Sequence[int], hidden_layers: Sequence[int] = ()) -> dict:
        return self.add_many([seq_id], [token_ids], hidden_layers)[seq_id]

    def add_many(self, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]],
                 hidden_layers: Sequence[int] = ()) -> dict[int, dict[int, torch.Tensor]]:
        """Prefill new sequences together, in chunks of ``prefill_chunk`` tokens.

        Returns ``{seq_id: {layer: [len(prompt), H]}}`` (empty dicts without layers).
        """
        alloc = self._alloc()
        hidden_layers = tuple(hidden_layers)
        parts: dict[int, dict[int, list[torch.Tensor]]] = {sid: {l: [] for l in hidden_layers} for sid in seq_ids}
        prompts = [list(p) for p in prompts]
        for sid in seq_ids:
            if alloc.length(sid) or alloc.block_table(sid):
                raise ValueError(f"sequence {sid} already in the {self.name} runner")
            alloc.allocate(sid, 0)
        longest = max((len(p) for p in prompts), default=0)
        q_max = query_bucket(min(longest, self.prefill_chunk), prefill=True) if longest else 1
        rows_per_pass = max(1, (self.prefill_chunk * 8) // q_max)
        for start in range(0, longest, self.prefill_chunk):
            chunk = [(sid, p[start: start + self.prefill_chunk]) for sid, p in zip(seq_ids, prompts) if len(p) > start]
            for i in range(0, len(chunk), rows_per_pass):
                part = chunk[i: i + rows_per_pass]
                q = max(len(t) for _, t in part)
                ids = np.zeros((len(part), q), dtype=np.int32)
                for r, (sid, toks) in enumerate(part):
                    ids[r, : len(toks)] = toks
                    alloc.allocate(sid, len(toks))
                out = self._run([sid for sid, _ in part], ids, [len(t) for _, t in part], hidden_layers,
                                compute_logits=False, prefill=True)
                for layer, h in out.hidden_states.items():  # [rows, q, H]
                    for r, (sid, toks) in enumerate(part):
                        parts[sid][layer].append(h[r, : len(toks)])
        empty = torch.empty(0, self.hidden_size, dtype=torch_dtype(self.jax_dtype), device=self.device)
        return {sid: {l: torch.cat(hs) if hs else empty for l, hs in d.items()} for sid, d in parts.items()}

    def forward(self, seq_ids: Sequence[int], token_ids: torch.Tensor, num_tokens: Sequence[int],
                hidden_layers: Sequence[int] = ()) -> ForwardOutput:
        """Append ``token_ids`` [B, q] (first ``num_tokens[b]`` valid per row); logits [B, q, V]."""
        alloc = self._alloc()
        num_tokens = [int(n) for n in num_tokens]
        for sid, n in zip(seq_ids, num_tokens):
            alloc.allocate(sid, n)
        ids = np.maximum(host_ints(token_ids), 0)
        return self._run(seq_ids, ids, num_tokens, tuple(hidden_layers), compute_logits=True, prefill=False)

    def truncate(self, seq_id: int, length: int) -> None:
        self._alloc().truncate(seq_id, length)

    def remove(self, seq_id: int) -> None:
        self._alloc().free(seq_id)

    def capture(self, batch_sizes: Sequence[int], query_lens: Sequence[int], max_block_buckets: int | None = None,
                hidden_layers: Sequence[int] = ()) -> int:
        """Compile decode / verify steps ahead of time (what CUDA graph capture is to the torch
        runner); returns how many new shapes were compiled. Other shapes compile the first
        time they occur. The warm-up steps write only into the scratch block."""
        alloc = self._alloc()
        n = 0
        for B in sorted({bucket(b, BATCH_BUCKETS) for b in batch_sizes}):
            for q in sorted({query_bucket(q) for q in query_lens}):
                for nb in self._block_buckets[:max_block_buckets]:
                    key = (B, q, nb, tuple(hidden_layers), True)
                    if key in self.step_shapes:
                        continue
                    self.step_shapes.add(key)
                    # padding rows only: positions 0..q-1, written into block 0 (scratch)
                    pos = np.tile(np.arange(q, dtype=np.int32), (B, 1))
                    meta = np.concatenate([np.zeros(B * q, np.int32), pos.ravel(), (pos % alloc.block_size).ravel(),
                                           np.zeros(B * nb, np.int32)])
                    logits, _, self.k_pools, self.v_pools = M.forward(
                        self.params, self.k_pools, self.v_pools, meta, shape=self.shape, B=B, q=q, nb=nb,
                        hidden_layers=tuple(hidden_layers), compute_logits=True)
                    logits.block_until_ready()
                    n += 1
        return n

    # -- one padded step ------------------------------------------------------------------
    def _run(self, seq_ids, ids: np.ndarray, num_tokens: list[int], hidden_layers: tuple[int, ...],
             compute_logits: bool, prefill: bool) -> ForwardOutput:
        alloc = self._alloc()
        B, q = ids.shape
        Bb = bucket(B, BATCH_BUCKETS)
        qb = query_bucket(q, prefill)
        need = max(-(-alloc.length(s) // self.block_size) for s in seq_ids)
        nb = bucket(max(need, 1), self._block_buckets)
        pos, wsl, blk = alloc.step_slots(seq_ids, num_tokens, qb, Bb, nb)
        padded = np.zeros((Bb, qb), dtype=np.int32)
        padded[:B, :q] = ids
        key = (Bb, qb, nb, hidden_layers, compute_logits)
        if key not in self.step_shapes:
            self.step_shapes.add(key)
            log.debug("%s: new step shape rows=%d q=%d blocks=%d hidden=%s logits=%s (compiles once)",
                      self.name, *key)
        meta = np.concatenate([padded.ravel(), pos.ravel().astype(np.int32), wsl.ravel().astype(np.int32),
                               blk.ravel().astype(np.int32)])
        logits, hidden, self.k_pools, self.v_pools = M.forward(
            self.params, self.k_pools, self.v_pools, meta, shape=self.shape, B=Bb, q=qb, nb=nb,
            hidden_layers=hidden_layers, compute_logits=compute_logits)
        out_logits = to_torch(logits, self.device)[:B, :q] if logits is not None else None
        return ForwardOutput(logits=out_logits,
                             hidden_states={l: to_torch(h, self.device)[:B, :q] for l, h in hidden.items()})
