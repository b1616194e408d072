"""Loading transformers (safetensors / pytorch_model.bin) weights into NativeLlama."""

from __future__ import annotations

from pathlib import Path

import torch

from speculum.backends.torch.native.arch import LlamaArch
from speculum.backends.torch.native.model import NativeLlama, rope_inv_freq
from speculum.errors import ModelLoadError


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file
        for f in files:
            state.update(load_file(str(f)))
        return state
    bins = sorted(path.glob("pytorch_model*.bin"))
    for f in bins:
        state.update(torch.load(str(f), map_location="cpu", weights_only=True))
    if not state:
        raise ModelLoadError(f"no *.safetensors or pytorch_model*.bin weights in {path}")
    return state


def build_native(path: Path, arch: LlamaArch, dtype: torch.dtype, device: torch.device) -> NativeLlama:
    """Create the model on ``device`` and copy the checkpoint's weights in (fusing qkv, gate/up)."""
    sd = read_state_dict(path)
    pre = "model."
    qkv_bias = f"{pre}layers.0.self_attn.q_proj.bias" in sd
    o_bias = f"{pre}layers.0.self_attn.o_proj.bias" in sd
    with torch.device("meta"):
        model = NativeLlama(arch, qkv_bias, o_bias)
    model = model.to_empty(device=device)
    model.inv_freq = rope_inv_freq(arch).to(device)  # buffers made on meta must be recomputed

    def take(name: str) -> torch.Tensor:
        try:
            return sd[name]
        except KeyError:
            raise ModelLoadError(f"checkpoint {path} lacks weight {name!r}") from None

    with torch.no_grad():
        model.embed.weight.copy_(take(f"{pre}embed_tokens.weight"))
        head = sd.get("lm_head.weight")
        if head is None or arch.tie_word_embeddings:
            head = take(f"{pre}embed_tokens.weight")
        model.lm_head.weight.copy_(head)
        model.norm.weight.copy_(take(f"{pre}norm.weight"))
        for i, blk in enumerate(model.layers):
            p = f"{pre}layers.{i}."
            a = p + "self_attn."
            blk.attn.qkv.weight.copy_(torch.cat([take(a + "q_proj.weight"), take(a + "k_proj.weight"),
                                                 take(a + "v_proj.weight")]))
            if qkv_bias:
                blk.attn.qkv.bias.copy_(torch.cat([take(a + "q_proj.bias"), take(a + "k_proj.bias"),
                                                   take(a + "v_proj.bias")]))
            blk.attn.o.weight.copy_(take(a + "o_proj.weight"))
            if o_bias:
                blk.attn.o.bias.copy_(take(a + "o_proj.bias"))
            if arch.qk_norm:
                blk.attn.q_norm.weight.copy_(take(a + "q_norm.weight"))
                blk.attn.k_norm.weight.copy_(take(a + "k_norm.weight"))
            blk.mlp.gate_up.weight.copy_(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]))
            blk.mlp.down.weight.copy_(take(p + "mlp.down_proj.weight"))
            blk.attn_norm.weight.copy_(take(p + "input_layernorm.weight"))
            blk.mlp_norm.weight.copy_(take(p + "post_attention_layernorm.weight"))
    return model.to(dtype).eval().requires_grad_(False)


def random_native(arch: LlamaArch, dtype: torch.dtype, device: torch.device, seed: int = 0) -> NativeLlama:
    """A randomly initialised model of ``arch`` (for benchmarks of big shapes offline)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = NativeLlama(arch)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
        for m in model.modules():
            if hasattr(m, "eps"):
                m.weight.fill_(1.0)
    return model.to(dtype).eval().requires_grad_(False)
