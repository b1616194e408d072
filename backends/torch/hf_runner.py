"""Runs any transformers causal LM as a :class:`~speculum.interfaces.ModelRunner`.

All running sequences share one batched KV cache whose time axis is a list of *columns*.
Each step appends ``q`` columns for every row; a row's valid columns are tracked in a mask
and its logical positions are passed explicitly as ``position_ids``. Rolling a sequence
back just marks its newest columns invalid (no copy); the attention mask hides them.
When invalid columns pile up, the cache is compacted. This works for every model that
accepts a 2D attention mask and position ids, which is why it is the generic fallback.

Token trees: the verify forward passes a 4D mask (each node sees the context, the root
and its ancestors) and depth-based position ids; accepting a path relabels the columns'
positions (:meth:`HFRunner.move_kv`), no K/V is copied.
"""

from __future__ import annotations

import inspect
import logging
from typing import Sequence

import torch

from speculum.backends.torch.native.attention import no_cudnn_attention
from speculum.interfaces import ForwardOutput
from speculum.kv import SimpleKVAllocator
from speculum.tree import TokenTree, column_tree

log = logging.getLogger(__name__)


class HFRunner:
    """A transformers model plus a batched, roll-back-able KV cache."""

    #: verifies token trees (``forward(..., tree=...)`` and :meth:`move_kv`)
    supports_trees = True

    def __init__(self, model, allocator: SimpleKVAllocator | None = None, name: str = "target"):
        self.model = model.eval()
        self.name = name
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        self.hidden_size = int(getattr(cfg, "hidden_size", 0))
        self.num_layers = int(getattr(cfg, "num_hidden_layers", 0))
        self.device = next(model.parameters()).device
        self.allocator = allocator or SimpleKVAllocator(group=name)
        self.max_model_len = self.allocator.max_model_len
        self.rows: list[int] = []          # seq_id of each cache row
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer [R, H, C, D]
        self.col_pos = torch.empty(0, 0, dtype=torch.int64, device=self.device)  # [R, C], -1 = invalid
        # transformers >= 5.2x renamed ``past_key_values`` to ``cache``
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    # -- helpers ----------------------------------------------------------------------
    def _cache_from_kv(self, kv):
        from transformers import DynamicCache
        cache = DynamicCache(config=self.model.config)
        if kv is not None:
            for i, (k, v) in enumerate(kv):
                cache.update(k, v, i)
        return cache

    @staticmethod
    def _kv_from_cache(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in cache.layers]

    def _run(self, input_ids, position_ids, col_pos_new, kv, col_pos_old, hidden_layers=(), logits_to_keep=0,
             new_vis: torch.Tensor | None = None):
        """Forward ``input_ids`` [R, q] on top of ``kv``; returns (output, new kv, col_pos).

        ``new_vis`` [R, q, q] bool: which new columns each new column sees (a tree); None =
        causal. Old columns are seen where valid."""
        R, q = input_ids.shape
        valid_old = col_pos_old >= 0
        mask = torch.cat([valid_old, torch.ones(R, q, dtype=torch.bool, device=self.device)], dim=1)
        if new_vis is not None:  # 4D [R, 1, q, C + q], additive (0 = attend)
            seen = torch.cat([valid_old.unsqueeze(1).expand(R, q, -1), new_vis], dim=2).unsqueeze(1)
            dtype = self.model.dtype
            mask = torch.zeros(seen.shape, dtype=dtype, device=self.device).masked_fill(~seen, torch.finfo(dtype).min)
        C = col_pos_old.shape[1]
        cache = self._cache_from_kv(kv)
        # (cuDNN's attention plans per shape, and here every step's context is a new one)
        with torch.inference_mode(), no_cudnn_attention(self.device):
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=mask if new_vis is not None else mask.to(torch.int64),
                **{self._cache_kw: cache},
                use_cache=True,
                cache_position=torch.arange(C, C + q, device=self.device),
                output_hidden_states=bool(hidden_layers),
                logits_to_keep=logits_to_keep,
            )
        new_kv = self._kv_from_cache(cache)  # the model updated our cache object in place
        return out, new_kv, torch.cat([col_pos_old, col_pos_new], dim=1)

    def _row(self, seq_id: int) -> int:
        try:
            return self.rows.index(seq_id)
        except ValueError:
            raise KeyError(f"{self.name} runner has no sequence {seq_id}") from None

    # -- ModelRunner ------------------------------------------------------------------
    def length(self, seq_id: int) -> int:
        return self.allocator.length(seq_id)

    def add(self, seq_id: int, token_ids: Sequence[int], hidden_layers: Sequence[int] = ()) -> dict:
        return self.add_many([seq_id], [list(token_ids)], hidden_layers)[seq_id]

    def add_many(self, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]],
                 hidden_layers: Sequence[int] = (), logits_sink=None) -> dict[int, dict[int, torch.Tensor]]:
        """Prefill several new sequences in one batched forward (right padded).

        Returns ``{seq_id: {layer: [len(prompt), H]}}`` for the requested hidden layers.
        ``logits_sink(seq_id, start, logits [n, V])``, when given, receives the logits of
        every prefilled position (prompt logprobs).
        """
        hidden_layers = tuple(hidden_layers)
        hidden = {sid: {} for sid in seq_ids}
        for sid, toks in zip(seq_ids, prompts):
            if sid in self.rows:
                raise ValueError(f"sequence {sid} already in the {self.name} runner")
            self.allocator.allocate(sid, len(toks))
        P = max((len(t) for t in prompts), default=0)
        n = len(seq_ids)
        if P == 0:
            new_kv, new_pos = None, torch.full((n, 0), -1, dtype=torch.int64, device=self.device)
            empty = torch.empty(0, self.hidden_size, dtype=self.model.dtype, device=self.device)
            hidden = {sid: {layer: empty for layer in hidden_layers} for sid in seq_ids}
        else:
            ids = torch.zeros(n, P, dtype=torch.int64, device=self.device)
            pos = torch.arange(P, device=self.device).expand(n, P).clone()
            lens = torch.tensor([len(t) for t in prompts], device=self.device)
            for i, t in enumerate(prompts):
                if t:
                    ids[i, : len(t)] = torch.tensor(t, dtype=torch.int64)
            new_pos = torch.where(pos < lens.view(n, 1), pos, torch.full_like(pos, -1))
            empty = torch.full((n, 0), -1, dtype=torch.int64, device=self.device)
            out, new_kv, new_pos = self._run(ids, pos, new_pos, None, empty, hidden_layers,
                                             logits_to_keep=0 if logits_sink is not None else 1)
            if logits_sink is not None:
                for i, (sid, t) in enumerate(zip(seq_ids, prompts)):
                    logits_sink(sid, 0, out.logits[i, : len(t)].float())
            for layer in hidden_layers:
                h = self._hidden(out, layer)
                for i, (sid, t) in enumerate(zip(seq_ids, prompts)):
                    hidden[sid][layer] = h[i, : len(t)]
        self._append_rows(list(seq_ids), new_kv, new_pos)
        return hidden

    def _hidden(self, out, layer: int) -> torch.Tensor:
        """Hidden state ``layer`` in the native runner's numbering from transformers' tuple.

        transformers returns (embeddings, output of layer 0, ..., output of layer L-2,
        final normed state): layer ``i`` is entry ``i + 1`` and ``-1`` the last entry.
        """
        last = len(out.hidden_states) - 2  # the layer whose pre-norm output is not returned
        if layer == -1:
            return out.hidden_states[-1]
        if not 0 <= layer < last:
            raise ValueError(f"{self.name} runner (transformers) returns hidden layers 0..{last - 1} "
                             f"and -1 (final normed state), not {layer}")
        return out.hidden_states[layer + 1]

    def _append_rows(self, seq_ids, new_kv, new_pos) -> None:
        """Stack new rows under the running ones, padding the shorter time axis."""
        C_old, C_new = self.col_pos.shape[1], new_pos.shape[1]
        C = max(C_old, C_new)
        if self.kv is not None or new_kv is not None:
            ref = (new_kv or self.kv)
            n_layers = len(ref)

            def padded(kv, rows, cols):  # [rows, H, C, D] per layer; absent = zeros
                if kv is None:
                    z = [ref[i][0].new_zeros(rows, ref[i][0].shape[1], C, ref[i][0].shape[3]) for i in range(n_layers)]
                    return [(t, t) for t in z]
                f = torch.nn.functional.pad
                return [(f(k, (0, 0, 0, C - cols)), f(v, (0, 0, 0, C - cols))) for k, v in kv]

            old = padded(self.kv, len(self.rows), C_old)
            new = padded(new_kv, len(seq_ids), C_new)
            self.kv = [(torch.cat([ko, kn]), torch.cat([vo, vn])) for (ko, vo), (kn, vn) in zip(old, new)]
        pad = torch.nn.functional.pad
        self.col_pos = torch.cat([pad(self.col_pos, (0, C - C_old), value=-1), pad(new_pos, (0, C - C_new), value=-1)])
        self.rows += list(seq_ids)

    def forward(self, seq_ids: Sequence[int], token_ids: torch.Tensor, num_tokens: Sequence[int],
                hidden_layers: Sequence[int] = (), tree: TokenTree | None = None) -> ForwardOutput:
        """Append ``token_ids`` [B, q] (first ``num_tokens[b]`` valid) for each listed sequence.

        Every running sequence must be listed (rows not listed would need padding work
        and are an error). Returns logits [B, q, V] in the order of ``seq_ids``. ``tree``:
        column 0 is the root, column ``c`` tree node ``c - 1`` (see the module doc).
        """
        B, q = token_ids.shape
        if sorted(seq_ids) != sorted(self.rows):
            raise ValueError(f"{self.name} runner: forward must cover every running sequence")
        order = [self._row(s) for s in seq_ids]
        R = len(self.rows)
        ids = torch.zeros(R, q, dtype=torch.int64, device=self.device)
        n = torch.zeros(R, dtype=torch.int64, device=self.device)
        idx = torch.tensor(order, device=self.device)
        ids[idx] = token_ids.to(self.device).clamp_min(0)
        n[idx] = torch.tensor(list(num_tokens), dtype=torch.int64, device=self.device)
        for s, cnt in zip(seq_ids, num_tokens):
            self.allocator.allocate(s, int(cnt))
        lengths = torch.tensor([self.allocator.length(s) for s in self.rows], device=self.device) - n
        ar = torch.arange(q, device=self.device).view(1, q)
        pos = lengths.view(R, 1) + ar
        new_pos = torch.where(ar < n.view(R, 1), pos, torch.full_like(pos, -1))
        vis = None
        if tree is not None:  # tree positions (root + depth) and visibility, in cache-row order
            depth, seen = column_tree(tree, q)
            col_depth = torch.zeros(R, q, dtype=torch.int64, device=self.device)
            col_depth[idx] = depth.to(self.device)
            vis = (ar.view(q, 1) >= ar).expand(R, q, q).clone()
            vis[idx] = seen.to(self.device)
            pos = lengths.view(R, 1) + col_depth
        out, self.kv, self.col_pos = self._run(ids, pos, new_pos, self.kv, self.col_pos, hidden_layers, new_vis=vis)
        logits = out.logits.float()[idx]
        hidden = {}
        if hidden_layers:
            for layer in hidden_layers:
                hidden[layer] = self._hidden(out, layer)[idx]
        self._maybe_compact()
        return ForwardOutput(logits=logits, hidden_states=hidden)

    def move_kv(self, seq_ids: Sequence[int], src: Sequence[Sequence[int]], dst: Sequence[Sequence[int]]) -> None:
        """Let the K/V at logical positions ``src[b]`` stand for positions ``dst[b]`` (the
        accepted path of a tree): a relabelling of cache columns, nothing is copied."""
        for sid, a, b in zip(seq_ids, src, dst):
            if not a:
                continue
            r = self._row(sid)
            row = self.col_pos[r]
            s_t = torch.tensor(list(a), device=self.device)
            d_t = torch.tensor(list(b), device=self.device)
            src_cols = (row.view(-1, 1) == s_t.view(1, -1)).int().argmax(0)  # column holding each source
            dst_hit = (row.view(-1, 1) == d_t.view(1, -1)).any(1)  # columns holding a destination now
            row = torch.where(dst_hit, torch.full_like(row, -1), row)
            row[src_cols] = d_t
            self.col_pos[r] = row

    def truncate(self, seq_id: int, length: int) -> None:
        r = self._row(seq_id)
        self.allocator.truncate(seq_id, length)
        row = self.col_pos[r]
        self.col_pos[r] = torch.where(row >= length, torch.full_like(row, -1), row)

    def remove(self, seq_id: int) -> None:
        r = self._row(seq_id)
        self.allocator.free(seq_id)
        keep = [i for i in range(len(self.rows)) if i != r]
        self.rows.pop(r)
        if not self.rows:
            self.kv, self.col_pos = None, self.col_pos.new_empty(0, 0)
            return
        idx = torch.tensor(keep, device=self.device)
        if self.kv is not None:
            self.kv = [(k[idx], v[idx]) for k, v in self.kv]
        self.col_pos = self.col_pos[idx]
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        """Drop invalid columns once they are most of the cache."""
        if self.kv is None or self.col_pos.numel() == 0:
            return
        valid = self.col_pos >= 0
        counts = valid.sum(dim=1)
        C, need = self.col_pos.shape[1], int(counts.max())
        if C - need < max(32, need // 2):
            return
        R = len(self.rows)
        # stable order of valid columns first, by position
        key = torch.where(valid, self.col_pos, torch.full_like(self.col_pos, 1 << 40))
        order = key.argsort(dim=1, stable=True)[:, :need]  # [R, need]
        new_pos = self.col_pos.gather(1, order)
        g = order.view(R, 1, need, 1)
        self.kv = [(k.gather(2, g.expand(R, k.shape[1], need, k.shape[3])),
                    v.gather(2, g.expand(R, v.shape[1], need, v.shape[3]))) for k, v in self.kv]
        self.col_pos = new_pos
