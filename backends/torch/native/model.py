"""A native Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) over paged KV.

Static shapes throughout, so a forward can be captured as a CUDA graph: inputs are
``[B, q]`` token ids and positions, ``[B, q]`` KV write slots, and ``[B, Lc]`` KV read
slots (the context gathered through each sequence's block table). Shapes:
``B`` batch, ``q`` query tokens per row, ``Lc`` context slots per row, ``H`` hidden size,
``Hq``/``Hkv`` query/KV heads, ``D`` head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from speculum.backends.torch.native.arch import LlamaArch


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(arch: LlamaArch) -> torch.Tensor:
    """[D/2] inverse frequencies, with Llama-3 scaling when the config asks for it."""
    d = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = arch.rope_scaling
    if sc and sc.get("rope_type", sc.get("type")) == "llama3":
        factor, lo, hi = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
        old = sc.get("original_max_position_embeddings", 8192)
        lo_wl, hi_wl = old / lo, old / hi
        wl = 2 * math.pi / inv
        scaled = torch.where(wl > lo_wl, inv / factor, inv)
        smooth = (old / wl - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wl < hi_wl) & ~(wl > lo_wl)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, arch: LlamaArch, qkv_bias: bool, o_bias: bool):
        super().__init__()
        self.nq, self.nkv, self.d = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.qkv = nn.Linear(arch.hidden_size, (self.nq + 2 * self.nkv) * self.d, bias=qkv_bias)
        self.o = nn.Linear(self.nq * self.d, arch.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.d, arch.rms_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.d, arch.rms_eps) if arch.qk_norm else None
        self.scale = self.d ** -0.5

    def forward(self, x, cos, sin, write_slots, read_slots, mask, k_pool, v_pool):
        B, q, _ = x.shape
        qkv = self.qkv(x)
        qh, kh, vh = qkv.split([self.nq * self.d, self.nkv * self.d, self.nkv * self.d], dim=-1)
        qh = qh.view(B, q, self.nq, self.d)
        kh = kh.view(B, q, self.nkv, self.d)
        vh = vh.view(B, q, self.nkv, self.d)
        if self.q_norm is not None:
            qh, kh = self.q_norm(qh), self.k_norm(kh)
        # cos/sin: [B, q, 1, D]
        qh = qh * cos + rotate_half(qh) * sin
        kh = kh * cos + rotate_half(kh) * sin
        # write this step's K/V into the paged pools, then read the whole context
        k_pool.index_copy_(0, write_slots.reshape(-1), kh.reshape(B * q, self.nkv, self.d))
        v_pool.index_copy_(0, write_slots.reshape(-1), vh.reshape(B * q, self.nkv, self.d))
        kc = k_pool[read_slots].transpose(1, 2)  # [B, Hkv, Lc, D]
        vc = v_pool[read_slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(qh.transpose(1, 2), kc, vc, attn_mask=mask, scale=self.scale,
                                             enable_gqa=self.nq != self.nkv)
        return self.o(out.transpose(1, 2).reshape(B, q, self.nq * self.d))


class MLP(nn.Module):
    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.inter = arch.intermediate_size
        self.gate_up = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x):
        g, u = self.gate_up(x).split(self.inter, dim=-1)
        return self.down(F.silu(g) * u)


class Block(nn.Module):
    def __init__(self, arch: LlamaArch, qkv_bias: bool, o_bias: bool):
        super().__init__()
        self.attn_norm = RMSNorm(arch.hidden_size, arch.rms_eps)
        self.attn = Attention(arch, qkv_bias, o_bias)
        self.mlp_norm = RMSNorm(arch.hidden_size, arch.rms_eps)
        self.mlp = MLP(arch)

    def forward(self, h, cos, sin, write_slots, read_slots, mask, k_pool, v_pool):
        h = h + self.attn(self.attn_norm(h), cos, sin, write_slots, read_slots, mask, k_pool, v_pool)
        return h + self.mlp(self.mlp_norm(h))


class NativeLlama(nn.Module):
    """The decoder stack; K/V pools are passed in (the runner owns them)."""

    def __init__(self, arch: LlamaArch, qkv_bias: bool = False, o_bias: bool = False):
        super().__init__()
        self.arch = arch
        self.embed = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(Block(arch, qkv_bias, o_bias) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(arch), persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [B, q, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype).unsqueeze(2), emb.sin().to(dtype).unsqueeze(2)

    def forward(self, input_ids, positions, write_slots, read_slots, pools, hidden_layers=(),
                compute_logits: bool = True):
        """Returns (logits [B, q, V] float32 or None, {layer: hidden [B, q, H]}).

        Hidden layer ``i`` is the output of decoder layer ``i`` (0-based); ``-1`` is the
        final normed hidden state fed to the LM head.
        """
        h = self.embed(input_ids)
        cos, sin = self.rope(positions, h.dtype)
        Lc = read_slots.shape[1]
        # [B, 1, q, Lc]: key position j is visible to a query at position p iff j <= p
        mask = (torch.arange(Lc, device=h.device).view(1, 1, 1, Lc) <= positions.unsqueeze(1).unsqueeze(-1))
        hidden = {}
        for i, layer in enumerate(self.layers):
            k_pool, v_pool = pools[i]
            h = layer(h, cos, sin, write_slots, read_slots, mask, k_pool, v_pool)
            if i in hidden_layers:
                hidden[i] = h
        h = self.norm(h)
        if -1 in hidden_layers:
            hidden[-1] = h
        logits = self.lm_head(h).float() if compute_logits else None
        return logits, hidden
