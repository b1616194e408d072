"""KV-cache bookkeeping (the KVAllocator interface): a simple token-budget allocator.

It tracks slots per sequence against a budget of tokens; the backend owns the tensors.
The paged, memory-planned allocator replaces it in the fast executor.
"""

from __future__ import annotations

import attrs

from speculum.interfaces import KVCacheFull


@attrs.define(eq=False)
class SimpleKVAllocator:
    """Counts KV slots per sequence for one cache group (``"target"``, ``"draft"``...).

    ``capacity_tokens=None`` means no limit beyond ``max_model_len`` per sequence.
    """

    group: str = "target"
    capacity_tokens: int | None = None
    max_model_len: int | None = None
    _lengths: dict[int, int] = attrs.field(factory=dict)
    _used: int = 0

    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        new_len = self._lengths.get(seq_id, 0) + num_tokens
        if self.max_model_len is not None and new_len > self.max_model_len:
            return False
        return self.capacity_tokens is None or self._used + num_tokens <= self.capacity_tokens

    def allocate(self, seq_id: int, num_tokens: int) -> None:
        if not self.can_allocate(seq_id, num_tokens):
            raise KVCacheFull(
                f"{self.group} KV cache: {num_tokens} more slots for sequence {seq_id} do not fit "
                f"(used {self._used}/{self.capacity_tokens} tokens, length "
                f"{self._lengths.get(seq_id, 0)}, max_model_len {self.max_model_len})"
            )
        self._lengths[seq_id] = self._lengths.get(seq_id, 0) + num_tokens
        self._used += num_tokens

    def truncate(self, seq_id: int, length: int) -> None:
        cur = self._lengths.get(seq_id, 0)
        if length < 0 or length > cur:
            raise ValueError(f"cannot truncate sequence {seq_id} of length {cur} to {length}")
        self._lengths[seq_id] = length
        self._used -= cur - length

    def free(self, seq_id: int) -> None:
        self._used -= self._lengths.pop(seq_id, 0)

    def length(self, seq_id: int) -> int:
        return self._lengths.get(seq_id, 0)

    def usage(self) -> float:
        if not self.capacity_tokens:
            return 0.0
        return self._used / self.capacity_tokens

    @property
    def used_tokens(self) -> int:
        return self._used
