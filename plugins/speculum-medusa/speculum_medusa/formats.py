"""Medusa-1 checkpoints as the Medusa repository (FasterDecoding/Medusa) writes them.

``config.json`` with ``medusa_num_heads``, ``medusa_num_layers`` and
``base_model_name_or_path``; weights in ``medusa_lm_head.safetensors`` or
``medusa_lm_head.pt`` (a ``torch.save`` state dict), keyed ``{i}.{j}.linear.weight`` /
``{i}.{j}.linear.bias`` for residual block ``j`` of head ``i`` and ``{i}.{L}.weight`` for its
LM head (``L = medusa_num_layers``). Heads saved without LM heads (``{i}.{L}.weight``
absent; speculum writes ``"medusa_shared_lm_head": true``) use the target's LM head.
Token-aware heads (:mod:`speculum_medusa.model`, speculum's extension) add
``"speculum_token_input": true`` and the shared map ``token_proj.weight`` [H, H] (either
one makes them token-aware here; the flag without the map is an error). Sequentially
dependent heads add ``"speculum_sequential": true`` and ``seq_proj.{j}.weight`` [H, H] for
``j < medusa_num_heads - 1`` (the map of the token ``j + 1`` places after ``x_{t+1}``). A prefix
layer (speculum's extension after Hydra++) adds ``"speculum_prefix_layer"``, the layer's Llama
shape (``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
``rms_norm_eps``, ``rope_theta``...; its width is the heads'), and its weights under
``prefix.`` with Llama names (``prefix.input_layernorm.weight``, ``prefix.self_attn.q_proj.weight``...).
Medusa's own loader would drop these and draft worse, not wrongly: drafts never change the output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from speculum.backends.torch.heads import (TargetParts, arch_fields, arch_from_config, copy_weight, layer_state,
                                           load_layer)
from speculum.errors import ConfigError
from speculum.proposers.head_checkpoint import read_config, read_weights, write_checkpoint
from speculum_medusa.model import MedusaHeads

WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
PREFIX_KEY = "speculum_prefix_layer"


def detect(model_path: str, config: Mapping[str, Any]) -> str | None:
    return "medusa" if config.get("medusa_num_heads") else None


def load_medusa(path: Path, target: TargetParts) -> MedusaHeads:
    cfg = read_config(path)
    where = f"Medusa heads {path}"
    sd = {k.removeprefix("medusa_head."): v for k, v in read_weights(path, WEIGHT_FILES).items()}
    n_heads = int(cfg.get("medusa_num_heads") or len({k.split(".")[0] for k in sd if k.split(".")[0].isdigit()}))
    n_layers = int(cfg.get("medusa_num_layers", 1))
    if "0.0.linear.weight" not in sd:
        raise ConfigError(f"{where}: no '0.0.linear.weight'; is this a Medusa-1 checkpoint?")
    target.check(where, int(sd["0.0.linear.weight"].shape[0]), cfg.get("vocab_size"))
    own = f"0.{n_layers}.weight" in sd
    if own:
        target.check(f"{where} (LM head)", None, int(sd[f"0.{n_layers}.weight"].shape[0]))
    token_input = bool(cfg.get("speculum_token_input")) or "token_proj.weight" in sd
    if token_input and "token_proj.weight" not in sd:
        raise ConfigError(f"{where}: config.json says speculum_token_input but the weights lack 'token_proj.weight'")
    sequential = bool(cfg.get("speculum_sequential")) or "seq_proj.0.weight" in sd
    missing = [f"seq_proj.{j}.weight" for j in range(n_heads - 1) if f"seq_proj.{j}.weight" not in sd]
    if sequential and (missing or not token_input):
        raise ConfigError(f"{where}: sequential heads (speculum_sequential) need 'token_proj.weight' and "
                          f"seq_proj.0..{n_heads - 2}; missing {(['token_proj.weight'] if not token_input else []) + missing}")
    prefix = None
    if cfg.get(PREFIX_KEY):
        shape = cfg[PREFIX_KEY]
        if not isinstance(shape, dict):
            raise ConfigError(f"{where}: {PREFIX_KEY} must be the prefix layer's Llama fields, got {shape!r}")
        prefix = arch_from_config({**shape, "hidden_size": target.hidden_size, "vocab_size": target.vocab_size},
                                  num_layers=1)
    elif any(k.startswith("prefix.") for k in sd):
        raise ConfigError(f"{where}: the weights hold a prefix layer (prefix.*) but config.json has no {PREFIX_KEY}")
    heads = MedusaHeads(target.hidden_size, target.vocab_size, n_heads, n_layers,
                        lm_head=None if own else target.lm_head, embed=target.embed if token_input else None,
                        sequential=sequential, prefix=prefix)
    if prefix is not None:
        load_layer(heads.prefix[0], sd, "prefix.", where)
    if token_input:
        copy_weight(heads.token_proj.weight, sd["token_proj.weight"], "token_proj.weight", where)
    for j, lin in enumerate(heads.seq_proj or ()):
        copy_weight(lin.weight, sd[f"seq_proj.{j}.weight"], f"seq_proj.{j}.weight", where)
    for i in range(n_heads):
        for j in range(n_layers):
            for p in ("weight", "bias"):
                name = f"{i}.{j}.linear.{p}"
                if name not in sd:
                    raise ConfigError(f"{where}: checkpoint lacks {name!r} ({n_heads} heads x {n_layers} layers)")
                copy_weight(getattr(heads.blocks[i][j].linear, p), sd[name], name, where)
        if own:
            copy_weight(heads.heads[i].weight, sd[f"{i}.{n_layers}.weight"], f"{i}.{n_layers}.weight", where)
    return heads


def medusa_state(heads: MedusaHeads) -> dict[str, torch.Tensor]:
    sd = {}
    for i in range(heads.num_heads):
        for j in range(heads.num_layers):
            lin = heads.blocks[i][j].linear
            sd[f"{i}.{j}.linear.weight"] = lin.weight.detach()
            sd[f"{i}.{j}.linear.bias"] = lin.bias.detach()
        if heads.heads is not None:
            sd[f"{i}.{heads.num_layers}.weight"] = heads.heads[i].weight.detach()
    if heads.token_proj is not None:
        sd["token_proj.weight"] = heads.token_proj.weight.detach()
    for j, lin in enumerate(heads.seq_proj or ()):
        sd[f"seq_proj.{j}.weight"] = lin.weight.detach()
    if heads.prefixed:
        sd.update({k: v.detach() for k, v in layer_state(heads.prefix[0], "prefix.").items()})
    return sd


def save_medusa(heads: MedusaHeads, path: Path, base_model: str = "", meta: dict | None = None,
                dtype: torch.dtype | None = None) -> Path:
    cfg = {"medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers,
           "base_model_name_or_path": base_model, "hidden_size": heads.hidden_size, "vocab_size": heads.vocab_size,
           "medusa_shared_lm_head": heads.heads is None}
    if heads.token_input:
        cfg["speculum_token_input"] = True
    if heads.sequential:
        cfg["speculum_sequential"] = True
    if heads.prefixed:
        cfg[PREFIX_KEY] = arch_fields(heads.prefix_arch)  # (its width is the heads')
    if meta:
        cfg["speculum"] = meta
    return write_checkpoint(path, cfg, medusa_state(heads), filename=WEIGHT_FILES[0], dtype=dtype)
