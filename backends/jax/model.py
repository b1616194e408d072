"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) in jax.numpy over paged KV.

The same model as the torch native runner, written as pure functions of a parameter
pytree: RMSNorm, rotary embedding (with Llama-3 frequency scaling), grouped-query
attention, SiLU-gated MLP, tied embeddings, Qwen2's q/k/v biases, Qwen3's q/k norms.
The layers are unrolled in the compiled step (a ``lax.scan`` over stacked weights
compiles faster but copies every layer's weights out of the stack at every step).

K/V live in one pool per layer and kind, ``[slots, Hkv, D]``, addressed through the
block tables of :class:`speculum.kv.PagedKVAllocator` exactly as the torch runner
addresses its pools. A forward writes this step's K/V at its write slots, then reads
each row's context through its block table. The pools are donated to the jitted step,
so the writes happen in place.

Shapes: ``B`` batch rows, ``q`` query tokens per row, ``nb`` blocks per row (context
``Lc = nb * block_size``), ``H`` hidden size, ``Hq``/``Hkv`` query/KV heads, ``D`` head dim.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from speculum.backends.jax.checkpoint import LlamaArch, read_host_weights

Params = dict[str, Any]


@attrs.frozen
class ModelShape:
    """The static (hashable) facts a compiled step depends on (besides its array shapes)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    qk_norm: bool
    block_size: int
    # fp32 matmuls at full precision (no TF32 on GPUs), like torch's default
    exact_fp32: bool

    @classmethod
    def of(cls, arch: LlamaArch, block_size: int, dtype) -> "ModelShape":
        return cls(arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim, float(arch.rms_eps),
                   arch.qk_norm, block_size, jnp.dtype(dtype) == jnp.float32)


def rope_inv_freq(arch: LlamaArch) -> np.ndarray:
    """[D/2] float32 inverse frequencies, with Llama-3 scaling when the config asks for it."""
    d = arch.head_dim
    inv = (1.0 / (np.float32(arch.rope_theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))))
    inv = inv.astype(np.float32)
    sc = arch.rope_scaling
    if sc and sc.get("rope_type", sc.get("type")) == "llama3":
        factor, lo, hi = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
        old = sc.get("original_max_position_embeddings", 8192)
        lo_wl, hi_wl = old / lo, old / hi
        wl = np.float32(2 * math.pi) / inv
        # long wavelengths are slowed by ``factor``, short ones kept, the band between blended
        scaled = np.where(wl > lo_wl, inv / np.float32(factor), inv)
        smooth = (np.float32(old) / wl - np.float32(lo)) / np.float32(hi - lo)
        smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
        medium = ~(wl < hi_wl) & ~(wl > lo_wl)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def load_params(path, arch: LlamaArch, dtype, device) -> Params:
    """The checkpoint at ``path`` as a parameter pytree on ``device`` (a jax Device)."""
    host = read_host_weights(path, arch, jnp.dtype(dtype))
    params = {
        "embed": host["embed"],
        "norm": host["norm"],
        # one dict of arrays per layer: the step is unrolled over layers (see forward)
        "layers": host["layers"],
        "inv_freq": rope_inv_freq(arch),
    }
    if host["lm_head"] is not None:
        params["lm_head"] = host["lm_head"]
    return jax.device_put(params, device)


def param_bytes(params: Params) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(params))


# ------------------------------------------------------------------------------ layers
def rms_norm(x, weight, eps: float):
    """RMSNorm computed in float32, scaled in the model's dtype (as the torch twin)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


def linear(x, w, b=None, exact: bool = False):
    """``x @ w.T (+ b)`` with ``w`` in the checkpoint's [out, in] layout."""
    prec = jax.lax.Precision.HIGHEST if exact else None
    y = jnp.einsum("...i,oi->...o", x, w, precision=prec)
    return y if b is None else y + b


def rope_tables(positions, inv_freq, dtype):
    """cos, sin [B, q, 1, D] for positions [B, q]."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, q, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype)[:, :, None, :], jnp.sin(emb).astype(dtype)[:, :, None, :]


def apply_rope(x, cos, sin):
    """x [B, q, heads, D] rotated by its positions' angles (rotate-half convention)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def attention(q, k, v, mask, exact: bool):
    """Grouped-query attention. q [B, q, Hq, D]; k, v [B, Lc, Hkv, D]; mask [B, q, Lc]."""
    B, Q, Hq, D = q.shape
    Hkv = k.shape[2]
    prec = jax.lax.Precision.HIGHEST if exact else None
    # query head h reads KV head h // (Hq / Hkv)
    qg = q.reshape(B, Q, Hkv, Hq // Hkv, D)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, precision=prec, preferred_element_type=jnp.float32)
    s = jnp.where(mask[:, None, None], s * (D ** -0.5), -jnp.inf)  # [B, Hkv, G, q, Lc]
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v, precision=prec)
    return o.reshape(B, Q, Hq * D)


def _layer(shape: ModelShape, w: Params, x, k_pool, v_pool, cos, sin, wslots, rslots, mask):
    """One decoder layer over the stream ``x`` [B, q, H]; writes then reads its KV pools
    (``[slots, Hkv, D]``). Returns (x, k_pool, v_pool)."""
    B, Q, _ = x.shape
    nq, nkv, d, ex = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.exact_fp32
    qkv = linear(rms_norm(x, w["attn_norm"], shape.rms_eps), w["wqkv"], w.get("bqkv"), ex)
    qh = qkv[..., : nq * d].reshape(B, Q, nq, d)
    kh = qkv[..., nq * d: (nq + nkv) * d].reshape(B, Q, nkv, d)
    vh = qkv[..., (nq + nkv) * d:].reshape(B, Q, nkv, d)
    if shape.qk_norm:
        qh = rms_norm(qh, w["q_norm"], shape.rms_eps)
        kh = rms_norm(kh, w["k_norm"], shape.rms_eps)
    qh, kh = apply_rope(qh, cos, sin), apply_rope(kh, cos, sin)
    # padding positions write to the scratch block; the pools are updated in place
    k_pool = k_pool.at[wslots].set(kh, mode="promise_in_bounds")
    v_pool = v_pool.at[wslots].set(vh, mode="promise_in_bounds")
    kc = k_pool.at[rslots].get(mode="promise_in_bounds")  # [B, Lc, Hkv, D]
    vc = v_pool.at[rslots].get(mode="promise_in_bounds")
    x = x + linear(attention(qh, kc, vc, mask, ex), w["wo"], w.get("bo"), ex)
    gate_up = linear(rms_norm(x, w["mlp_norm"], shape.rms_eps), w["w_gate_up"], None, ex)
    g, u = jnp.split(gate_up, 2, axis=-1)
    x = x + linear(jax.nn.silu(g) * u, w["w_down"], None, ex)
    return x, k_pool, v_pool


@partial(jax.jit, static_argnames=("shape", "B", "q", "nb", "hidden_layers", "compute_logits"),
         donate_argnames=("k_pools", "v_pools"))
def forward(params: Params, k_pools, v_pools, meta, *, shape: ModelShape, B: int, q: int, nb: int,
            hidden_layers: tuple[int, ...] = (), compute_logits: bool = True):
    """One step over a padded batch. Returns (logits [B, q, V] float32 or None,
    {layer: hidden [B, q, H]}, k_pools, v_pools).

    ``k_pools``, ``v_pools``: one ``[slots, Hkv, D]`` pool per layer (donated: updated in place).

    ``meta`` int32 ``[ids | positions | write slots]`` (each [B, q]) followed by the block
    tables [B, nb], in one array so the host ships one buffer per step. Hidden layer
    ``i >= 0`` is the stream after decoder layer ``i``; ``-1`` the final normed state.
    """
    n = B * q
    ids = meta[:n].reshape(B, q)
    pos = meta[n: 2 * n].reshape(B, q)
    wslots = meta[2 * n: 3 * n].reshape(B, q)
    blocks = meta[3 * n:].reshape(B, nb)
    bs = shape.block_size
    # [B, Lc] the context's slots, in position order
    rslots = (blocks[:, :, None] * bs + jnp.arange(bs, dtype=blocks.dtype)).reshape(B, nb * bs)
    # key j is visible to a query at position p iff j <= p
    mask = jnp.arange(nb * bs, dtype=pos.dtype)[None, None, :] <= pos[:, :, None]
    x = params["embed"][ids]
    cos, sin = rope_tables(pos, params["inv_freq"], x.dtype)
    hidden = {}
    k_pools, v_pools = list(k_pools), list(v_pools)
    # unrolled: a scan over stacked weights would copy each layer's weights out of the
    # stack every step (XLA cannot alias a dynamic slice), which costs more than the layer
    for i, w in enumerate(params["layers"]):
        x, k_pools[i], v_pools[i] = _layer(shape, w, x, k_pools[i], v_pools[i], cos, sin, wslots, rslots, mask)
        if i in hidden_layers:
            hidden[i] = x
    h = rms_norm(x, params["norm"], shape.rms_eps)
    if -1 in hidden_layers:
        hidden[-1] = h
    logits = None
    if compute_logits:
        head = params.get("lm_head", params["embed"])
        logits = linear(h, head, None, shape.exact_fp32).astype(jnp.float32)
    return logits, hidden, tuple(k_pools), tuple(v_pools)
