"""Medusa-1 heads (Cai et al. 2024): parallel heads over the target's last hidden state.

Head ``i`` is ``medusa_num_layers`` residual blocks ``x + SiLU(Linear(x))`` followed by
an LM head (its own, or the target's when shared). Given the target's final normed state
``h_t`` (which the target's own head maps to ``x_{t+1}``), head ``i`` predicts
``x_{t+i+2}``: drafts 1..k come from heads 0..k-1 of one state, with no draft loop.

Token-aware heads (``token_input``, speculum's extension; off in Medusa's own checkpoints):
the token ``x_{t+1}`` is known when the heads run (it is the sequence's last token: the
target produced it from ``h_t``), but a Medusa-1 head predicts ``x_{t+2}`` without seeing
it. With ``token_input`` every head reads ``h_t + P e(x_{t+1})`` instead of ``h_t``, where
``e`` is the target's input embedding (shared, not saved) and ``P`` one ``H x H`` map shared
by the heads, zero-initialised: grown from a Medusa-1 checkpoint, the heads start out
drafting exactly as it did. Still one state and no draft loop (EAGLE feeds the same token
to an autoregressive head).

Sequentially dependent heads (``sequential``, speculum's extension after Hydra, Ankner et
al. 2024): token-aware heads where head ``i`` also reads the tokens drafted before it,
``z_i = z_{i-1} + Q_i e(x_{t+i+1})`` from ``z_0 = h_t + P e(x_{t+1})``, with one ``H x H``
map ``Q_j`` per offset ``j`` (shared by the heads, zero-initialised: grown from token-aware
heads they draft exactly as those). A Medusa-1 head ``i`` must guess the ``i`` tokens
between ``x_{t+1}`` and its own; a sequential one is told the drafted ones, which are the
true ones whenever its draft can be accepted. Drafting is then a loop over the heads
(each adds one map to the previous head's features), still one state and no KV cache.

A prefix layer (``prefix``, speculum's extension after Hydra++'s prefix attention, Ankner et
al. 2024): one Llama decoder layer over the heads' features of every position, causal, with
a KV cache of its own, so head 0 reads ``z_t``, the layer's output at ``t``, which attends over
the whole sequence, instead of the one state ``h_t`` (with token-aware features it relates
``x_{t+1}`` to the context, as an EAGLE head's layer does). Its attention and MLP output
projections start at zero: grown onto trained heads, it passes the features through and they
draft exactly as before until trained. The KV cache holds only true positions (a position
enters once its next token is known), so rejected drafts never touch it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from speculum.backends.torch.heads import HeadDecoderLayer, LlamaArch, Rope, TrainContext, grow_layers


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
                 lm_head: torch.Tensor | None = None, embed: torch.Tensor | None = None,
                 sequential: bool = False, prefix: LlamaArch | None = None):
        """``embed`` given: token-aware heads (the module doc) over the target's [V, H]
        input embedding (a plain attribute, not saved); ``sequential``: heads that also read
        the tokens drafted before them (needs ``embed``); ``prefix``: the shape of a prefix
        layer (the target's), which then starts as the identity."""
        super().__init__()
        self.hidden_size, self.vocab_size = hidden, vocab
        self.num_heads, self.num_layers = num_heads, num_layers
        self.blocks = nn.ModuleList(nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)])
                                    for _ in range(num_heads))
        self.shared_lm_head = lm_head  # plain attribute: the target's tensor
        self.heads = None if lm_head is not None else nn.ModuleList(
            nn.Linear(hidden, vocab, bias=False) for _ in range(num_heads))
        self.embed = embed
        self.token_proj = None
        if embed is not None:
            self.token_proj = nn.Linear(hidden, hidden, bias=False)
            nn.init.zeros_(self.token_proj.weight)
        if sequential and embed is None:
            raise ValueError("sequential Medusa heads read the target's embedding: give embed")
        #: map j (offset j + 1): the token drafted j + 1 places after x_{t+1}, read by heads j + 1 ...
        self.seq_proj = nn.ModuleList(nn.Linear(hidden, hidden, bias=False)
                                      for _ in range(num_heads - 1)) if sequential else None
        for lin in self.seq_proj or ():
            nn.init.zeros_(lin.weight)
        #: the prefix layer (None: the heads read one state); its shape for a KV cache
        self.prefix, self.prefix_arch = None, prefix
        if prefix is not None:
            if prefix.hidden_size != hidden:
                raise ValueError(f"a prefix layer of width {prefix.hidden_size} over heads of width {hidden}")
            self.prefix = nn.ModuleList([HeadDecoderLayer(prefix, index=0, input_norm=True, bias=prefix.qkv_bias)])
            grow_layers(self.prefix, [])  # the identity until trained
            self.rope = Rope(prefix)

    @property
    def sequential(self) -> bool:
        return self.seq_proj is not None

    @property
    def token_input(self) -> bool:
        return self.token_proj is not None

    @property
    def prefixed(self) -> bool:
        return self.prefix is not None

    def prefix_forward(self, f: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """The prefix layer's outputs ``z`` [B, q, H] from :meth:`features` ``f`` [B, q, H] at
        ``positions`` [B, q], attending through ``ctx`` (a head cache's context, or a
        :class:`~speculum.backends.torch.heads.TrainContext`): what the heads then read."""
        layer = self.prefix[0]
        x = f.to(layer.mlp_norm.weight.dtype)
        cos, sin = self.rope(positions, x.dtype)
        return layer(x, cos, sin, ctx)

    def sequence_features(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """What head 0 reads [B, T, H] at every position of whole sequences: :meth:`features` of
        the final normed target states ``h`` [B, T, H] and the tokens they produced ``tokens``
        [B, T], through the prefix layer if there is one (causal over each sequence: what its
        cache gives when drafting). Training and ``scripts/medusa_tree.py`` read the heads so."""
        x = self.features(h, tokens)
        if self.prefix is None:
            return x
        ctx = TrainContext()
        ctx.next_step()
        T = x.shape[1]
        return self.prefix_forward(x, torch.arange(T, device=x.device).expand(x.shape[0], T), ctx)

    @property
    def draft_reads_token(self) -> bool:
        """Whether drafting reads each row's last token (token-aware heads without a prefix
        layer; with one, the token went into the layer's input)."""
        return self.token_input and self.prefix is None

    def draft_input(self, x: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
        """What drafting reads from a row's state ``x`` [..., H]: :meth:`features` of the target
        state and its token, or, with a prefix layer, ``x`` itself (its output ``z``, which read
        the features already)."""
        return x if self.prefix is not None else self.features(x, tokens)

    def features(self, h: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
        """What the heads read [..., H] from final normed target states ``h`` [..., H] and the
        tokens they produced ``tokens`` [...] (``x_{t+1}``; ignored by Medusa-1 heads)."""
        if self.token_proj is None:
            return h
        w = self.token_proj.weight
        return h.to(w.dtype) + self.token_proj(self.embed[tokens].to(w.dtype))

    def advance(self, i: int, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Head ``i + 1``'s features from head ``i``'s ``x`` [..., H] and the tokens head ``i``
        drafted ``tokens`` [...]: ``x`` itself unless the heads are sequential."""
        if self.seq_proj is None:
            return x
        lin = self.seq_proj[i]
        return x + lin(self.embed[tokens].to(lin.weight.dtype))

    def teacher_forced(self, x: torch.Tensor, tokens: torch.Tensor, n: int):
        """Heads ``0..n-1``'s features, in order, at every position of ``x`` [..., T, H]
        (:meth:`features` of the states and ``tokens`` [..., T], the token each state produced)
        when the tokens drafted before each head are the true ones, the following entries of
        ``tokens`` (past the end: token 0, at positions that have no target either). Each head's
        features are the previous head's advanced by one token, as when drafting."""
        for i in range(n):
            if i:
                x = self.advance(i - 1, x, F.pad(tokens, (0, i))[..., i:])
            yield x

    def logits(self, i: int, h: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """Head ``i``'s logits [..., V] from :meth:`features` [..., H] (for Medusa-1 heads the
        final normed target states themselves; only the rows ``vocab`` of its LM head if given)."""
        x = self.blocks[i](h.to(self.blocks[i][0].linear.weight.dtype))
        w = self.heads[i].weight if self.heads is not None else self.shared_lm_head
        w = w if vocab is None else w[vocab]
        return F.linear(x.to(w.dtype), w).float()
