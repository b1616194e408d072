"""``speculum train draft``: a small standalone Llama that drafts for its target.

The draft has the target's tokenizer and vocabulary, ``--num-layers`` decoder layers and
a width of the caller's choosing (``--hidden-size`` ...; or ``--shape FILE``, the shape
:mod:`speculum.train.draft_shapes` recommends from step costs measured on the device).

- Same width as the target: its layers start as copies of evenly spaced target layers
  (first and last included), with the target's embedding, final norm and LM head; the
  embedding and LM head stay frozen (``--train-embeddings`` trains them too); a wider MLP
  (``--intermediate-size`` above the target's: on a GPU at batch 1 a layer's cost is mostly
  launches, so width is nearly free) starts with the target's units first and the extra
  units' output columns at zero;
  ``--embeddings-from-target`` saves it without them (:func:`speculum.model_source.complete_draft`
  puts the target's back where it is loaded: the draft_model proposer, ``--init-from``).
- Another width: the embedding and LM head are the target's projected onto their top
  principal directions (``E @ P``, ``P`` [H_target, H] from the SVD of the embedding),
  trained with the rest; the layers start at random.

It learns the target's next-token distribution on the distillation data (teacher
forcing, soft cross-entropy) and is saved as a transformers directory (with the target's
tokenizer), usable as ``{"method": "draft_model", "model": <out>}``. Validation reports
agreement and the acceptance length of a ``--num-positions``-token greedy chain.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

from speculum.errors import ConfigError
from speculum.train.base import TargetDist, Trainer, chain_score, loss_vocab, scatter_rows, scored_ce

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "generation_config.json")
SHAPE_KEYS = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads")
log = logging.getLogger(__name__)


def spaced(n: int, L: int) -> list[int]:
    """``n`` target layer indices evenly spread over ``0..L-1`` (first and last included)."""
    if n == 1:
        return [L - 1]
    return [round(i * (L - 1) / (n - 1)) for i in range(n)]


def draft_shape(args, target_cfg: dict) -> dict[str, int]:
    """The draft's shape: explicit options, else ``--shape``'s recommendation, else the shape of
    the ``--init-from`` checkpoint (a draft continued as it is), else the target's width with
    ``--num-layers`` layers. Heads keep the target's head size and its query / KV head ratio
    unless given."""
    from_file = {}
    if getattr(args, "shape", None):
        p = Path(args.shape)
        if not p.exists():
            raise ConfigError(f"--shape {p}: no such file; run `python -m speculum.train.draft_shapes --json {p}` "
                              "on the device first")
        doc = json.loads(p.read_text())
        from_file = doc.get("recommended", doc)
    elif getattr(args, "init_from", None) and (Path(args.init_from) / "config.json").exists():
        from_file = config_shape(json.loads((Path(args.init_from) / "config.json").read_text()))
    Ht = int(target_cfg["hidden_size"])
    heads_t = int(target_cfg["num_attention_heads"])
    kv_t = int(target_cfg.get("num_key_value_heads") or heads_t)
    head_dim = int(target_cfg.get("head_dim") or Ht // heads_t)

    def pick(key: str, default):
        v = getattr(args, key, None)
        return int(v) if v else int(from_file.get(key) or default)
    H = pick("hidden_size", Ht)
    heads = pick("num_heads", max(1, H // head_dim))
    kv = pick("num_kv_heads", max(1, heads * kv_t // heads_t))
    inter_default = int(target_cfg["intermediate_size"]) if H == Ht else 64 * round(H * 8 / 3 / 64)
    shape = {"num_layers": pick("num_layers", 2), "hidden_size": H,
             "intermediate_size": pick("intermediate_size", inter_default), "num_heads": heads, "num_kv_heads": kv}
    if H % heads or heads % kv:
        raise ConfigError(f"draft shape {shape}: hidden_size must be a multiple of num_heads, and num_heads of "
                          "num_kv_heads")
    return shape


def config_shape(cfg) -> dict[str, int | None]:
    """The :data:`SHAPE_KEYS` of a Llama config (``config.json`` as a dict; KV heads default to
    the query heads, as transformers reads it)."""
    heads = cfg.get("num_attention_heads")
    return {"num_layers": cfg.get("num_hidden_layers"), "hidden_size": cfg.get("hidden_size"),
            "intermediate_size": cfg.get("intermediate_size"), "num_heads": heads,
            "num_kv_heads": cfg.get("num_key_value_heads") or heads}


def widened(own: torch.Tensor, src: torch.Tensor, name: str) -> torch.Tensor:
    """``src`` in a tensor of ``own``'s shape when an MLP has more units than ``src`` has: its units
    first, the extra units' gate and up rows as ``own`` has them (freshly initialised), their
    ``down_proj`` columns zero, so they add nothing until trained. Same shape: ``src``."""
    if tuple(own.shape) == tuple(src.shape):
        return src
    w = own.clone() if name.endswith(("gate_proj.weight", "up_proj.weight")) else torch.zeros_like(own)
    w[tuple(slice(0, n) for n in src.shape)] = src.to(w.dtype)
    return w


def projection(embed: torch.Tensor, width: int) -> torch.Tensor:
    """[H_target, width]: the top ``width`` right singular vectors of the embedding [V, H_target]."""
    _, _, vh = torch.linalg.svd(embed.float(), full_matrices=False)
    return vh[:width].T.contiguous()


class DraftTrainer(Trainer):
    name = "draft"
    description = "a small standalone Llama (target's tokenizer and vocabulary) trained on the target's outputs"

    def add_arguments(self, p) -> None:
        g = p.add_argument_group("draft model")
        g.add_argument("--num-layers", type=int, default=None, help="decoder layers of the draft (default 2)")
        g.add_argument("--hidden-size", type=int, default=None, help="width (default: the target's)")
        g.add_argument("--intermediate-size", type=int, default=None,
                       help="MLP width (default: the target's at its width, else 8/3 x width)")
        g.add_argument("--num-heads", type=int, default=None, help="attention heads (default: the target's head size)")
        g.add_argument("--num-kv-heads", type=int, default=None, help="KV heads (default: the target's ratio)")
        g.add_argument("--shape", default=None, metavar="JSON",
                       help="the shape recommended in a `python -m speculum.train.draft_shapes` result "
                            "(options given explicitly win)")
        g.add_argument("--train-embeddings", action="store_true",
                       help="also train the embedding and LM head (always trained when the width differs)")
        g.add_argument("--embeddings-from-target", action="store_true",
                       help="save the draft without its embedding and LM head (the target's, frozen: same width, "
                            "no --train-embeddings); they are put back from the target when the draft is loaded "
                            "(14 MB instead of 71 for a 2-layer SmolLM2-135M draft in bf16)")
        g.add_argument("--num-positions", type=int, default=4,
                       help="chain length the validation acceptance figures are for")
        g.add_argument("--save-dtype", choices=sorted(DTYPES), default="bfloat16", help="dtype of the exported weights")
        p.set_defaults(lr=3e-4)

    def build(self, args, target, state, data, train_ids):
        from transformers import AutoConfig, AutoModelForCausalLM
        cfg = dict(target.config)
        L = int(cfg["num_hidden_layers"])
        shape = draft_shape(args, cfg)
        same_width = shape["hidden_size"] == int(cfg["hidden_size"])
        if getattr(args, "embeddings_from_target", False) and (not same_width or args.train_embeddings):
            raise ConfigError("--embeddings-from-target saves the draft without the target's embedding and LM head, "
                              "so they must stay the target's: a draft of the target's width "
                              f"({cfg['hidden_size']}, this one {shape['hidden_size']}) without --train-embeddings")
        cfg.update(num_hidden_layers=shape["num_layers"], hidden_size=shape["hidden_size"],
                   intermediate_size=shape["intermediate_size"], num_attention_heads=shape["num_heads"],
                   num_key_value_heads=shape["num_kv_heads"], head_dim=shape["hidden_size"] // shape["num_heads"])
        for k in ("layer_types", "_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype"):
            cfg.pop(k, None)
        torch.manual_seed(args.seed)
        config = AutoConfig.for_model(cfg.pop("model_type", "llama"), **cfg)
        model = AutoModelForCausalLM.from_config(config)
        target_shape = {k: int(v) for k, v in config_shape(target.config).items() if k != "num_layers"}
        # the target's attention shape and an MLP at least as wide: the layers start as the target's (a wider
        # MLP's extra units with a zero output column, so the draft starts as the target-shaped one would)
        It = target_shape["intermediate_size"]
        copy_layers = all(shape[k] == v for k, v in target_shape.items() if k != "intermediate_size") and \
            shape["intermediate_size"] >= It
        sd = {k: v for k, v in state.items() if k in ("model.embed_tokens.weight", "lm_head.weight")}
        if copy_layers:  # evenly spaced target layers, the target's final norm
            layers = spaced(shape["num_layers"], L)
            own = model.state_dict()
            for i, src in enumerate(layers):
                pre = f"model.layers.{src}."
                for k, v in state.items():
                    if k.startswith(pre):
                        name = f"model.layers.{i}." + k[len(pre):]
                        sd[name] = widened(own[name], v, name)  # a wider MLP: the target's units first
            if "model.norm.weight" in state:
                sd["model.norm.weight"] = state["model.norm.weight"]
            model.config.speculum_init_layers = layers
        if not same_width:  # the target's embedding / LM head, projected onto its top directions
            P = projection(state["model.embed_tokens.weight"], shape["hidden_size"])  # [Ht, H]
            sd = {k: v.float() @ P for k, v in sd.items()}
        missing, unexpected = model.load_state_dict(sd, strict=False)
        allowed = {"lm_head.weight"} if config.tie_word_embeddings else set()
        if not copy_layers:  # random layers and final norm
            allowed |= {k for k in model.state_dict() if k.startswith("model.layers.") or k == "model.norm.weight"}
        bad = [m for m in missing if m not in allowed]
        if bad or unexpected:
            raise RuntimeError(f"draft init from the target: missing {bad}, unexpected {unexpected}")
        model.config.speculum_shape = shape
        model = model.float()
        if same_width and not args.train_embeddings:  # the target's own: keep them
            model.get_input_embeddings().weight.requires_grad_(False)
            model.get_output_embeddings().weight.requires_grad_(False)
        return model

    def load(self, path, target, args):
        """A draft saved by this trainer (or any transformers Llama of the same shape), for
        ``--init-from``; one saved without the target's embedding gets it back first. Asked for
        a wider MLP than the checkpoint's (``--intermediate-size``) or more layers
        (``--num-layers``), the rest of the shape its own, it grows: its units first, the extra
        ones adding nothing until trained; its layers first, then copies of its last layer whose
        attention and MLP output projections start at zero (each adds nothing to the residual
        stream until trained). Either way the grown draft drafts exactly as the checkpoint."""
        from transformers import AutoModelForCausalLM

        from speculum.model_source import complete_draft, resolve_model_path
        full = complete_draft(path, resolve_model_path(args.model))
        draft = AutoModelForCausalLM.from_pretrained(str(full), dtype=torch.float32)
        want, have = draft_shape(args, dict(target.config)), config_shape(draft.config.to_dict())
        grows = ("intermediate_size", "num_layers")
        if all(want[k] <= have[k] for k in grows) or any(want[k] != have[k] for k in have if k not in grows):
            return draft  # the same shape (or one it cannot grow into: the loop says what differs)
        import copy
        config = copy.deepcopy(draft.config)
        config.intermediate_size = max(want["intermediate_size"], have["intermediate_size"])
        config.num_hidden_layers = max(want["num_layers"], have["num_layers"])
        torch.manual_seed(args.seed)
        grown = AutoModelForCausalLM.from_config(config).float()
        own = grown.state_dict()
        src = draft.state_dict()
        last = have["num_layers"] - 1
        for i in range(have["num_layers"], config.num_hidden_layers):  # copies of the last layer, outputs at zero
            for k, v in list(src.items()):
                if k.startswith(f"model.layers.{last}."):
                    src[k.replace(f"model.layers.{last}.", f"model.layers.{i}.", 1)] = \
                        torch.zeros_like(v) if k.endswith(("o_proj.weight", "down_proj.weight")) else v
        grown.load_state_dict({k: widened(own[k], v, k) for k, v in src.items()})
        log.info("%s: grown from %d layers of %d MLP units to %d of %d (the new parts add nothing until trained)",
                 path, have["num_layers"], have["intermediate_size"], config.num_hidden_layers,
                 config.intermediate_size)
        return grown

    def loss(self, model, batch, target, args):
        vocab = loss_vocab(model, target, args)
        td = TargetDist(batch, target.lm_head, args.loss_on, vocab=vocab, full=not model.training)
        m = batch.target_mask(0, args.loss_on)  # [B, T]
        h = model.model(input_ids=batch.tokens).last_hidden_state[m]  # [N, H]
        w = model.lm_head.weight if vocab is None else model.lm_head.weight[vocab]
        rows = td.rows(0, m)
        ce, pred = scored_ce(lambda x: torch.nn.functional.linear(x, w), h, td.probs, rows)
        ok = scatter_rows(m, (pred if vocab is None else vocab[pred]) == td.argmax[rows])  # [B, T]
        # a chain from anchor t (x_{t+1} known) drafts from positions t + 1, t + 2, ...: the
        # same teacher-forced predictions, shifted (on a greedy answer, accepted drafts are
        # its tokens)
        K = args.num_positions
        score = chain_score([ok[:, j + 1:] for j in range(K)], [m[:, j + 1:] for j in range(K)], batch.greedy,
                            None if model.training else batch.valid)
        return ce, score

    def export(self, model, out, target, args, meta):
        from speculum.model_source import TARGET_EMBEDDING_KEYS, resolve_model_path
        shared = bool(getattr(args, "embeddings_from_target", False))
        model.config.speculum = {**meta, "embeddings_from_target": True} if shared else meta
        model.to(DTYPES[args.save_dtype])
        # shared: the target's frozen tensors left out (speculum.model_source.complete_draft puts them back)
        state = {k: v for k, v in model.state_dict().items() if k not in TARGET_EMBEDDING_KEYS} if shared else None
        model.save_pretrained(str(out), state_dict=state)
        model.float()
        src = resolve_model_path(args.model)
        for f in TOKENIZER_FILES:
            if (src / f).exists():
                shutil.copy(src / f, out / f)
        cfg = json.loads((out / "config.json").read_text())
        cfg.setdefault("architectures", ["LlamaForCausalLM"])
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
