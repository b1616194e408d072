"""Medusa-1 heads (Cai et al. 2024): parallel heads over the target's last hidden state.

Head ``i`` is ``medusa_num_layers`` residual blocks ``x + SiLU(Linear(x))`` followed by
an LM head (its own, or the target's when shared). Given the target's final normed state
``h_t`` (which the target's own head maps to ``x_{t+1}``), head ``i`` predicts
``x_{t+i+2}``: drafts 1..k come from heads 0..k-1 of one state, with no draft loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ResBlock(nn.Module):
    """``x + SiLU(W x + b)``; zero-initialised, so a fresh block is the identity."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """``num_heads`` Medusa heads; ``lm_head`` given = shared with the target (not saved)."""

    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int = 1,
                 lm_head: torch.Tensor | None = None):
        super().__init__()
        self.hidden_size, self.vocab_size = hidden, vocab
        self.num_heads, self.num_layers = num_heads, num_layers
        self.blocks = nn.ModuleList(nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)])
                                    for _ in range(num_heads))
        self.shared_lm_head = lm_head  # plain attribute: the target's tensor
        self.heads = None if lm_head is not None else nn.ModuleList(
            nn.Linear(hidden, vocab, bias=False) for _ in range(num_heads))

    def logits(self, i: int, h: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """Head ``i``'s logits [..., V] from final normed target states [..., H] (only the
        rows ``vocab`` of its LM head if given)."""
        x = self.blocks[i](h.to(self.blocks[i][0].linear.weight.dtype))
        w = self.heads[i].weight if self.heads is not None else self.shared_lm_head
        w = w if vocab is None else w[vocab]
        return F.linear(x.to(w.dtype), w).float()
