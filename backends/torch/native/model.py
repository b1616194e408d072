"""A native Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) over paged KV.

Static shapes throughout, so a forward can be captured as a CUDA graph: inputs are
``[B, q]`` token ids and positions, ``[B, q]`` KV write slots, and ``[B, Lc]`` KV read
slots (the context gathered through each sequence's block table). Shapes:
``B`` batch, ``q`` query tokens per row, ``Lc`` context slots per row, ``H`` hidden size,
``Hq``/``Hkv`` query/KV heads, ``D`` head dim.

:meth:`NativeLlama.set_batch_invariant` switches the GEMMs and the attention to the
kernels of :mod:`.invariant`, whose per-token results do not depend on the batch.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from speculum.backends.torch.native import invariant
from speculum.backends.torch.native.arch import LlamaArch
from speculum.backends.torch.native.attention import (causal_mask, fresh_attention, paged_decode_attention,
                                                      sdpa_attention, use_decode_kernel)
from speculum.backends.torch.native.gemm import GemmPlan, tuning_enabled
from speculum.backends.torch.native.kernels import add_rmsnorm, rope_write_kv, rope_write_kv_torch, silu_mul
from speculum.tree import TreeMask


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x) — or, with ``residual``, (norm(x + residual), x + residual)."""
        if residual is None:
            return add_rmsnorm(x, None, self.weight, self.eps)[0]
        return add_rmsnorm(x, residual, self.weight, self.eps)


def _linear(mod: nn.Linear, x: torch.Tensor, batch_invariant: bool, plan: GemmPlan) -> torch.Tensor:
    if batch_invariant:
        return invariant.linear(x, mod.weight, mod.bias)
    return plan.linear(x, mod.weight, mod.bias)


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


class Attention(nn.Module):
    def __init__(self, arch: LlamaArch, qkv_bias: bool, o_bias: bool, gemm: GemmPlan | None = None):
        super().__init__()
        self.nq, self.nkv, self.d = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.qkv = nn.Linear(arch.hidden_size, (self.nq + 2 * self.nkv) * self.d, bias=qkv_bias)
        self.o = nn.Linear(self.nq * self.d, arch.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.d, arch.rms_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.d, arch.rms_eps) if arch.qk_norm else None
        self.scale = self.d ** -0.5
        self.batch_invariant = False
        self.gemm = gemm if gemm is not None else GemmPlan()  # NativeLlama's: one for every layer

    def forward(self, x, cos, sin, write_slots, read_slots, mask, k_pool, v_pool, positions=None, fresh=False):
        B, q, _ = x.shape
        inv = self.batch_invariant
        qkv = _linear(self.qkv, x, inv, self.gemm)
        if self.q_norm is None:
            qh = rope_write_kv(qkv, self.nq, self.nkv, self.d, cos, sin, write_slots, k_pool, v_pool)
        else:
            qh, kh, vh = qkv.split([self.nq * self.d, self.nkv * self.d, self.nkv * self.d], dim=-1)
            qh = self.q_norm(qh.reshape(B, q, self.nq, self.d))
            kh = self.k_norm(kh.reshape(B, q, self.nkv, self.d))
            qh = rope_write_kv_torch(qh, kh, vh.reshape(B, q, self.nkv, self.d), cos, sin, write_slots,
                                     k_pool, v_pool)
        if inv:  # causal by position: the caller made sure there is no tree mask
            out = invariant.paged_attention(qh, k_pool, v_pool, read_slots, positions, self.scale)
        elif use_decode_kernel(qh, q, self.d):  # decode and verify steps on a GPU
            out = paged_decode_attention(qh, k_pool, v_pool, read_slots, positions, self.scale, mask)
        elif fresh:  # a prefill's first chunk: its own keys only
            out = fresh_attention(qh, k_pool, v_pool, write_slots, self.scale)
        else:  # CPU, prefill chunks: the forward built the mask (causal unless a tree's)
            out = sdpa_attention(qh, k_pool, v_pool, read_slots, mask, self.scale)
        return _linear(self.o, out.reshape(B, q, self.nq * self.d), inv, self.gemm)


class MLP(nn.Module):
    def __init__(self, arch: LlamaArch, gemm: GemmPlan | None = None):
        super().__init__()
        self.inter = arch.intermediate_size
        self.gate_up = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)
        self.batch_invariant = False
        self.gemm = gemm if gemm is not None else GemmPlan()  # NativeLlama's: one for every layer

    def forward(self, x):
        inv = self.batch_invariant
        return _linear(self.down, silu_mul(_linear(self.gate_up, x, inv, self.gemm), self.inter), inv, self.gemm)


class Block(nn.Module):
    def __init__(self, arch: LlamaArch, qkv_bias: bool, o_bias: bool, gemm: GemmPlan | None = None):
        super().__init__()
        self.attn_norm = RMSNorm(arch.hidden_size, arch.rms_eps)
        self.attn = Attention(arch, qkv_bias, o_bias, gemm)
        self.mlp_norm = RMSNorm(arch.hidden_size, arch.rms_eps)
        self.mlp = MLP(arch, gemm)

    def forward(self, x, residual, cos, sin, write_slots, read_slots, mask, k_pool, v_pool, positions=None,
                fresh=False):
        """``x + residual`` is the stream entering the layer (``residual`` None at layer 0).

        Returns (mlp output, residual): the layer's output stream is their sum, which the
        next layer's fused add+norm forms without a separate kernel.
        """
        if residual is None:
            normed, residual = self.attn_norm(x), x
        else:
            normed, residual = self.attn_norm(x, residual)
        a = self.attn(normed, cos, sin, write_slots, read_slots, mask, k_pool, v_pool, positions, fresh)
        normed, residual = self.mlp_norm(a, residual)
        return self.mlp(normed), residual

    def gemm_weights(self) -> list[torch.Tensor]:
        """The weights of the layer's four GEMMs (qkv, o, gate/up, down), for the GEMM plan."""
        return [self.attn.qkv.weight, self.attn.o.weight, self.mlp.gate_up.weight, self.mlp.down.weight]


class NativeLlama(nn.Module):
    """The decoder stack; K/V pools are passed in (the runner owns them)."""

    def __init__(self, arch: LlamaArch, qkv_bias: bool = False, o_bias: bool = False):
        super().__init__()
        self.arch = arch
        self.embed = nn.Embedding(arch.vocab_size, arch.hidden_size)
        #: the BLAS library of each GEMM shape, per row count (:meth:`tune_gemms`), one for every layer
        self.gemm = GemmPlan()
        self.layers = nn.ModuleList(Block(arch, qkv_bias, o_bias, self.gemm) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(arch), persistent=False)
        #: GEMMs and attention through :mod:`.invariant` (set_batch_invariant)
        self.batch_invariant = False

    def set_batch_invariant(self, on: bool = True) -> "NativeLlama":
        """Compute every token's row the same way whatever the batch (GEMMs, attention and
        the LM head through :mod:`.invariant`; RMSNorm and RoPE are row-local already)."""
        self.batch_invariant = on
        if on:  # its GEMM reads the dense weights (pack_gemms released the layers')
            self.gemm.restore()
        for layer in self.layers:
            layer.attn.batch_invariant = on
            layer.mlp.batch_invariant = on
        return self

    def tune_gemms(self, rows: int) -> None:
        """Time the GEMMs of a forward of ``rows`` token rows under each BLAS library and keep
        the fastest (:mod:`.gemm`): the runner calls it before it captures a CUDA graph. Not
        on a CPU, in batch-invariant mode (its own GEMM) or with ``SPECULUM_GEMM_TUNE=0``."""
        if self.batch_invariant or not self.lm_head.weight.is_cuda or not tuning_enabled():
            return
        self.gemm.tune(self.layers[0].gemm_weights() + [self.lm_head.weight], rows)

    def pack_gemms(self) -> int:
        """On a CPU (fp32): every GEMM's weight gets oneDNN's prepacked copy (:meth:`GemmPlan.pack`),
        which verifies a few tokens for little more than one; returns the bytes the copies
        hold (0: nothing packed, e.g. on a GPU, in another dtype or in batch-invariant mode).

        The layers' weights then give their dense storage back (:meth:`GemmPlan.release`): only
        their GEMMs read them, so the copies replace them and the model's memory does not
        double (:meth:`set_batch_invariant` brings them back). The LM head keeps its own: the
        embedding (tied weights) and the draft heads read it."""
        if self.batch_invariant:
            return 0
        layers = [w for layer in self.layers for w in layer.gemm_weights()]
        packed = self.gemm.pack(layers + [self.lm_head.weight])
        self.gemm.release(layers)
        return packed

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [B, q, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype).unsqueeze(2), emb.sin().to(dtype).unsqueeze(2)

    def forward(self, input_ids, positions, write_slots, read_slots, pools, hidden_layers=(),
                compute_logits: bool = True, mask: torch.Tensor | TreeMask | None = None, fresh: bool = False):
        """Returns (logits [B, q, V] float32 or None, {layer: hidden [B, q, H]}).

        Hidden layer ``i`` is the output of decoder layer ``i`` (0-based); ``-1`` is the
        final normed hidden state fed to the LM head. ``mask`` [B, 1, q, Lc] (bool, True =
        attend) or a compact :class:`~speculum.tree.TreeMask` (a token tree's ancestors-only
        mask) replaces the causal mask. ``fresh``:
        every row starts at position 0 with nothing in its cache before (a prefill's first
        chunk), so attention needs only the chunk's own keys (:func:`fresh_attention`).
        """
        h = self.embed(input_ids)
        cos, sin = self.rope(positions, h.dtype)
        Lc = read_slots.shape[-1]  # [B, Lc], or [B, q, Lc] per query (a batch-invariant tree)
        if self.batch_invariant and mask is not None:
            raise ValueError("batch-invariant attention is causal by position and takes no mask; a token tree "
                             "comes as per-query read slots (NativeRunner)")
        fresh = fresh and mask is None and not self.batch_invariant
        if not fresh and not self.batch_invariant and not use_decode_kernel(h, input_ids.shape[1],
                                                                             self.arch.head_dim):
            # the SDPA path's mask, once for every layer (the decode kernel is causal by
            # position and reads a tree's compact mask as it is)
            if mask is None:
                mask = causal_mask(positions, Lc)
            elif isinstance(mask, TreeMask):
                mask = mask.dense(Lc)
        hidden = {}
        x, residual = h, None
        for i, layer in enumerate(self.layers):
            k_pool, v_pool = pools[i]
            x, residual = layer(x, residual, cos, sin, write_slots, read_slots, mask, k_pool, v_pool, positions,
                                fresh)
            if i in hidden_layers:
                hidden[i] = x + residual
        h, _ = self.norm(x, residual)
        if -1 in hidden_layers:
            hidden[-1] = h
        logits = _linear(self.lm_head, h, self.batch_invariant, self.gemm).float() if compute_logits else None
        return logits, hidden
