"""Reading a Llama-family checkpoint into host arrays for the JAX model.

The same checkpoints as the torch native runner: a transformers directory (safetensors
or ``pytorch_model*.bin``; GGUF files and the default model arrive here as the cached
directory :func:`speculum.model_source.resolve_model_path` makes). The config fields and
the tensor reader are the torch backend's, imported in this one place only, so both
backends read a checkpoint identically.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from speculum.backends.torch.native.arch import LlamaArch, read_arch
from speculum.backends.torch.native.weights import read_state_dict
from speculum.errors import ModelLoadError

__all__ = ["LlamaArch", "read_arch", "read_host_weights"]


def read_host_weights(path: Path, arch: LlamaArch, np_dtype) -> dict:
    """Checkpoint tensors as numpy arrays of ``np_dtype`` (may be ``ml_dtypes.bfloat16``).

    Returns ``{"embed": [V, H], "lm_head": [V, H] or None (tied), "norm": [H],
    "layers": [one dict per layer]}``; weight matrices keep the checkpoint's [out, in]
    layout, with q/k/v and gate/up fused along ``out`` (one matmul each). Only the first
    ``arch.num_layers`` layers are read.
    """
    sd = read_state_dict(Path(path))
    pre = "model."

    def take(name: str) -> np.ndarray:
        try:
            t = sd[name]
        except KeyError:
            raise ModelLoadError(f"checkpoint {path} lacks weight {name!r}") from None
        return t.float().numpy().astype(np_dtype, copy=False)

    qkv_bias = f"{pre}layers.0.self_attn.q_proj.bias" in sd
    o_bias = f"{pre}layers.0.self_attn.o_proj.bias" in sd
    layers = []
    for i in range(arch.num_layers):
        a = f"{pre}layers.{i}.self_attn."
        m = f"{pre}layers.{i}.mlp."
        w = {
            "attn_norm": take(f"{pre}layers.{i}.input_layernorm.weight"),
            "mlp_norm": take(f"{pre}layers.{i}.post_attention_layernorm.weight"),
            "wqkv": np.concatenate([take(a + "q_proj.weight"), take(a + "k_proj.weight"), take(a + "v_proj.weight")]),
            "wo": take(a + "o_proj.weight"),
            "w_gate_up": np.concatenate([take(m + "gate_proj.weight"), take(m + "up_proj.weight")]),
            "w_down": take(m + "down_proj.weight"),
        }
        if qkv_bias:
            w["bqkv"] = np.concatenate([take(a + "q_proj.bias"), take(a + "k_proj.bias"), take(a + "v_proj.bias")])
        if o_bias:
            w["bo"] = take(a + "o_proj.bias")
        if arch.qk_norm:
            w["q_norm"] = take(a + "q_norm.weight")
            w["k_norm"] = take(a + "k_norm.weight")
        layers.append(w)
    tied = arch.tie_word_embeddings or "lm_head.weight" not in sd
    return {
        "embed": take(f"{pre}embed_tokens.weight"),
        "lm_head": None if tied else take("lm_head.weight"),
        "norm": take(f"{pre}norm.weight"),
        "layers": layers,
    }
