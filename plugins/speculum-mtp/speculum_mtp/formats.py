"""MTP layers in DeepSeek-V3's checkpoint layout.

A checkpoint whose ``config.json`` has ``num_nextn_predict_layers >= 1`` keeps its MTP
module(s) after the ``num_hidden_layers`` decoder layers, at ``model.layers.{N}.`` with
``N = num_hidden_layers`` (the next one at ``N + 1``...): ``enorm.weight``,
``hnorm.weight``, ``eh_proj.weight`` [H, 2H], ``shared_head.norm.weight``, optionally
``shared_head.head.weight`` and ``embed_tokens.weight`` (else the target's are used),
and the decoder layer's ``input_layernorm``, ``self_attn.*``, ``post_attention_layernorm``
and ``mlp.*``. That checkpoint may be the target itself or a standalone file holding
only the MTP layer(s) (what ``speculum train mtp`` writes, with the target's config).
speculum adds ``speculum_mtp_concat_order`` to the config it writes.

A speculum extension: a module of more than one decoder layer (``speculum train mtp
--num-layers L``). Its first decoder layer stays where DeepSeek-V3 keeps it; layer ``i``
(1 <= i < L) is at ``model.layers.{N}.layers.{i}.`` (the same Llama names), and the config
says ``speculum_mtp_num_layers: L``. Readers that know only DeepSeek-V3's layout would see a
one-layer module, so the key is written (and checked against the weights) whenever L > 1.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

import torch

from speculum.backends.torch.heads import TargetParts, arch_from_config, copy_weight, layer_state, load_layer
from speculum.errors import ConfigError
from speculum.proposers.head_checkpoint import read_config, read_weights, weight_names, write_checkpoint
from speculum_mtp.model import ORDERS, MTPHead

ORDER_KEY = "speculum_mtp_concat_order"
LAYERS_KEY = "speculum_mtp_num_layers"


def detect(model_path: str, config: Mapping[str, Any]) -> str | None:
    return "mtp" if int(config.get("num_nextn_predict_layers") or 0) > 0 else None


def mtp_layer_ids(path: Path, cfg: Mapping[str, Any]) -> list[int]:
    """Layer indices of the MTP modules in a checkpoint (from its weight names)."""
    pat = re.compile(r"model\.layers\.(\d+)\.eh_proj\.weight$")
    found = sorted({int(m.group(1)) for n in weight_names(path) if (m := pat.match(n))})
    N = int(cfg.get("num_hidden_layers", 0))
    return [i for i in found if i >= N] or found


def module_layers(names, pre: str, cfg: Mapping[str, Any], where: str) -> int:
    """Decoder layers of the module at ``pre`` (1 + its ``layers.{i}.`` blocks), checked
    against the config's ``speculum_mtp_num_layers``."""
    pat = re.compile(re.escape(pre) + r"layers\.(\d+)\.self_attn\.q_proj\.weight$")
    extra = sorted({int(m.group(1)) for n in names if (m := pat.match(n))})
    if extra != list(range(1, len(extra) + 1)):
        raise ConfigError(f"{where}: the module's extra decoder layers are numbered {extra}; expected 1, 2, ... "
                          f"({pre}layers.{{i}}.*)")
    n = 1 + len(extra)
    said = cfg.get(LAYERS_KEY)
    if said is not None and int(said) != n:
        raise ConfigError(f"{where}: config.json says {LAYERS_KEY}={said}, the weights hold {n} decoder layer(s)")
    return n


def has_mtp(path: Path) -> bool:
    cfg = read_config(path)
    return int(cfg.get("num_nextn_predict_layers") or 0) > 0 and bool(mtp_layer_ids(path, cfg))


def load_mtp(path: Path, target: TargetParts, concat_order: str | None = None, layer: int = 0) -> MTPHead:
    cfg = read_config(path)
    where = f"MTP module {path}"
    ids = mtp_layer_ids(path, cfg)
    if not ids:
        raise ConfigError(f"{where}: no MTP layer (model.layers.N.eh_proj.weight) in the checkpoint")
    if layer >= len(ids):
        raise ConfigError(f"{where}: MTP module {layer} asked for (options.layer counts from 0), the checkpoint "
                          f"has {len(ids)}: give a layer below {len(ids)}")
    pre = f"model.layers.{ids[layer]}."
    sd = read_weights(path, prefix=pre)
    arch = arch_from_config(cfg, num_layers=module_layers(sd, pre, cfg, where))
    target.check(where, arch.hidden_size, cfg.get("vocab_size"))
    order = concat_order or cfg.get(ORDER_KEY) or "embed_hidden"
    if order not in ORDERS:
        raise ConfigError(f"{where}: concat_order must be one of {', '.join(ORDERS)}, got {order!r}")
    embed = sd.get(pre + "embed_tokens.weight")
    if embed is not None:
        target.check(f"{where} (embed_tokens)", embed.shape[1], embed.shape[0])
        embed = embed.to(target.embed.device, target.embed.dtype)
    own = sd.get(pre + "shared_head.head.weight")
    if own is not None:
        target.check(f"{where} (shared_head.head)", own.shape[1], own.shape[0])
    head = MTPHead(arch, target.embed if embed is None else embed, None if own is not None else target.lm_head, order)
    for name, param in (("enorm.weight", head.enorm.weight), ("hnorm.weight", head.hnorm.weight),
                        ("eh_proj.weight", head.eh_proj.weight), ("shared_head.norm.weight", head.head_norm.weight)):
        if pre + name not in sd:
            raise ConfigError(f"{where}: checkpoint lacks {pre + name!r}")
        copy_weight(param, sd[pre + name], pre + name, where)
    if own is not None:
        copy_weight(head.own_head.weight, own, pre + "shared_head.head.weight", where)
    for i, block in enumerate(head.layers):
        load_layer(block, sd, pre if i == 0 else f"{pre}layers.{i}.", where)
    return head


def mtp_state(head: MTPHead, index: int) -> dict[str, torch.Tensor]:
    pre = f"model.layers.{index}."
    sd = {pre + "enorm.weight": head.enorm.weight, pre + "hnorm.weight": head.hnorm.weight,
          pre + "eh_proj.weight": head.eh_proj.weight, pre + "shared_head.norm.weight": head.head_norm.weight}
    if head.own_head is not None:
        sd[pre + "shared_head.head.weight"] = head.own_head.weight
    sd = {k: v.detach() for k, v in sd.items()}
    for i, block in enumerate(head.layers):
        sd.update(layer_state(block, pre if i == 0 else f"{pre}layers.{i}."))
    return sd


def save_mtp(head: MTPHead, path: Path, target_config: Mapping[str, Any], meta: dict | None = None,
             dtype: torch.dtype | None = None) -> Path:
    """A standalone MTP checkpoint: the target's config plus the MTP layer at index N."""
    cfg = {k: v for k, v in target_config.items() if k not in ("_name_or_path", "transformers_version")}
    N = int(cfg["num_hidden_layers"])
    cfg.update({"architectures": ["LlamaMTPModule"], "num_nextn_predict_layers": 1, ORDER_KEY: head.concat_order})
    if head.num_layers > 1:
        cfg[LAYERS_KEY] = head.num_layers
    if meta:
        cfg["speculum"] = meta
    return write_checkpoint(path, cfg, mtp_state(head, N), dtype=dtype)
