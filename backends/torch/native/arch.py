"""Which checkpoints the native Llama-family runner serves, read from config.json."""

from __future__ import annotations

import json
from pathlib import Path

import attrs

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


@attrs.frozen
class LlamaArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    eos_token_id: int | list | None

    def context_limit(self, role: str, max_model_len: int | None) -> int:
        """The longest sequence a runner of this model serves: ``max_model_len`` or the
        model's own; a target never past its position embeddings (a draft may be asked
        for a few positions past the context)."""
        limit = max_model_len or self.max_position_embeddings
        return min(limit, self.max_position_embeddings) if role == "target" else limit

    @property
    def kv_bytes_per_token(self) -> int:
        """Elements of K and V per token over all layers (times the dtype size = bytes)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def read_arch(path: Path, num_layers: int | None = None, max_model_len: int | None = None) -> tuple[LlamaArch | None, str]:
    """Parse ``config.json``; returns (arch, "") or (None, reason it is not supported)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    mt = cfg.get("model_type")
    if mt not in SUPPORTED:
        return None, f"model_type {mt!r} is not in the native Llama family ({', '.join(SUPPORTED)})"
    if cfg.get("hidden_act", "silu") != "silu":
        return None, f"hidden_act {cfg.get('hidden_act')!r}"
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"} or None)
    rtype = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rtype not in ("default", "llama3", None):
        return None, f"rope type {rtype!r}"
    if rtype == "default":
        scaling = None
    window = cfg.get("sliding_window")
    use_window = cfg.get("use_sliding_window", mt == "mistral")
    limit = max_model_len or cfg.get("max_position_embeddings", 2048)
    if window and use_window and window < limit:
        return None, f"sliding window {window} < context {limit}"
    heads = cfg["num_attention_heads"]
    return LlamaArch(
        model_type=mt, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=num_layers or cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", mt == "qwen2")), qk_norm=mt == "qwen3",
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        eos_token_id=cfg.get("eos_token_id"),
    ), ""
