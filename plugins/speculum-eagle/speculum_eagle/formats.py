"""EAGLE-1 and EAGLE-3 checkpoints as the EAGLE repository (and vLLM) write them.

EAGLE-1: ``config.json`` (Llama fields; ``architectures`` e.g. ``["EagleLlamaForCausalLM"]``)
and ``model.safetensors`` or ``pytorch_model.bin`` with ``fc.weight`` [H, 2H], ``fc.bias``,
``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``,
``layers.{i}.post_attention_layernorm.weight`` (and ``input_layernorm`` for i > 0);
optionally ``embed_tokens.weight``. The LM head is the target's.

EAGLE-3: ``architectures: ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``, optionally
``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``; weights
``fc.weight`` [H, 3H], ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}``,
``midlayer.self_attn.*`` (q/k/v over 2H), ``midlayer.mlp.*``, ``norm.weight``,
``lm_head.weight`` [Vd, H], ``d2t`` [Vd] and ``t2d`` [V]. speculum's
``"speculum_target_tail": true`` (``speculum train eagle3 --draft-tail``) drafts the tokens
outside the draft vocabulary through the target's LM head, after ``tail_map.weight`` [H, H]
(the only extra tensor; a reader that skips it has a plain EAGLE-3 checkpoint of ``Vd`` rows).

Aux layer ids follow vLLM: id ``i`` is the *input* of target layer ``i`` (the output
of layer ``i - 1``); the default is ``(2, L // 2, L - 3)`` for a target of ``L`` layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from speculum.backends.torch.heads import (TargetParts, arch_fields, arch_from_config, copy_weight, layer_state,
                                           load_layer)
from speculum.errors import ConfigError
from speculum.proposers.head_checkpoint import read_config, read_weights, weight_names, write_checkpoint
from speculum_eagle.model import Eagle1Head, Eagle3Head

EAGLE1_ARCH = "EagleLlamaForCausalLM"
EAGLE3_ARCH = "LlamaForCausalLMEagle3"


def detect(model_path: str, config: Mapping[str, Any]) -> str | None:
    """``"eagle3"``, ``"eagle"`` or None, from the architectures or else the weight names."""
    archs = " ".join(config.get("architectures") or []).lower()
    if "eagle3" in archs:
        return "eagle3"
    if "eagle" in archs:
        return "eagle"
    names = {n.removeprefix("model.") for n in weight_names(model_path)}
    if "fc.weight" in names:
        if "d2t" in names or any(n.startswith("midlayer.") for n in names):
            return "eagle3"
        if any(n.startswith("layers.0.") for n in names):
            return "eagle"
    return None


def _strip_prefix(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Some exports put everything under ``model.``; EAGLE names have no prefix."""
    if sd and all(n.startswith("model.") or n.startswith("lm_head.") for n in sd):
        return {n.removeprefix("model."): t for n, t in sd.items()}
    return sd


def _own_embed(sd, target: TargetParts, where: str) -> torch.Tensor:
    """The checkpoint's ``embed_tokens.weight`` if it has one (checked), else the target's."""
    emb = sd.get("embed_tokens.weight")
    if emb is None:
        return target.embed
    target.check(f"{where} (embed_tokens)", emb.shape[1], emb.shape[0])
    return emb.to(target.embed.device, target.embed.dtype)


def default_aux_ids(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's default (2, L // 2, L - 3), kept inside 1..L for very shallow targets."""
    L = num_target_layers
    return tuple(min(max(i, 1), L) for i in (2, L // 2, L - 3))


def aux_ids_to_layers(ids: Sequence[int], num_target_layers: int) -> tuple[int, ...]:
    """vLLM aux ids (inputs of target layers) -> our hidden layers (outputs), checked."""
    bad = [i for i in ids if not 1 <= int(i) <= num_target_layers]
    if bad:
        raise ConfigError(f"EAGLE-3 aux hidden-state layer ids {list(ids)} must be in 1..{num_target_layers} "
                          f"for this target ({num_target_layers} layers); {bad} are not")
    return tuple(int(i) - 1 for i in ids)


def layers_to_aux_ids(layers: Sequence[int]) -> list[int]:
    """Our hidden layers (outputs of target layers) -> vLLM aux ids (inputs of the next)."""
    return [int(l) + 1 for l in layers]


# -- EAGLE-1 -----------------------------------------------------------------------------------
def load_eagle1(path: Path, target: TargetParts) -> Eagle1Head:
    cfg = read_config(path)
    where = f"EAGLE head {path}"
    arch = arch_from_config(cfg)
    target.check(where, arch.hidden_size, cfg.get("vocab_size"))
    sd = _strip_prefix(read_weights(path))
    if "fc.weight" not in sd:
        raise ConfigError(f"{where}: no 'fc.weight'; is this an EAGLE-1 checkpoint?")
    fc = sd["fc.weight"]
    if tuple(fc.shape) != (arch.hidden_size, 2 * target.hidden_size):
        raise ConfigError(f"{where}: fc.weight has shape {tuple(fc.shape)}, expected "
                          f"({arch.hidden_size}, {2 * target.hidden_size}) for a target of hidden size "
                          f"{target.hidden_size}")
    n_layers = len({n.split(".")[1] for n in sd if n.startswith("layers.")})
    arch = arch_from_config(cfg, num_layers=n_layers or arch.num_layers)
    head = Eagle1Head(arch, _own_embed(sd, target, where), target.lm_head, fc_bias="fc.bias" in sd)
    copy_weight(head.fc.weight, fc, "fc.weight", where)
    if "fc.bias" in sd:
        copy_weight(head.fc.bias, sd["fc.bias"], "fc.bias", where)
    for i, layer in enumerate(head.layers):
        load_layer(layer, sd, f"layers.{i}.", where)
    return head


def _llama_config(arch, architecture: str, num_layers: int, meta: dict | None, **extra) -> dict:
    """The Llama fields a head's config.json shares (EAGLE-1 and EAGLE-3), plus ``extra``."""
    cfg = {"architectures": [architecture], "model_type": "llama", "hidden_size": arch.hidden_size,
           "num_hidden_layers": num_layers, "vocab_size": arch.vocab_size, **arch_fields(arch), **extra}
    if meta:
        cfg["speculum"] = meta
    return cfg


def eagle1_config(head: Eagle1Head, target_cfg: Mapping[str, Any] | None = None, meta: dict | None = None) -> dict:
    a = head.arch
    return _llama_config(a, EAGLE1_ARCH, a.num_layers, meta, hidden_act="silu",
                         bias=head.fc.bias is not None, tie_word_embeddings=False)


def eagle1_state(head: Eagle1Head) -> dict[str, torch.Tensor]:
    sd = {"fc.weight": head.fc.weight.detach()}
    if head.fc.bias is not None:
        sd["fc.bias"] = head.fc.bias.detach()
    for i, layer in enumerate(head.layers):
        sd.update(layer_state(layer, f"layers.{i}."))
    return sd


def save_eagle1(head: Eagle1Head, path: Path, meta: dict | None = None, dtype: torch.dtype | None = None) -> Path:
    return write_checkpoint(path, eagle1_config(head, meta=meta), eagle1_state(head), dtype=dtype)


# -- EAGLE-3 -----------------------------------------------------------------------------------
def eagle3_aux_ids(cfg: Mapping[str, Any]) -> list[int] | None:
    ec = cfg.get("eagle_config") or {}
    ids = ec.get("eagle_aux_hidden_state_layer_ids") or cfg.get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids else None


def load_eagle3(path: Path, target: TargetParts, aux_ids: Sequence[int] | None = None) -> Eagle3Head:
    cfg = read_config(path)
    where = f"EAGLE-3 head {path}"
    arch = arch_from_config(cfg, num_layers=1)
    target.check(where, cfg.get("target_hidden_size", arch.hidden_size), cfg.get("vocab_size"))
    sd = _strip_prefix(read_weights(path))
    for name in ("fc.weight", "lm_head.weight", "norm.weight"):
        if name not in sd:
            raise ConfigError(f"{where}: checkpoint lacks {name!r}; is this an EAGLE-3 checkpoint?")
    ids = list(aux_ids) if aux_ids else eagle3_aux_ids(cfg) or list(default_aux_ids(target.num_layers))
    layers = aux_ids_to_layers(ids, target.num_layers)
    draft_vocab = int(cfg.get("draft_vocab_size") or sd["lm_head.weight"].shape[0])
    head = Eagle3Head(arch, _own_embed(sd, target, where), target.hidden_size, draft_vocab, layers)
    if tuple(sd["fc.weight"].shape) != tuple(head.fc.weight.shape):
        raise ConfigError(f"{where}: fc.weight has shape {tuple(sd['fc.weight'].shape)}, expected "
                          f"{tuple(head.fc.weight.shape)} ({len(layers)} target layers of hidden size "
                          f"{target.hidden_size})")
    copy_weight(head.fc.weight, sd["fc.weight"], "fc.weight", where)
    load_layer(head.layer, sd, "midlayer.", where)
    copy_weight(head.hidden_norm.weight, sd.get("midlayer.hidden_norm.weight", torch.ones(arch.hidden_size)),
                "midlayer.hidden_norm.weight", where)
    copy_weight(head.norm.weight, sd["norm.weight"], "norm.weight", where)
    copy_weight(head.lm_head.weight, sd["lm_head.weight"], "lm_head.weight", where)
    if "d2t" in sd:
        d2t = sd["d2t"].to(torch.int64)
        ids_t = torch.arange(draft_vocab) + d2t
        if d2t.shape[0] != draft_vocab or int(ids_t.max()) >= target.vocab_size or int(ids_t.min()) < 0:
            raise ConfigError(f"{where}: d2t maps draft ids outside the target vocabulary "
                              f"(0..{target.vocab_size - 1})")
        head.set_vocab(ids_t)
    elif draft_vocab == target.vocab_size:
        head.set_vocab(torch.arange(draft_vocab))
    else:
        raise ConfigError(f"{where}: draft vocabulary {draft_vocab} != target's {target.vocab_size} and no d2t map")
    if cfg.get("speculum_target_tail"):
        if "tail_map.weight" not in sd:
            raise ConfigError(f"{where}: config.json says speculum_target_tail but the weights lack 'tail_map.weight'")
        head.use_target_tail(target.lm_head)
        copy_weight(head.tail_map.weight, sd["tail_map.weight"], "tail_map.weight", where)
    return head


def eagle3_config(head: Eagle3Head, meta: dict | None = None) -> dict:
    a = head.arch
    cfg = _llama_config(a, EAGLE3_ARCH, 1, meta, draft_vocab_size=int(head.lm_head.weight.shape[0]),
                        target_hidden_size=head.fc.weight.shape[1] // len(head.feature_layers), hidden_act="silu",
                        tie_word_embeddings=False,
                        eagle_config={"eagle_aux_hidden_state_layer_ids": layers_to_aux_ids(head.feature_layers)})
    if head.tail is not None:
        cfg["speculum_target_tail"] = True
    return cfg


def eagle3_state(head: Eagle3Head) -> dict[str, torch.Tensor]:
    sd = {"fc.weight": head.fc.weight.detach(), "norm.weight": head.norm.weight.detach(),
          "lm_head.weight": head.lm_head.weight.detach(), "d2t": head.d2t.clone(), "t2d": head.t2d.clone(),
          "midlayer.hidden_norm.weight": head.hidden_norm.weight.detach()}
    if head.tail is not None:
        sd["tail_map.weight"] = head.tail_map.weight.detach()
    sd.update(layer_state(head.layer, "midlayer."))
    return sd


def save_eagle3(head: Eagle3Head, path: Path, meta: dict | None = None, dtype: torch.dtype | None = None) -> Path:
    return write_checkpoint(path, eagle3_config(head, meta), eagle3_state(head), dtype=dtype)
