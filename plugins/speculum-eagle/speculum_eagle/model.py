"""EAGLE-1 and EAGLE-3 draft heads (Li et al. 2024, 2025) as :class:`ChainHead` modules.

EAGLE-1: ``h = fc([embed(x_{t+1}); f_t])`` (2H -> H, with bias), then Llama decoder
layer(s) whose first has no input norm; the output is a predicted *normed* target
feature, so the target's own LM head turns it into logits. Feature ``f_t`` is the
target's final normed hidden state (layer ``-1``).

EAGLE-3: the feature fuses three target layers, ``g_t = fc([h_low; h_mid; h_high])``
(3H -> H, no bias). The decoder layer attends over ``[input_norm(embed(x_{t+1}));
hidden_norm(g_t)]`` (2H wide) with ``g_t`` as the residual; ``lm_head(norm(out))`` gives
logits over a reduced draft vocabulary, mapped to target ids by ``d2t`` (target id =
draft id + d2t[draft id]). While drafting, the output (pre-norm) is the next feature.
With the target's tail (:meth:`Eagle3Head.use_target_tail`) the head drafts every target
token: the draft vocabulary from its own LM head, every other token through the target's
(shared, not stored with the head) after a learned ``H x H`` map of the head's normed
output (``tail_map``: the head's own rows drift from the target's as it trains, so its output
no longer lives where the target's LM head reads).

The embedding (and EAGLE-1's LM head) are the target's tensors, shared, not copied,
unless a checkpoint brings its own ``embed_tokens.weight``.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from speculum.backends.torch.heads import HeadDecoderLayer, LlamaArch, RMSNorm, Rope


class Eagle1Head(nn.Module):
    """EAGLE-1: fc over [embedding; feature] -> decoder layer(s); shared LM head."""

    def __init__(self, arch: LlamaArch, embed: torch.Tensor, lm_head: torch.Tensor, fc_bias: bool = True):
        super().__init__()
        H = arch.hidden_size
        self.arch = arch
        self.fc = nn.Linear(2 * H, H, bias=fc_bias)
        self.layers = nn.ModuleList(HeadDecoderLayer(arch, index=i, input_norm=i > 0, bias=arch.qkv_bias)
                                    for i in range(arch.num_layers))
        self.rope = Rope(arch)
        # shared with the target: plain attributes, so not parameters, never saved or cast
        self.embed_weight = embed
        self.lm_head_weight = lm_head
        self.num_layers, self.num_kv_heads, self.head_dim = arch.num_layers, arch.num_kv_heads, arch.head_dim

    def features(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        return hidden[-1]

    def forward(self, feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        e = F.embedding(tokens, self.embed_weight).to(self.fc.weight.dtype)
        h = self.fc(torch.cat([e, feats.to(e.dtype)], dim=-1))
        cos, sin = self.rope(positions, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, ctx)
        return h

    def logits(self, out: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """Logits through the target's LM head (only the rows ``vocab`` if given)."""
        w = self.lm_head_weight if vocab is None else self.lm_head_weight[vocab]
        return F.linear(out.to(w.dtype), w).float()


class Eagle3Head(nn.Module):
    """EAGLE-3: fused low/mid/high features, 2H-wide attention input, own draft vocabulary."""

    def __init__(self, arch: LlamaArch, embed: torch.Tensor, target_hidden: int, draft_vocab: int,
                 feature_layers: Sequence[int]):
        super().__init__()
        H = arch.hidden_size
        self.arch = arch
        self.feature_layers = tuple(feature_layers)  # target hidden layers (our numbering)
        self.fc = nn.Linear(len(self.feature_layers) * target_hidden, H, bias=False)
        self.layer = HeadDecoderLayer(arch, index=0, in_dim=2 * H, input_norm=True, bias=arch.qkv_bias)
        self.hidden_norm = RMSNorm(H, arch.rms_eps)
        self.norm = RMSNorm(H, arch.rms_eps)
        self.lm_head = nn.Linear(H, draft_vocab, bias=False)
        self.rope = Rope(arch)
        self.vocab_size = arch.vocab_size
        # target id = draft id + d2t[draft id]; t2d marks target ids in the draft vocabulary
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(arch.vocab_size, dtype=torch.bool))
        self.embed_weight = embed
        self.num_layers, self.num_kv_heads, self.head_dim = 1, arch.num_kv_heads, arch.head_dim
        #: the target's LM head [V, H] for the tokens outside the draft vocabulary (a plain
        #: tensor shared with the target, neither a parameter nor saved); None: only the draft vocabulary
        self.tail: torch.Tensor | None = None
        #: the map of the normed output into the target's LM head space (saved as tail_map.weight)
        self.tail_map: nn.Linear | None = None
        #: for inference (:meth:`fold_tail`): [V, H], the tail read through the map with the own
        #: rows in place, so a draft step is one product (not saved; moves with the head)
        self.register_buffer("folded", None, persistent=False)

    def use_target_tail(self, lm_head: torch.Tensor) -> None:
        """Draft every target token: logits over the whole target vocabulary (target ids in
        order), the draft vocabulary's rows from the head's own LM head and every other row
        from ``lm_head`` (the target's, [V, H]) applied to ``tail_map`` of the normed output.
        The map starts as the identity (a fresh head's rows are the target's); :meth:`fit_tail_map`
        fits it to a trained head's rows."""
        if lm_head.shape[0] != self.vocab_size:
            raise ValueError(f"the target's LM head has {lm_head.shape[0]} rows, the head's vocabulary {self.vocab_size}")
        self.tail, self.folded = lm_head, None
        if self.tail_map is None:
            H = self.norm.weight.shape[0]
            w = self.lm_head.weight
            self.tail_map = nn.Linear(H, H, bias=False).to(device=w.device, dtype=w.dtype)
            with torch.no_grad():
                self.tail_map.weight.copy_(torch.eye(H))

    @torch.no_grad()
    def fit_tail_map(self, ridge: float = 1e-2) -> None:
        """Fit the map so the target's rows of the draft vocabulary, read through it, give
        the head's own rows (least squares, ``Rh ~ Rt A``): a head trained without the tail
        then scores the other tokens as its own rows would have been, before any training
        (the shipped EAGLE-3 head's first-draft agreement along the target's answers rose from
        0.774 to 0.793: ``scripts/eagle3_tail_check.py``)."""
        rt = self.tail[self.own_ids].double().cpu()  # [Vd, H]
        rh = self.lm_head.weight.double().cpu()
        a = torch.linalg.solve(rt.T @ rt + ridge * torch.eye(rt.shape[1], dtype=rt.dtype), rt.T @ rh)
        self.tail_map.weight.copy_(a.to(self.tail_map.weight))  # own logits x Rh^T ~ x A^T Rt^T = tail_map(x) Rt^T
        self.folded = None

    def drop_tail(self) -> None:
        """Draft from the own draft vocabulary only (a head trained with the tail, read as a
        plain EAGLE-3 head)."""
        self.tail, self.tail_map, self.folded = None, None, None

    @torch.no_grad()
    def fold_tail(self) -> None:
        """For inference with the target's tail: fold ``tail_map`` into the target's rows and put
        the head's own rows in place, one [V, H] matrix, so each draft step is one product
        (on the H200 the unfolded step, five extra kernels a draft, cost the chain 0.16 of a
        plain decoding step). Training (``train()``) drops it; no-op without the tail."""
        if self.tail is None:
            return
        w = self.tail.float() @ self.tail_map.weight.float()
        w[self.own_ids] = self.lm_head.weight.float()
        self.folded = w.to(self.lm_head.weight.dtype)

    def train(self, mode: bool = True):
        if mode:
            self.folded = None  # the weights are about to change
        return super().train(mode)

    @property
    def own_ids(self) -> torch.Tensor:
        """[Vd] target id of each row of the head's own LM head (the draft vocabulary)."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[Vd] target id of each draft id ([V], the identity, with the target's tail)."""
        if self.tail is not None:
            return torch.arange(self.vocab_size, device=self.d2t.device)
        return self.own_ids

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Target ids of the draft ids ``ids``: ``draft_to_target[ids]`` without building
        the map (with the target's tail, ``ids`` themselves)."""
        return ids if self.tail is not None else ids + self.d2t[ids]

    def set_vocab(self, draft_ids: torch.Tensor) -> None:
        """Use the target ids ``draft_ids`` (ascending) as the draft vocabulary."""
        ids = draft_ids.to(self.d2t.device, torch.int64)
        self.d2t.copy_(ids - torch.arange(ids.shape[0], device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def features(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        x = torch.cat([hidden[i] for i in self.feature_layers], dim=-1)
        return self.fc(x.to(self.fc.weight.dtype))

    def forward(self, feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        g = feats.to(self.fc.weight.dtype)
        e = F.embedding(tokens, self.embed_weight).to(g.dtype)
        cos, sin = self.rope(positions, g.dtype)
        attn_in = torch.cat([self.layer.input_norm(e), self.hidden_norm(g)], dim=-1)
        return self.layer(g, cos, sin, ctx, attn_in=attn_in)

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """[..., Vd] logits over the draft vocabulary ([..., V] over every target id, with the
        target's tail: its LM head's logits, the draft vocabulary's replaced by the head's own)."""
        x = self.norm(out)
        if self.folded is not None:
            return F.linear(x.to(self.folded.dtype), self.folded).float()
        own = self.lm_head(x).float()
        if self.tail is None:
            return own
        full = F.linear(self.tail_map(x).to(self.tail.dtype), self.tail).float()
        return full.index_copy(-1, self.own_ids, own)

    def greedy(self, out: torch.Tensor) -> torch.Tensor:
        """Argmax target ids without the full-vocabulary scatter (``draft_to_target`` is
        ascending, so ties break as in :meth:`logits`)."""
        return self.to_target(self.draft_logits(out).argmax(dim=-1))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        d = self.draft_logits(out)
        if self.tail is not None:  # every target id already, in order
            return d
        full = d.new_full((*d.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.draft_to_target] = d
        return full
