"""Llama decoder layers for hidden-state draft heads (EAGLE, EAGLE-3, MTP).

One layer serves inference and training. Attention goes through a context object:

- :class:`speculum.backends.torch.heads.cache.PagedContext` at inference: K/V are written
  into the head's paged cache and the whole context is read back through block tables;
- :class:`TrainContext` in training: plain causal attention over a sequence, plus the
  "training-time test" of EAGLE-3 (step ``j`` of an unrolled draft chain attends to the
  true-feature keys at positions ``<= t`` and to its own chain's keys of steps ``1..j``).

Shapes: ``B`` batch, ``q``/``T`` tokens per row, ``H`` hidden size, ``Hq``/``Hkv`` query/KV
heads, ``D`` head dim. Weights convert to and from the Hugging Face Llama names
(``self_attn.q_proj``... ``mlp.gate_proj``...) with :func:`layer_state` / :func:`load_layer`.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from speculum.backends.torch.native.arch import LlamaArch
from speculum.backends.torch.native.attention import sdpa
from speculum.backends.torch.native.kernels import add_rmsnorm, apply_rope
from speculum.backends.torch.native.model import MLP, rope_inv_freq
from speculum.errors import ConfigError


def arch_from_config(cfg: Mapping[str, Any], num_layers: int | None = None) -> LlamaArch:
    """A :class:`LlamaArch` from a Llama-style ``config.json`` dict (any model_type)."""
    try:
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"} or None)
        if scaling and scaling.get("rope_type", scaling.get("type")) in ("default", None):
            scaling = None
        return LlamaArch(
            model_type=cfg.get("model_type", "llama"), vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]), intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(num_layers if num_layers is not None else cfg.get("num_hidden_layers", 1)),
            num_heads=int(heads), num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))), rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=False,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            eos_token_id=cfg.get("eos_token_id"),
        )
    except KeyError as exc:
        raise ConfigError(f"head config lacks {exc.args[0]!r}; it needs the Llama fields (hidden_size, "
                          "intermediate_size, num_attention_heads, vocab_size...)") from None


def arch_fields(arch: LlamaArch) -> dict[str, Any]:
    """A decoder layer's Llama fields of ``arch`` as config.json spells them: what
    :func:`arch_from_config` reads back (width, vocabulary and depth aside, which a head's
    format states in its own way)."""
    fields = {"intermediate_size": arch.intermediate_size, "num_attention_heads": arch.num_heads,
              "num_key_value_heads": arch.num_kv_heads, "head_dim": arch.head_dim, "rms_norm_eps": arch.rms_eps,
              "rope_theta": arch.rope_theta, "max_position_embeddings": arch.max_position_embeddings,
              "attention_bias": arch.qkv_bias}
    if arch.rope_scaling:
        fields["rope_scaling"] = arch.rope_scaling
    return fields


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """[B, q] positions -> (cos, sin) [B, q, 1, D]."""
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).unsqueeze(2), emb.sin().to(dtype).unsqueeze(2)


class RMSNorm(nn.Module):
    """RMSNorm: the fused kernel when drafting on a GPU, plain torch (differentiable) in
    training and on the CPU (:func:`~speculum.backends.torch.native.kernels.use_triton`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_rmsnorm(x, None, self.weight, self.eps)[0]


class Rope(nn.Module):
    """Rotary tables of a head (its own theta and scaling, usually the target's).

    Drafting (no gradient) reads cos and sin from a table of every position up to twice
    ``max_position_embeddings``, made once per device and dtype by the same float32
    arithmetic as :func:`rope_cos_sin` (two gathers instead of seven kernels a head
    forward); training computes them."""

    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(arch), persistent=False)
        self.table_len = 2 * max(arch.max_position_embeddings, 1)
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        if torch.is_grad_enabled():
            return rope_cos_sin(positions, self.inv_freq, dtype)
        key = (self.inv_freq.device, dtype)
        table = self._tables.get(key)
        if table is None:
            pos = torch.arange(self.table_len, device=self.inv_freq.device)
            cos, sin = rope_cos_sin(pos.view(1, -1), self.inv_freq, dtype)  # [1, L, 1, D]
            table = self._tables[key] = (cos[0, :, 0].clone(), sin[0, :, 0].clone())
        idx = positions.clamp(0, self.table_len - 1)
        return table[0][idx].unsqueeze(-2), table[1][idx].unsqueeze(-2)


class HeadAttention(nn.Module):
    """Self-attention with a configurable input width (2H for EAGLE-3's fused input)."""

    def __init__(self, arch: LlamaArch, in_dim: int | None = None, bias: bool = False):
        super().__init__()
        self.nq, self.nkv, self.d = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.qkv = nn.Linear(in_dim or arch.hidden_size, (self.nq + 2 * self.nkv) * self.d, bias=bias)
        self.o = nn.Linear(self.nq * self.d, arch.hidden_size, bias=bias)
        self.scale = self.d ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx, index: int) -> torch.Tensor:
        B, q, _ = x.shape
        out = ctx.attend(index, self.qkv(x), (self.nq, self.nkv, self.d), cos, sin, self.scale)  # [B, q, Hq, D]
        return self.o(out.reshape(B, q, self.nq * self.d))


def rope_qkv(qkv: torch.Tensor, heads: tuple[int, int, int], cos: torch.Tensor, sin: torch.Tensor):
    """Fused ``qkv`` [B, q, (Hq + 2 Hkv) D] -> rotated q [B, q, Hq, D], rotated k and v
    [B, q, Hkv, D] (plain torch: training's path)."""
    nq, nkv, d = heads
    B, q, _ = qkv.shape
    qh, kh, vh = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
    qh, kh = qh.reshape(B, q, nq, d), kh.reshape(B, q, nkv, d)
    return apply_rope(qh, cos, sin), apply_rope(kh, cos, sin), vh.reshape(B, q, nkv, d)


class HeadDecoderLayer(nn.Module):
    """A Llama decoder layer: ``h + attn(norm(h))`` then ``h + mlp(norm(h))``.

    ``input_norm=False`` drops the first norm (EAGLE-1's first layer); ``attn_in`` lets a
    caller feed the attention another input than ``norm(h)`` (EAGLE-3's fused input).
    """

    def __init__(self, arch: LlamaArch, index: int = 0, in_dim: int | None = None, input_norm: bool = True,
                 bias: bool = False):
        super().__init__()
        self.index = index
        self.input_norm = RMSNorm(arch.hidden_size, arch.rms_eps) if input_norm else None
        self.attn = HeadAttention(arch, in_dim, bias)
        self.mlp_norm = RMSNorm(arch.hidden_size, arch.rms_eps)
        self.mlp = MLP(arch)

    def forward(self, h, cos, sin, ctx, attn_in: torch.Tensor | None = None) -> torch.Tensor:
        if attn_in is None:
            attn_in = self.input_norm(h) if self.input_norm is not None else h
        h = h + self.attn(attn_in, cos, sin, ctx, self.index)
        return h + self.mlp(self.mlp_norm(h))


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """[B, Hkv, T, D] -> [B, Hkv * n, T, D] (grouped-query attention)."""
    return x if n == 1 else x.repeat_interleave(n, dim=1)


class TrainContext:
    """Attention for training, with EAGLE-3's training-time test over unrolled steps.

    Call :meth:`next_step` before each unrolled draft step. Step 0 is causal attention over
    the true-feature keys; at step ``j >= 1`` the query of anchor ``t`` (position ``t + j``)
    sees the step-0 keys at positions ``<= t`` and the keys its own chain made at steps
    ``1..j`` (positions ``t + 1 .. t + j``), exactly what the draft sees at inference.
    """

    def __init__(self):
        self.step = -1
        self.keys: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def next_step(self) -> int:
        self.step += 1
        return self.step

    def attend(self, index: int, qkv, heads, cos, sin, scale: float) -> torch.Tensor:
        """Attention of fused ``qkv`` (``heads``: Hq, Hkv, D) with rotary ``cos``/``sin``."""
        q, k, v = rope_qkv(qkv, heads, cos, sin)
        # [B, T, H, D] -> [B, H, T, D]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        rep = q.shape[1] // k.shape[1]
        store = self.keys.setdefault(index, [])
        store.append((k, v))
        if self.step == 0:
            out = sdpa(q, _repeat_kv(k, rep), _repeat_kv(v, rep), is_causal=True, scale=scale)
            return out.transpose(1, 2)
        k0, v0 = (_repeat_kv(t, rep) for t in store[0])
        T = q.shape[2]
        s0 = (q @ k0.transpose(-1, -2)) * scale  # [B, H, T, T]
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        s0 = s0.masked_fill(~causal, float("-inf"))
        diag_k = [_repeat_kv(kk, rep) for kk, _ in store[1:]]
        diag_v = [_repeat_kv(vv, rep) for _, vv in store[1:]]
        sd = torch.stack([(q * kk).sum(-1) * scale for kk in diag_k], dim=-1)  # [B, H, T, j]
        w = torch.cat([s0, sd], dim=-1).float().softmax(dim=-1).to(q.dtype)
        out = w[..., :T] @ v0 + sum(w[..., T + i: T + i + 1] * vv for i, vv in enumerate(diag_v))
        return out.transpose(1, 2)


# -- Hugging Face names -------------------------------------------------------------------
def layer_state(layer: HeadDecoderLayer, prefix: str) -> dict[str, torch.Tensor]:
    """The layer's weights under Llama names (``{prefix}self_attn.q_proj.weight``...)."""
    a = layer.attn
    q, k, v = a.qkv.weight.split([a.nq * a.d, a.nkv * a.d, a.nkv * a.d])
    gate, up = layer.mlp.gate_up.weight.split(layer.mlp.inter)
    sd = {f"{prefix}self_attn.q_proj.weight": q, f"{prefix}self_attn.k_proj.weight": k,
          f"{prefix}self_attn.v_proj.weight": v, f"{prefix}self_attn.o_proj.weight": a.o.weight,
          f"{prefix}mlp.gate_proj.weight": gate, f"{prefix}mlp.up_proj.weight": up,
          f"{prefix}mlp.down_proj.weight": layer.mlp.down.weight,
          f"{prefix}post_attention_layernorm.weight": layer.mlp_norm.weight}
    if a.qkv.bias is not None:
        qb, kb, vb = a.qkv.bias.split([a.nq * a.d, a.nkv * a.d, a.nkv * a.d])
        sd.update({f"{prefix}self_attn.q_proj.bias": qb, f"{prefix}self_attn.k_proj.bias": kb,
                   f"{prefix}self_attn.v_proj.bias": vb, f"{prefix}self_attn.o_proj.bias": a.o.bias})
    if layer.input_norm is not None:
        sd[f"{prefix}input_layernorm.weight"] = layer.input_norm.weight
    return {n: t.detach() for n, t in sd.items()}


def copy_weight(dst: torch.Tensor, src: torch.Tensor, name: str, where: str) -> None:
    """Copy a checkpoint tensor into a parameter; a shape mismatch is a ConfigError."""
    if tuple(src.shape) != tuple(dst.shape):
        raise ConfigError(f"{where}: weight {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)} "
                          "for this head's config (hidden size / heads / vocabulary mismatch?)")
    with torch.no_grad():
        dst.copy_(src.to(dst.dtype))


def load_layer(layer: HeadDecoderLayer, sd: Mapping[str, torch.Tensor], prefix: str, where: str) -> None:
    """Fill ``layer`` from Llama-named weights; a missing or mis-shaped weight is a ConfigError."""
    def take(name: str) -> torch.Tensor:
        try:
            return sd[prefix + name]
        except KeyError:
            raise ConfigError(f"{where}: checkpoint lacks weight {prefix + name!r}") from None

    a = layer.attn
    copy_weight(a.qkv.weight, torch.cat([take("self_attn.q_proj.weight"), take("self_attn.k_proj.weight"),
                                         take("self_attn.v_proj.weight")]), prefix + "self_attn.qkv", where)
    copy_weight(a.o.weight, take("self_attn.o_proj.weight"), prefix + "self_attn.o_proj.weight", where)
    if a.qkv.bias is not None:
        copy_weight(a.qkv.bias, torch.cat([take("self_attn.q_proj.bias"), take("self_attn.k_proj.bias"),
                                           take("self_attn.v_proj.bias")]), prefix + "self_attn.qkv.bias", where)
        copy_weight(a.o.bias, take("self_attn.o_proj.bias"), prefix + "self_attn.o_proj.bias", where)
    copy_weight(layer.mlp.gate_up.weight, torch.cat([take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")]),
                prefix + "mlp.gate_up", where)
    copy_weight(layer.mlp.down.weight, take("mlp.down_proj.weight"), prefix + "mlp.down_proj.weight", where)
    copy_weight(layer.mlp_norm.weight, take("post_attention_layernorm.weight"),
                prefix + "post_attention_layernorm.weight", where)
    if layer.input_norm is not None:
        copy_weight(layer.input_norm.weight, take("input_layernorm.weight"), prefix + "input_layernorm.weight", where)


def init_layer(layer: HeadDecoderLayer, std: float = 0.02) -> None:
    """Random init for training from scratch (normal weights, unit norms, zero biases)."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, std)


def grow_layers(new, old) -> None:
    """Fill the decoder layers ``new`` (a longer list) from ``old``: its layers first, copied,
    then layers whose attention and MLP output projections start at zero (the rest initialised
    as :func:`init_layer`), so each adds nothing to the residual stream until trained: a head
    grown deeper drafts exactly as the one it came from."""
    if len(new) < len(old):
        raise ValueError(f"cannot grow {len(old)} layers into {len(new)}")
    with torch.no_grad():
        for src, dst in zip(old, new):
            dst.load_state_dict(src.state_dict())
        for layer in list(new)[len(old):]:
            init_layer(layer)
            for out in (layer.attn.o, layer.mlp.down):
                out.weight.zero_()
                if out.bias is not None:
                    out.bias.zero_()
