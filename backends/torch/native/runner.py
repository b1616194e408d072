"""NativeRunner: the native Llama-family model over a paged KV cache, with CUDA graphs.

Decode and verify forwards have static shapes ``[B, q]`` with ``B`` rounded up to a batch
bucket and the context rounded up to a block bucket, so each shape is captured once as
a CUDA graph and replayed (:mod:`speculum.backends.torch.graphs`). Per-step host work is
building one small int64 buffer (positions, write slots, block tables) and copying it to
the device; there is no host synchronisation inside a forward.

The next verify forward (a chain's or a tree's) can start from a verdict still on the
device (:meth:`NativeRunner.forward_from_verdict`): a tree's accepted path is moved into
place and each row's positions and write slots are made on the device from its accepted
count, over a block table the host reserved for the longest outcome, so the forward is
queued before the host has read the verdict. A draft model's greedy chain from a verdict
(:meth:`NativeRunner.chain_from_verdict`) is its ``k`` such forwards and their argmaxes, each
fed the one before, as one static function: one graph replay a chain.

Token trees (``forward(..., tree=...)``): column ``c`` of a verify forward is written at
the sequence's next logical slot as usual, but gets the position ``root + depth`` and
attends to the context, the root and its own ancestors only. After verification
:meth:`NativeRunner.move_kv` copies the accepted nodes' K/V into consecutive slots and
``truncate`` drops the rest. Tree forwards are graphed like chains (their own graphs).
In batch-invariant mode a tree query reads no mask but its own table of key slots
(:func:`_tree_invariant_inputs`): the keys a decode step at its position would read once
its path is compacted, in the same order, so an accepted node's logits are those bits.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import torch

from speculum.backends.torch.graphs import GraphPool, StaticGraph, bucket
from speculum.backends.torch.native.model import NativeLlama
from speculum.interfaces import ForwardOutput, KVCacheFull
from speculum.kv import PagedKVAllocator, blocks_for
from speculum.tree import TokenTree, TreeMask, columns_of

log = logging.getLogger(__name__)

#: the target's batch buckets (finer than the drafting graphs': a verify graph is the big one);
#: past 512 rows, multiples of 512 (:func:`~speculum.backends.torch.graphs.bucket`)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512)


class NativeRunner:
    """A :class:`~speculum.interfaces.ModelRunner` for :class:`NativeLlama` models."""

    #: verifies token trees (``forward(..., tree=...)`` and :meth:`move_kv`)
    supports_trees = True
    #: launches the next verify forward from a device verdict (:meth:`forward_from_verdict`)
    forwards_from_verdict = True
    #: takes each row's first input token on the host (``forward(..., last_tokens=...)``)
    takes_last_tokens = True

    def __init__(self, model: NativeLlama, name: str = "target", max_model_len: int | None = None,
                 cuda_graphs: bool = True, prefill_chunk: int = 512):
        self.model = model
        self.arch = model.arch
        self.name = name
        self.vocab_size = model.arch.vocab_size
        self.hidden_size = model.arch.hidden_size
        self.num_layers = model.arch.num_layers
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.max_model_len = max_model_len or model.arch.max_position_embeddings
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.prefill_chunk = prefill_chunk
        #: (batch bucket, q, block bucket, hidden layers, tree) -> (graph, tree buffers)
        self._graphs: dict[tuple, tuple[StaticGraph, tuple | None]] = {}
        self._pool = GraphPool()
        self.allocator: PagedKVAllocator | None = None  # set by attach_cache (memory plan)
        #: bytes of oneDNN's prepacked weight copies (a CPU in fp32; :meth:`NativeLlama.pack_gemms`)
        self.packed_bytes = model.pack_gemms()

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters()) + self.packed_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.arch.kv_bytes_per_token * torch.empty(0, dtype=self.dtype).element_size()

    def attach_cache(self, allocator: PagedKVAllocator) -> None:
        """Allocate this runner's K/V pools for ``allocator``'s blocks."""
        self.allocator = allocator
        self.block_size = allocator.block_size
        slots = allocator.num_blocks * allocator.block_size
        a = self.arch
        # one tensor for every layer's K and V, so moving slots (trees) is one gather and
        # one scatter; layer i's pools are views of rows 2i and 2i+1
        self.kv = torch.zeros(2 * a.num_layers, slots, a.num_kv_heads, a.head_dim, dtype=self.dtype,
                              device=self.device)
        self.pools = [(self.kv[2 * i], self.kv[2 * i + 1]) for i in range(a.num_layers)]
        self.max_blocks = blocks_for(self.max_model_len, self.block_size)
        self._block_buckets = self._make_block_buckets()
        self._graphs.clear()

    # -- shapes ---------------------------------------------------------------------------
    def _make_block_buckets(self) -> list[int]:
        out, nb = [], max(1, 256 // self.block_size)
        while nb < self.max_blocks:
            out.append(nb)
            nb *= 2
        out.append(self.max_blocks)
        return out

    def _read_slots(self, blocks: torch.Tensor) -> torch.Tensor:
        """[B, nb] block ids -> [B, nb * block_size] slot ids."""
        bs = self.block_size
        ar = torch.arange(bs, device=blocks.device)
        return (blocks.unsqueeze(-1) * bs + ar).reshape(blocks.shape[0], -1)

    def _host_meta(self, seq_ids: Sequence[int], num_tokens: Sequence[int], q: int, B: int, nb: int):
        """Positions, write slots and block tables ([B, q], [B, q], [B, nb]) on the host."""
        pos, wsl, blk = self.allocator.step_slots(seq_ids, num_tokens, q, B, nb)
        return torch.from_numpy(pos), torch.from_numpy(wsl), torch.from_numpy(blk)

    # -- ModelRunner ----------------------------------------------------------------------
    def length(self, seq_id: int) -> int:
        return self.allocator.length(seq_id)

    def add(self, seq_id: int, token_ids: Sequence[int], hidden_layers: Sequence[int] = ()) -> dict:
        return self.add_many([seq_id], [token_ids], hidden_layers)[seq_id]

    def add_many(self, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]],
                 hidden_layers: Sequence[int] = (), logits_sink=None) -> dict[int, dict[int, torch.Tensor]]:
        """Prefill new sequences together, in chunks of ``prefill_chunk`` tokens (eager).

        Rows are right padded to the longest chunk; padding writes to the scratch block.
        Returns ``{seq_id: {layer: [len(prompt), H]}}``: the requested hidden states of
        every prefilled position (empty dicts when no layers are asked for).
        ``logits_sink(seq_id, start, logits [n, V])``, when given, receives the logits of
        every prefilled position chunk by chunk (prompt logprobs), never all at once.
        """
        hidden_layers = tuple(hidden_layers)
        parts: dict[int, dict[int, list[torch.Tensor]]] = {sid: {l: [] for l in hidden_layers} for sid in seq_ids}
        prompts = [list(p) for p in prompts]
        for sid in seq_ids:
            if self.allocator.length(sid) or self.allocator.block_table(sid):
                raise ValueError(f"sequence {sid} already in the {self.name} runner")
            self.allocator.allocate(sid, 0)
        longest = max((len(p) for p in prompts), default=0)
        # bound the padded batch: at most prefill_chunk * 8 tokens per forward
        rows_per_pass = max(1, (self.prefill_chunk * 8) // max(1, min(longest, self.prefill_chunk)))
        for start in range(0, longest, self.prefill_chunk):
            chunk = [(sid, p[start: start + self.prefill_chunk]) for sid, p in zip(seq_ids, prompts)
                     if len(p) > start]
            for i in range(0, len(chunk), rows_per_pass):
                part = chunk[i: i + rows_per_pass]
                q = max(len(t) for _, t in part)
                ids = torch.zeros(len(part), q, dtype=torch.int64)
                for r, (sid, toks) in enumerate(part):
                    ids[r, : len(toks)] = torch.tensor(toks, dtype=torch.int64)
                    self.allocator.allocate(sid, len(toks))
                out = self._eager([sid for sid, _ in part], ids, [len(t) for _, t in part], hidden_layers,
                                  compute_logits=logits_sink is not None, fresh=start == 0)
                if logits_sink is not None:
                    for r, (sid, toks) in enumerate(part):
                        logits_sink(sid, start, out.logits[r, : len(toks)])
                for layer, h in out.hidden_states.items():  # [rows, q, H]
                    for r, (sid, toks) in enumerate(part):
                        parts[sid][layer].append(h[r, : len(toks)])
        empty = torch.empty(0, self.hidden_size, dtype=self.dtype, device=self.device)
        return {sid: {l: torch.cat(hs) if hs else empty for l, hs in d.items()} for sid, d in parts.items()}

    def forward(self, seq_ids: Sequence[int], token_ids: torch.Tensor, num_tokens: Sequence[int],
                hidden_layers: Sequence[int] = (), tree: TokenTree | None = None,
                last_tokens: Sequence[int] | None = None) -> ForwardOutput:
        """Append ``token_ids`` [B, q] (first ``num_tokens[b]`` valid per row); logits [B, q, V].

        ``tree`` (for ``q - 1`` nodes): column 0 is the root, column ``c`` node ``c - 1``;
        positions follow depth and attention the tree (see the module doc).
        ``last_tokens`` (on the host): each row's column 0, ``token_ids`` [B, q - 1] then
        holds the rest (drafts: ids outside the vocabulary, padding -1 included, are clamped
        into it here); a graphed step stages them with its metadata, so the caller ships no
        copy of them and builds no [B, q] tensor on the device.
        The returned tensors may be graph outputs: valid until this runner's next forward.
        """
        num_tokens = [int(n) for n in num_tokens]
        for sid, n in zip(seq_ids, num_tokens):
            self.allocator.allocate(sid, n)
        cols = None
        if tree is not None:  # node depths [B, N] and ancestors [B, N, N], on the device
            cols = (tree.depth.to(self.device), tree.ancestors.to(self.device))
        if self.cuda_graphs:  # (the graph clamps ids into the vocabulary itself: one launch less)
            return self._graphed(seq_ids, token_ids, num_tokens, tuple(hidden_layers), cols, last_tokens)
        if last_tokens is not None:
            first = torch.tensor(list(last_tokens), dtype=torch.int64).view(-1, 1).to(token_ids.device)
            token_ids = torch.cat([first, token_ids.to(torch.int64)], dim=1)
        return self._eager(seq_ids, token_ids.clamp(0, self.vocab_size - 1), num_tokens, tuple(hidden_layers),
                           cols=cols)

    def forward_from_verdict(self, seq_ids: Sequence[int], starts: Sequence[int], num_accepted: torch.Tensor,
                             token_ids: torch.Tensor, hidden_layers: Sequence[int] = (),
                             path: torch.Tensor | None = None, tree: TokenTree | None = None) -> ForwardOutput | None:
        """The next verify forward of ``seq_ids`` while their last verdict is still on the
        device: row ``b`` keeps ``starts[b] + num_accepted[b]`` positions ([B] on the device)
        and appends ``token_ids[b]`` ([B, q] on the device: the verdict's new token, then the
        next drafts, or the next ``tree``'s nodes) after them. A tree verdict's accepted nodes
        (``path`` [B, N], -1 padded) are first moved into place, as :meth:`move_kv` does from
        the host. The host does not know the counts yet, so each row's block table is
        extended for the longest outcome (``q`` positions past its current length, which
        covers every count of the verify just run); once it knows them the caller truncates
        each row to ``start + count + q`` (what this forward wrote) or, dropping it, to
        ``start + count``. None (nothing allocated, moved or launched) when the cache has no
        room for the longest outcome or no graph could be captured for the shape."""
        if not self.forwards_from_verdict:
            return None
        B, q = token_ids.shape
        reserved = self._reserve(seq_ids, starts, q)
        if reserved is None:
            return None
        Bb, nb, blk, start, undo = reserved
        dev = self.device
        acc = num_accepted.to(dev, torch.int64).view(B)
        ids = token_ids.to(dev, torch.int64).clamp(0, self.vocab_size - 1)
        path = None if path is None else path.to(dev, torch.int64)
        cols = None if tree is None else (tree.depth.to(dev), tree.ancestors.to(dev))
        hidden_layers = tuple(hidden_layers)
        if not self.cuda_graphs:
            with torch.inference_mode():
                logits, hidden = self._from_verdict(torch.from_numpy(blk).to(dev), torch.from_numpy(start).to(dev),
                                                    acc, ids, hidden_layers, path, cols)
            return ForwardOutput(logits=logits, hidden_states=hidden)
        key = (Bb, q, nb, hidden_layers, tree is not None, 0 if path is None else path.shape[1], "verdict")
        entry = self._graphs.get(key)
        if entry is None:
            try:  # (a capture runs on zeroed inputs: it moves and writes nothing but scratch slots)
                entry = self._capture_from_verdict(key)
            except Exception as exc:  # nothing launched: the caller goes on as before, and so do later steps
                log.warning("%s: no CUDA graph for a forward from the verdict (%r); such forwards are off", self.name,
                            exc)
                self.forwards_from_verdict = False
                undo()
                return None
        graph, bufs = entry
        h = graph.host()
        h[: Bb * nb] = blk.reshape(-1)
        h[Bb * nb:] = start
        graph.upload()
        acc_buf, ids_buf, path_buf, tree_bufs = bufs
        acc_buf.zero_()
        ids_buf.zero_()
        acc_buf[:B].copy_(acc)
        ids_buf[:B].copy_(ids)
        if path_buf is not None:
            path_buf.fill_(-1)
            path_buf[:B].copy_(path)
        if tree_bufs is not None:
            tree_bufs[0][:B].copy_(cols[0])
            tree_bufs[1][:B].copy_(cols[1])
        return _replayed(graph, B)

    def _reserve(self, seq_ids: Sequence[int], starts: Sequence[int], n: int):
        """Each row's block table extended by ``n`` positions past its length (the longest outcome
        of a launch from a verdict) -> (batch bucket, block bucket, block tables [Bb, nb], starts
        [Bb] as numpy, an ``undo`` putting every row back), or None with nothing allocated when the
        cache has no room."""
        before = [self.allocator.length(sid) for sid in seq_ids]

        def undo() -> None:  # every row as before: nothing allocated
            for sid, m in zip(seq_ids, before):
                if self.allocator.length(sid) > m:
                    self.allocator.truncate(sid, m)

        try:
            for sid in seq_ids:
                self.allocator.allocate(sid, n)
        except KVCacheFull:
            undo()
            return None
        B = len(seq_ids)
        need = max(blocks_for(self.allocator.length(s), self.block_size) for s in seq_ids)
        Bb = bucket(B, BATCH_BUCKETS) if self.cuda_graphs else B
        nb = bucket(max(need, 1), self._block_buckets)
        start = np.zeros(Bb, dtype=np.int64)
        start[:B] = [int(x) for x in starts]
        return Bb, nb, self.allocator.block_tables(seq_ids, Bb, nb), start, undo

    def _from_verdict(self, blk: torch.Tensor, start: torch.Tensor, acc: torch.Tensor, ids: torch.Tensor,
                      hidden_layers: tuple, path: torch.Tensor | None = None, cols=None):
        """The static function of :meth:`forward_from_verdict`: block tables [Bb, nb], starts
        and accepted counts [Bb], tokens [Bb, q], the last tree's accepted nodes [Bb, N] (or
        None), the next tree's (depths, ancestors) (or None) -> the model's (logits, hidden
        states). Padding rows (zero tables) read and write the scratch block 0."""
        Bb, q = ids.shape
        bs, nb, dev = self.block_size, blk.shape[1], ids.device

        def slots(p: torch.Tensor) -> torch.Tensor:  # logical positions [Bb, n] -> cache slots
            return blk.gather(1, (p // bs).clamp_max(nb - 1)) * bs + p % bs

        if path is not None and path.shape[1]:  # node i was written at start + i; depth d belongs at start + d - 1
            d = torch.arange(path.shape[1], device=dev).view(1, -1)
            src = start.view(Bb, 1) + torch.where(d < acc.view(Bb, 1), path.clamp_min(0), d)  # others: in place
            dst = start.view(Bb, 1) + d
            self.kv.index_copy_(1, slots(dst).reshape(-1), self.kv.index_select(1, slots(src).reshape(-1)))
        pos = (start + acc).view(Bb, 1) + torch.arange(q, device=dev).view(1, q)
        wsl, read, mask = slots(pos), self._read_slots(blk), None
        if cols is not None:
            pos, read, mask = self._tree(pos, read, cols)
        return self.model(ids, pos, wsl, read, self.pools, hidden_layers, True, mask)

    def chain_from_verdict(self, seq_ids: Sequence[int], starts: Sequence[int], rows: torch.Tensor,
                           last: Sequence[int], k: int) -> torch.Tensor | None:
        """A greedy chain of ``k`` drafts per row from a verdict still on the device, as one
        static function (a CUDA graph per batch bucket, ``k``, verdict width and block bucket;
        eager without graphs). ``rows`` [B, 1 + >= 2] (the verdict's :meth:`~speculum.interfaces.Verdict.as_rows`,
        on the device): each row's accepted count ``a`` and the tokens its step emitted;
        ``last`` (host): each row's token at position ``starts[b]``, its last before the step.
        The first forward is :meth:`forward_from_verdict` of two tokens: the one at position
        ``starts[b] + a`` (the last accepted draft, or ``last[b]`` when none was), rewritten, and the
        verdict's new token; then ``k - 1`` forwards each append the argmax of the one before.
        Row ``b`` then holds ``starts[b] + a + k + 1`` positions at most: ``k + 1`` are allocated
        past its length for the longest outcome, and the caller truncates once it knows ``a``.
        Only the metadata (block tables, starts, ``last``) crosses from the host, in one pinned
        copy; the verdict's rows are copied on the device. Returns the drafts [B, k] (being
        computed), or None with nothing allocated or launched (no room, or no graph for the shape)."""
        if not self.forwards_from_verdict:
            return None
        B, W = rows.shape
        reserved = self._reserve(seq_ids, starts, k + 1)
        if reserved is None:
            return None
        Bb, nb, blk, start, undo = reserved
        meta = np.concatenate([blk.reshape(-1), start, np.zeros(Bb, dtype=np.int64)])
        meta[Bb * nb + Bb: Bb * nb + Bb + B] = [int(t) for t in last]
        rows = rows.to(self.device, torch.int64)
        if not self.cuda_graphs:
            with torch.inference_mode():
                return self._chain(torch.from_numpy(meta).to(self.device), rows, Bb, nb, k)
        key = (Bb, k, W, nb, "chain")
        entry = self._graphs.get(key)
        if entry is None:
            try:  # (a capture runs on zeroed inputs: it writes nothing but scratch slots)
                entry = self._capture_chain(key)
            except Exception as exc:  # nothing launched: drafting waits for the host's copy from now on
                log.warning("%s: no CUDA graph for a chain from the verdict (%r); such chains are off", self.name, exc)
                self.forwards_from_verdict = False
                undo()
                return None
        graph, rows_buf = entry
        graph.host()[:] = meta
        graph.upload()
        rows_buf[:B].copy_(rows)  # (padding rows keep earlier rows' values: they read and write the scratch block)
        return graph.replay()[:B].clone()  # (a copy: the launch keeps its drafts past the next replay)

    def _chain(self, meta: torch.Tensor, rows: torch.Tensor, Bb: int, nb: int, k: int) -> torch.Tensor:
        """The static function of :meth:`chain_from_verdict`: metadata ``[blocks | starts | last]``
        and the verdict's rows [Bb, W] -> the drafts [Bb, k]. Forward ``i`` keeps
        ``start + a + i + (i > 0)`` positions: the first rewrites one and appends one."""
        blk, start, last = meta.split([Bb * nb, Bb, Bb])
        blk = blk.view(Bb, nb)
        acc = rows[:, 0].clamp(0, rows.shape[1] - 2)
        cand = torch.cat([last.view(Bb, 1), rows[:, 1:]], dim=1)  # the tokens from position start on
        ids = first_chain_tokens(cand, acc).clamp(0, self.vocab_size - 1)
        drafts = []
        for i in range(k):
            logits, _ = self._from_verdict(blk, start + (i + (i > 0)), acc, ids, ())
            drafts.append(logits[:, -1].argmax(dim=-1))
            ids = drafts[-1].view(-1, 1)
        return torch.stack(drafts, dim=1)

    def _capture_chain(self, key):
        Bb, k, W, nb, _ = key
        dev = self.device
        meta = torch.zeros(Bb * nb + 2 * Bb, dtype=torch.int64, device=dev)
        rows = torch.zeros(Bb, W, dtype=torch.int64, device=dev)
        for q in (2, 1):
            self.model.tune_gemms(Bb * q)
        entry = (self._pool.capture(lambda: self._chain(meta, rows, Bb, nb, k), meta, staging=8), rows)
        self._graphs[key] = entry
        log.debug("%s: captured CUDA graph of a chain of %d from the verdict for batch %d, %d blocks", self.name, k,
                  Bb, nb)
        return entry

    def _capture_from_verdict(self, key):
        Bb, q, nb, hidden_layers, tree, width, _ = key
        dev = self.device
        meta = torch.zeros(Bb * nb + Bb, dtype=torch.int64, device=dev)
        acc = torch.zeros(Bb, dtype=torch.int64, device=dev)
        ids = torch.zeros(Bb, q, dtype=torch.int64, device=dev)
        path = torch.full((Bb, width), -1, dtype=torch.int64, device=dev) if width else None
        tree_bufs = None
        if tree:  # node depths [Bb, N] and ancestors [Bb, N, N]; a chain until filled
            chain = TokenTree.chain(Bb, q - 1, dev)
            tree_bufs = (chain.depth.contiguous(), chain.ancestors.contiguous())

        def run():
            return _graph_outputs(*self._from_verdict(meta[: Bb * nb].view(Bb, nb), meta[Bb * nb:], acc, ids,
                                                    hidden_layers, path, tree_bufs))

        self.model.tune_gemms(Bb * q)
        entry = (self._pool.capture(run, meta, staging=8), (acc, ids, path, tree_bufs))
        self._graphs[key] = entry
        log.debug("%s: captured CUDA graph from the verdict for batch %d, %d tokens, %d blocks", self.name, Bb, q, nb)
        return entry

    def _eager(self, seq_ids, token_ids, num_tokens, hidden_layers, compute_logits=True, cols=None,
               fresh=False) -> ForwardOutput:
        B, q = token_ids.shape
        token_ids = token_ids.to(self.device)
        need = max(blocks_for(self.allocator.length(s), self.block_size) for s in seq_ids)
        nb = bucket(max(need, 1), self._block_buckets)
        pos, wsl, blk = (t.to(self.device, non_blocking=True) for t in self._host_meta(seq_ids, num_tokens, q, B, nb))
        read = self._read_slots(blk)
        mask = None
        if cols is not None:
            pos, read, mask = self._tree(pos, read, cols)
        with torch.inference_mode():
            logits, hidden = self.model(token_ids, pos, wsl, read, self.pools, hidden_layers, compute_logits, mask,
                                        fresh)
        return ForwardOutput(logits=logits, hidden_states=hidden)

    def _graphed(self, seq_ids, token_ids, num_tokens, hidden_layers, cols=None, last=None) -> ForwardOutput:
        B, q = token_ids.shape
        q += last is not None  # (token_ids: the columns after the last tokens)
        Bb = bucket(B, BATCH_BUCKETS)
        need = max(blocks_for(self.allocator.length(s), self.block_size) for s in seq_ids)
        nb = bucket(max(need, 1), self._block_buckets)
        key = (Bb, q, nb, hidden_layers, cols is not None)
        graph, tree_bufs = self._graphs.get(key) or self._capture(key)
        # one pinned host buffer [ids | positions | write slots | block tables] per step,
        # taken in turn from the graph's eight so a pending copy never sees its buffer rewritten
        h = graph.host()
        pos, wsl, blk = self._host_meta(seq_ids, num_tokens, q, Bb, nb)
        n = Bb * q
        h[n: 2 * n] = pos.numpy().reshape(-1)
        h[2 * n: 3 * n] = wsl.numpy().reshape(-1)
        h[3 * n:] = blk.numpy().reshape(-1)
        on_host = token_ids.device.type == "cpu"
        h[:n] = 0
        ids = h[:n].reshape(Bb, q)
        c0 = 0 if last is None else 1  # the first column given on the host
        if c0:
            ids[:B, 0] = last
        if on_host and token_ids.shape[1]:
            ids[:B, c0:] = token_ids.numpy()
        graph.upload()
        if not on_host and token_ids.shape[1]:  # after the upload, in stream order
            graph.meta[:n].view(Bb, q)[:B, c0:].copy_(token_ids)
        if cols is not None:
            tree_bufs[0][:B].copy_(cols[0])
            tree_bufs[1][:B].copy_(cols[1])
        return _replayed(graph, B)

    def _capture(self, key):
        Bb, q, nb, hidden_layers, tree = key
        n = Bb * q
        meta = torch.zeros(3 * n + Bb * nb, dtype=torch.int64, device=self.device)
        tree_bufs = None
        if tree:  # node depths [Bb, N] and ancestors [Bb, N, N]; a chain until filled
            chain = TokenTree.chain(Bb, q - 1, self.device)
            tree_bufs = (chain.depth.contiguous(), chain.ancestors.contiguous())

        def run():
            ids = meta[:n].view(Bb, q).clamp(0, self.vocab_size - 1)  # padding (-1) and unknown ids
            pos = meta[n: 2 * n].view(Bb, q)
            wsl = meta[2 * n: 3 * n].view(Bb, q)
            blk = meta[3 * n:].view(Bb, nb)
            read = self._read_slots(blk)
            mask = None
            if tree_bufs is not None:
                pos, read, mask = self._tree(pos, read, tree_bufs)
            return _graph_outputs(*self.model(ids, pos, wsl, read, self.pools, hidden_layers, True, mask))

        self.model.tune_gemms(Bb * q)  # the BLAS library of each GEMM at this many rows
        entry = (self._pool.capture(run, meta, staging=8), tree_bufs)
        self._graphs[key] = entry
        log.debug("%s: captured CUDA graph for batch %d, %d tokens, %d blocks", self.name, Bb, q, nb)
        return entry

    def _tree(self, pos: torch.Tensor, read: torch.Tensor, cols) -> tuple:
        """(positions, read slots, mask) of a tree forward: the ancestors-only mask, or in
        batch-invariant mode per-query read slots and no mask."""
        if self.model.batch_invariant:
            pos, read = _tree_invariant_inputs(pos, read, *cols)
            return pos, read, None
        pos, mask = _tree_inputs(pos, *cols)
        return pos, read, mask

    def capture(self, batch_sizes: Sequence[int], query_lens: Sequence[int],
                max_block_buckets: int | None = None, hidden_layers: Sequence[int] = (),
                tree_query_lens: Sequence[int] = ()) -> int:
        """Capture graphs ahead of time; returns how many were made. Other shapes are
        captured the first time they occur. ``tree_query_lens``: tree verify shapes."""
        if not self.cuda_graphs:
            return 0
        n = 0
        shapes = [(q, False) for q in query_lens] + [(q, True) for q in tree_query_lens]
        for B in batch_sizes:
            for q, tree in shapes:
                for nb in self._block_buckets[:max_block_buckets]:
                    key = (bucket(B, BATCH_BUCKETS), q, nb, tuple(hidden_layers), tree)
                    if key not in self._graphs:
                        self._capture(key)
                        n += 1
        return n

    def move_kv(self, seq_ids: Sequence[int], src: Sequence[Sequence[int]], dst: Sequence[Sequence[int]]) -> None:
        """Copy the K/V at logical positions ``src[b]`` of sequence ``seq_ids[b]`` to
        ``dst[b]`` (every layer): the accepted path of a tree, into consecutive slots.
        Sources are read before any destination is written."""
        bs = self.block_size
        slots = []  # source slots, then destination slots
        for pos in (src, dst):
            for sid, ps in zip(seq_ids, pos):
                table = self.allocator.block_table(sid)
                slots += [table[p // bs] * bs + p % bs for p in ps]
        if not slots:
            return
        n = len(slots) // 2
        idx = torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)
        with torch.inference_mode():
            self.kv.index_copy_(1, idx[n:], self.kv.index_select(1, idx[:n]))

    def truncate(self, seq_id: int, length: int) -> None:
        self.allocator.truncate(seq_id, length)

    def remove(self, seq_id: int) -> None:
        self.allocator.free(seq_id)


def first_chain_tokens(cand: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """A chain's first forward from a verdict [B, 2]: the token at position ``start + a``,
    rewritten (``cand[b, a]``: the last accepted draft, or the row's last token when none was),
    then the verdict's new token (``cand[b, a + 1]``); ``cand`` [B, 1 + k+1] holds the tokens
    from position ``start`` on, ``acc`` [B] the accepted counts."""
    a = acc.view(-1, 1)
    return torch.cat([cand.gather(1, a), cand.gather(1, a + 1)], dim=1)


def _replayed(graph, B: int) -> ForwardOutput:
    """A replay of a forward's graph (its outputs: :func:`_graph_outputs`), the first ``B`` rows."""
    logits, hidden, finite, argmax = graph.replay()
    return ForwardOutput(logits=logits, hidden_states=hidden, finite=finite, argmax=argmax).take_rows(slice(B))


def _graph_outputs(logits: torch.Tensor, hidden: dict) -> tuple:
    """A graphed forward's outputs with each row's finiteness (``ForwardOutput.finite``) and
    each position's argmax (``ForwardOutput.argmax``), computed inside the graph instead of
    by eager launches after it (five, and one)."""
    return logits, hidden, ForwardOutput.finite_of(logits), logits.argmax(dim=-1)


def _tree_inputs(pos: torch.Tensor, depth: torch.Tensor, ancestors: torch.Tensor):
    """Chain positions [B, q] and the tree's depths [B, q-1] and ancestors [B, q-1, q-1]
    -> (tree positions root + depth, the tree's compact attention mask)."""
    cdepth, vis = columns_of(depth, ancestors, pos.shape[1])
    base = pos[:, :1]
    return base + cdepth, TreeMask(base[:, 0].contiguous(), vis)  # (contiguous once, not in every layer)


def _tree_invariant_inputs(pos: torch.Tensor, read: torch.Tensor, depth: torch.Tensor, ancestors: torch.Tensor):
    """Chain positions [B, q], read slots [B, Lc] and the tree -> (tree positions [B, q],
    per-query read slots [B, q, Lc]). Query ``i`` at depth ``d`` (root + d) reads the
    context and root slots at positions ``0 .. root`` and, at ``root + e`` (1 <= e <= d),
    the slot of its ancestor at depth ``e`` (itself at ``d``): the keys, in the order, of a
    decode step at its position after the path is compacted (static shapes: graph-safe)."""
    B, q = pos.shape
    Lc = read.shape[1]
    cdepth, vis = columns_of(depth, ancestors, q)  # [B, q], [B, q, q]
    base = pos[:, :1]
    ar = torch.arange(q, device=pos.device)
    # column of query i's ancestor at depth e: [B, q (i), q (e)] (0 where none: the root)
    at = vis.unsqueeze(2) & (cdepth.view(B, 1, 1, q) == ar.view(1, 1, q, 1))  # [B, i, e, c]
    col = (at.to(torch.int64) * ar.view(1, 1, 1, q)).sum(-1)
    j = torch.arange(Lc, device=pos.device)  # logical positions
    rel = j.view(1, Lc) - base  # [B, Lc]
    e = rel.clamp(0, q - 1).unsqueeze(1).expand(B, q, Lc)
    idx = torch.where(rel.unsqueeze(1) > 0, base.unsqueeze(-1) + col.gather(2, e), j)
    return base + cdepth, read.gather(1, idx.clamp(0, Lc - 1).reshape(B, q * Lc)).view(B, q, Lc)
