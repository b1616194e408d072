"""KV-cache bookkeeping (the KVAllocator interface): a simple token-budget allocator.

It tracks slots per sequence against a budget of tokens; the backend owns the tensors.
The paged, memory-planned allocator replaces it in the fast executor.
"""

from __future__ import annotations

import attrs
import numpy as np

from speculum.interfaces import KVCacheFull


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens (the one place block arithmetic lives)."""
    return -(-max(int(num_tokens), 0) // block_size)


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


@attrs.define(eq=False)
class PagedKVAllocator:
    """Fixed-size blocks with a block table per sequence, for one cache group.

    Block 0 is reserved as a scratch block: padded positions write there, so a padded
    batch never touches a live block. Rollback by length frees whole blocks past the
    new end; rejected slots inside the last block are simply overwritten next step.
    """

    group: str
    num_blocks: int
    block_size: int
    max_model_len: int | None = None
    _free: list[int] = attrs.field(init=False)
    _tables: dict[int, list[int]] = attrs.field(factory=dict, init=False)
    _lengths: dict[int, int] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self):
        if self.num_blocks < 2:
            raise KVCacheFull(f"{self.group} KV cache needs at least 2 blocks, got {self.num_blocks}")
        # pop() hands out low block ids first
        self._free = list(range(self.num_blocks - 1, 0, -1))

    def _blocks_for(self, length: int) -> int:
        return blocks_for(length, self.block_size)

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """More blocks the sequence needs to hold ``num_tokens`` tokens in all (0 if it has them)."""
        return max(0, self._blocks_for(num_tokens) - len(self._tables.get(seq_id, ())))

    @property
    def num_usable_blocks(self) -> int:
        """Blocks sequences can hold (all but the scratch block 0)."""
        return self.num_blocks - 1

    def seq_ids(self) -> list[int]:
        """Sequences this allocator tracks (holding blocks or not)."""
        return list(self._lengths)

    def owners(self) -> dict[int, int]:
        """Block id -> the sequence holding it (for leak and double-ownership checks)."""
        out: dict[int, int] = {}
        for sid, table in self._tables.items():
            for b in table:
                if b in out:
                    raise AssertionError(f"{self.group}: block {b} held by sequences {out[b]} and {sid}")
                out[b] = sid
        return out

    def check(self) -> None:
        """Every usable block is either free or held by exactly one sequence, once."""
        held = self.owners()
        free = self._free
        if len(set(free)) != len(free):
            raise AssertionError(f"{self.group}: a block is on the free list twice")
        if set(free) & set(held):
            raise AssertionError(f"{self.group}: blocks both free and held: {sorted(set(free) & set(held))[:5]}")
        missing = set(range(1, self.num_blocks)) - set(free) - set(held)
        if missing:
            raise AssertionError(f"{self.group}: {len(missing)} blocks leaked (neither free nor held)")

    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        new_len = self._lengths.get(seq_id, 0) + num_tokens
        if self.max_model_len is not None and new_len > self.max_model_len:
            return False
        need = self._blocks_for(new_len) - len(self._tables.get(seq_id, ()))
        return need <= len(self._free)

    def allocate(self, seq_id: int, num_tokens: int) -> None:
        # can_allocate's rule, worked out once (this runs for every row of every forward)
        new_len = self._lengths.get(seq_id, 0) + num_tokens
        table = self._tables.get(seq_id)
        need = self._blocks_for(new_len) - (len(table) if table is not None else 0)
        if need > len(self._free) or (self.max_model_len is not None and new_len > self.max_model_len):
            raise KVCacheFull(
                f"{self.group} KV cache: no room for {num_tokens} more tokens of sequence {seq_id} "
                f"({len(self._free)} free blocks of {self.block_size}; length "
                f"{self._lengths.get(seq_id, 0)}, max_model_len {self.max_model_len})"
            )
        if table is None:
            table = self._tables[seq_id] = []
        for _ in range(need):
            table.append(self._free.pop())
        self._lengths[seq_id] = new_len

    def truncate(self, seq_id: int, length: int) -> None:
        cur = self._lengths.get(seq_id, 0)
        if length < 0 or length > cur:
            raise ValueError(f"cannot truncate sequence {seq_id} of length {cur} to {length}")
        table = self._tables.get(seq_id, [])
        for _ in range(len(table) - self._blocks_for(length)):
            self._free.append(table.pop())
        self._lengths[seq_id] = length

    def free(self, seq_id: int) -> None:
        for b in self._tables.pop(seq_id, []):
            self._free.append(b)
        self._lengths.pop(seq_id, None)

    def length(self, seq_id: int) -> int:
        return self._lengths.get(seq_id, 0)

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables.get(seq_id, [])

    def step_slots(self, seq_ids, num_tokens, q: int, rows: int, num_blocks: int):
        """Where the last ``num_tokens[b]`` positions of each sequence (already allocated) go.

        Returns numpy int64 arrays: positions and write slots ``[rows, q]`` (right padded;
        positions past a row's valid ones, and padding rows, write into scratch block 0)
        and block tables ``[rows, num_blocks]`` (0-padded).
        """
        bs = self.block_size
        if rows * q <= 256:  # a decode or verify step: Python lists beat a dozen numpy calls on small rows
            return self._step_slots_small(seq_ids, num_tokens, q, rows, num_blocks)
        n = len(seq_ids)
        blk = self.block_tables(seq_ids, rows, num_blocks)
        ends = np.zeros(rows, dtype=np.int64)
        ends[:n] = [self.length(sid) for sid in seq_ids]
        starts = ends.copy()
        starts[:n] -= np.asarray(num_tokens, dtype=np.int64)
        pos = starts[:, None] + np.arange(q, dtype=np.int64)[None, :]
        slot = np.take_along_axis(blk, np.minimum(pos // bs, num_blocks - 1), axis=1) * bs + pos % bs
        wsl = np.where(pos < ends[:, None], slot, pos % bs)
        return pos, wsl, blk

    def block_tables(self, seq_ids, rows: int, num_blocks: int) -> np.ndarray:
        """The sequences' block tables as one int64 array ``[rows, num_blocks]`` (0-padded:
        padding rows and slots past a table read the scratch block 0)."""
        blk = np.zeros((rows, num_blocks), dtype=np.int64)
        for b, sid in enumerate(seq_ids):
            table = self.block_table(sid)
            blk[b, : len(table)] = table
        return blk

    def _step_slots_small(self, seq_ids, num_tokens, q: int, rows: int, num_blocks: int):
        """:meth:`step_slots` built as lists (the same arrays)."""
        bs = self.block_size
        pos, wsl, blk = [], [], []
        for sid, m in zip(seq_ids, num_tokens):
            table, end = self.block_table(sid), self.length(sid)
            p = range(end - m, end - m + q)
            pos += p
            wsl += [table[i // bs] * bs + i % bs if i < end else i % bs for i in p]
            blk += [*table, *[0] * (num_blocks - len(table))]
        pad = rows - len(seq_ids)  # padding rows: positions 0..q-1 in the scratch block
        pos += list(range(q)) * pad
        wsl += [i % bs for i in range(q)] * pad
        blk += [0] * (num_blocks * pad)
        return (np.array(pos, np.int64).reshape(rows, q), np.array(wsl, np.int64).reshape(rows, q),
                np.array(blk, np.int64).reshape(rows, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    @property
    def capacity_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size


@attrs.frozen
class MemoryPlan:
    """How the KV budget is split; logged at engine start.

    ``num_blocks`` counts the scratch block 0 too: sequences can use ``num_blocks - 1``.
    ``overshoot``: tokens a draft cache may hold past ``max_model_len`` (a draft runs up
    to k - 1 positions ahead of its sequence), so one sequence needs
    ``max_model_len + overshoot`` tokens of blocks.
    """

    budget_bytes: int
    bytes_per_block: dict[str, int]
    num_blocks: int
    block_size: int
    weight_bytes: dict[str, int]
    max_model_len: int
    overshoot: int = 0

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def tokens(self) -> int:
        return self.usable_blocks * self.block_size

    @property
    def max_seqs_at_max_len(self) -> int:
        return self.usable_blocks // blocks_for(self.max_model_len + self.overshoot, self.block_size)

    def describe(self) -> str:
        gib = 1 << 30
        w = ", ".join(f"{k} {v / gib:.2f} GiB" for k, v in self.weight_bytes.items())
        kv = ", ".join(f"{k} {v * self.num_blocks / gib:.2f} GiB" for k, v in self.bytes_per_block.items())
        ahead = f" (+{self.overshoot} draft positions)" if self.overshoot else ""
        return (f"memory plan: weights [{w}]; KV budget {self.budget_bytes / gib:.2f} GiB [{kv}]; "
                f"{self.num_blocks} blocks x {self.block_size} tokens, {self.usable_blocks} usable (block 0 is "
                f"scratch) = {self.tokens} tokens; {self.max_seqs_at_max_len} sequences fit at max length "
                f"{self.max_model_len}{ahead}")


def plan_kv_memory(budget_bytes: int, bytes_per_token: dict[str, int], block_size: int,
                   weight_bytes: dict[str, int], max_model_len: int, overshoot: int = 0) -> MemoryPlan:
    """Split a KV budget into equally many blocks for every cache group.

    Every group (target, each draft cache) holds the same tokens, so a block costs the
    sum of the groups' bytes. Raises KVCacheFull when not even one sequence of
    ``max_model_len`` tokens (plus ``overshoot`` draft positions) fits, naming the
    largest ``max_model_len`` that would.
    """
    per_block = {g: b * block_size for g, b in bytes_per_token.items()}
    num_blocks = int(budget_bytes // max(sum(per_block.values()), 1))
    plan = MemoryPlan(int(budget_bytes), per_block, num_blocks, block_size, dict(weight_bytes), max_model_len,
                      overshoot)
    need = blocks_for(max_model_len + overshoot, block_size) + 1  # + the scratch block
    if num_blocks < need:
        gib = 1 << 30
        usable = max(num_blocks - 1, 0) * block_size
        fits = usable - overshoot
        largest = (f"the largest max_model_len that fits is {fits}" if fits >= 2 else
                   "not even a 2-token sequence fits")
        raise KVCacheFull(
            f"KV cache budget {budget_bytes / gib:.4f} GiB holds {usable} tokens ({max(num_blocks - 1, 0)} usable "
            f"blocks of {block_size}), less than one sequence of max_model_len={max_model_len}"
            + (f" plus {overshoot} draft positions" if overshoot else "") + f": {largest}. Raise kv_cache_memory / "
            "gpu_memory_utilization, lower max_model_len, or use a smaller draft (weights: "
            + ", ".join(f"{k} {v / gib:.2f} GiB" for k, v in weight_bytes.items()) + ")."
        )
    return plan
