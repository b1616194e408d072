"""The paged KV cache of a draft head, one more cache group in the backend's memory plan.

A head's cache behaves like a small model runner's: sequences grow by appending
positions and roll back by length (:meth:`HeadKVCache.truncate`), rejected slots are
overwritten by the next step. The cache exposes what :meth:`TorchBackend.plan_memory`
reads (a :class:`~speculum.interfaces.CacheGroup`: ``name``, ``kv_bytes_per_token``,
``weight_bytes``, ``max_model_len``, ``attach_cache``); ``backend.register_cache`` gives it
as many blocks as the target.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from speculum.backends.torch.native.attention import (causal_mask, paged_decode_attention, sdpa_attention,
                                                      use_decode_kernel)
from speculum.backends.torch.native.kernels import rope_write_kv
from speculum.backends.torch.graphs import bucket
from speculum.kv import PagedKVAllocator, blocks_for

log = logging.getLogger(__name__)


class PagedContext:
    """Attention of one head forward over the paged cache (see ``HeadAttention``)."""

    def __init__(self, pools, write_slots: torch.Tensor, read_slots: torch.Tensor, mask: torch.Tensor):
        self.pools = pools              # per layer (k_pool, v_pool): [slots, Hkv, D]
        self.write_slots = write_slots  # [B, q]
        self.read_slots = read_slots    # [B, Lc]
        self.mask = mask                # [B, 1, q, Lc], or a tree's compact TreeMask

    def attend(self, index: int, qkv, heads, cos, sin, scale: float) -> torch.Tensor:
        """Rotate fused ``qkv`` (``heads``: Hq, Hkv, D), write its K/V at ``write_slots``
        (one kernel on a GPU), attend over ``read_slots`` under ``mask``."""
        k_pool, v_pool = self.pools[index]
        nq, nkv, d = heads
        t = qkv.shape[1]
        q = rope_write_kv(qkv.to(k_pool.dtype), nq, nkv, d, cos.to(k_pool.dtype), sin.to(k_pool.dtype),
                          self.write_slots, k_pool, v_pool)
        if use_decode_kernel(q, t, d):  # draft steps on a GPU: no gathered context
            return paged_decode_attention(q, k_pool, v_pool, self.read_slots, None, scale, self.mask)
        return sdpa_attention(q, k_pool, v_pool, self.read_slots, self.mask, scale)


class HeadKVCache:
    """K/V pools for ``num_layers`` head layers over a :class:`PagedKVAllocator`."""

    def __init__(self, name: str, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, max_model_len: int, weight_bytes: int = 0):
        self.name = name
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.max_model_len = max_model_len
        self.weight_bytes = weight_bytes
        self.allocator: PagedKVAllocator | None = None
        self.pools: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty(0, dtype=self.dtype).element_size()

    def join_memory_plan(self, backend) -> None:
        """Be planned with the backend's other paged caches (same number of blocks)."""
        backend.register_cache(self)

    def attach_cache(self, allocator: PagedKVAllocator) -> None:
        """Allocate pools for ``allocator``'s blocks (called by the memory plan)."""
        self.allocator = allocator
        slots = allocator.num_blocks * allocator.block_size
        self.pools = [(torch.zeros(slots, self.num_kv_heads, self.head_dim, dtype=self.dtype, device=self.device),
                       torch.zeros(slots, self.num_kv_heads, self.head_dim, dtype=self.dtype, device=self.device))
                      for _ in range(self.num_layers)]

    def _ensure(self) -> None:
        if self.allocator is None:  # a backend without a memory plan: room for 8 full sequences
            blocks = 8 * blocks_for(self.max_model_len, 16) + 2
            log.info("%s: no memory plan; own KV cache of %d blocks", self.name, blocks)
            self.attach_cache(PagedKVAllocator(group=self.name, num_blocks=blocks, block_size=16,
                                               max_model_len=self.max_model_len))

    # -- bookkeeping ----------------------------------------------------------------------
    def add(self, seq_id: int) -> None:
        self._ensure()
        if self.allocator.length(seq_id) or self.allocator.block_table(seq_id):
            raise ValueError(f"sequence {seq_id} already in the {self.name} cache")
        self.allocator.allocate(seq_id, 0)

    def length(self, seq_id: int) -> int:
        return self.allocator.length(seq_id)

    def truncate(self, seq_id: int, length: int) -> None:
        self.allocator.truncate(seq_id, length)

    def remove(self, seq_id: int) -> None:
        if self.allocator is not None:
            self.allocator.free(seq_id)

    def graph_key(self, seq_ids: Sequence[int]) -> tuple[int, int]:
        """(batch bucket, power-of-two block bucket) of a static function over ``seq_ids``, whose
        positions in this cache are allocated already: the shape of its CUDA graph."""
        alloc = self.allocator
        need = max(blocks_for(alloc.length(s), alloc.block_size) for s in seq_ids)
        return bucket(len(seq_ids)), 1 << max(0, need - 1).bit_length()

    # -- one forward ----------------------------------------------------------------------
    def prepare(self, seq_ids: Sequence[int], num_tokens: Sequence[int], q: int) -> tuple[torch.Tensor, PagedContext]:
        """Append ``num_tokens[b]`` positions per row; returns positions [B, q] and the context.

        Rows are right padded to ``q``; padded positions write into the scratch block 0.
        """
        alloc, bs = self.allocator, self.allocator.block_size
        for sid, n in zip(seq_ids, num_tokens):
            alloc.allocate(sid, int(n))
        B = len(seq_ids)
        nb = max(1, max(len(alloc.block_table(s)) for s in seq_ids))
        pos, wsl, blk = alloc.step_slots(seq_ids, [int(n) for n in num_tokens], q, B, nb)
        dev = self.device
        pos_t, wsl_t, blk_t = (torch.from_numpy(a).to(dev, non_blocking=True) for a in (pos, wsl, blk))
        return pos_t, self.context(pos_t, wsl_t, blk_t)

    def context(self, positions: torch.Tensor, write_slots: torch.Tensor, block_tables: torch.Tensor) -> PagedContext:
        """The context of a forward at ``positions`` [B, q] writing ``write_slots`` [B, q] and
        reading the blocks ``block_tables`` [B, nb] (0-padded: the scratch block, masked out by
        position), from device tensors only: what a static function (a CUDA graph) calls."""
        bs = self.allocator.block_size
        read = (block_tables.unsqueeze(-1) * bs + torch.arange(bs, device=block_tables.device)).reshape(
            block_tables.shape[0], -1)
        return PagedContext(self.pools, write_slots, read, causal_mask(positions, read.shape[1]))
