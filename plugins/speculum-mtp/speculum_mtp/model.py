"""A DeepSeek-V3-style multi-token-prediction (MTP) module as a :class:`ChainHead`.

At position ``t`` the module reads the target's hidden state ``h_t`` (its final normed
state) and the next token ``x_{t+1}``:
``x = eh_proj([enorm(embed(x_{t+1})); hnorm(h_t)])`` (2H -> H; the order is an option,
embedding first as in DeepSeek-V3's weights, hidden first as in its paper's equation),
then one Llama decoder layer (DeepSeek-V3's module; ``arch.num_layers`` above 1 stacks more,
a speculum extension: :mod:`speculum_mtp.formats`), then the shared head ``head(norm(out))``
predicts ``x_{t+2}``. For k > 1 the module is reused autoregressively: its output hidden state
is the next step's ``h``. Embedding and output head are the target's unless the checkpoint has
its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from speculum.backends.torch.heads import HeadDecoderLayer, LlamaArch, RMSNorm, Rope

ORDERS = ("embed_hidden", "hidden_embed")


class MTPHead(nn.Module):
    def __init__(self, arch: LlamaArch, embed: torch.Tensor, lm_head: torch.Tensor | None,
                 concat_order: str = "embed_hidden"):
        super().__init__()
        if concat_order not in ORDERS:
            raise ValueError(f"concat_order must be one of {ORDERS}, got {concat_order!r}")
        H = arch.hidden_size
        self.arch = arch
        self.concat_order = concat_order
        self.enorm = RMSNorm(H, arch.rms_eps)
        self.hnorm = RMSNorm(H, arch.rms_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList(HeadDecoderLayer(arch, index=i, input_norm=True, bias=arch.qkv_bias)
                                    for i in range(arch.num_layers))
        self.head_norm = RMSNorm(H, arch.rms_eps)  # shared_head.norm
        self.rope = Rope(arch)
        self.own_head = nn.Linear(H, arch.vocab_size, bias=False) if lm_head is None else None
        self.embed_weight = embed       # shared with the target (plain attributes)
        self.lm_head_weight = lm_head
        self.num_layers, self.num_kv_heads, self.head_dim = arch.num_layers, arch.num_kv_heads, arch.head_dim

    def features(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        return hidden[-1]

    def forward(self, feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        dt = self.eh_proj.weight.dtype
        e = self.enorm(F.embedding(tokens, self.embed_weight).to(dt))
        h = self.hnorm(feats.to(dt))
        x = self.eh_proj(torch.cat([e, h] if self.concat_order == "embed_hidden" else [h, e], dim=-1))
        cos, sin = self.rope(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        return x

    def logits(self, out: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """``head(norm(out))`` (only the rows ``vocab`` of the head if given)."""
        x = self.head_norm(out)
        w = self.own_head.weight if self.own_head is not None else self.lm_head_weight
        w = w if vocab is None else w[vocab]
        return F.linear(x.to(w.dtype), w).float()
