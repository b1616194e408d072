"""``speculum train draft``: a small standalone Llama that drafts for its target.

The draft has the target's tokenizer, vocabulary and width, and ``--num-layers`` decoder
layers copied from evenly spaced target layers (first and last included), with the
target's embedding, final norm and LM head. It learns the target's next-token
distribution on the distillation data (teacher forcing, soft cross-entropy) and is saved
as a transformers directory (with the target's tokenizer), usable as
``{"method": "draft_model", "model": <out>}``.
"""

from __future__ import annotations

import shutil

import torch

from speculum.train.base import TargetDist, Trainer, agreement, loss_vocab, soft_ce

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "generation_config.json")


def spaced(n: int, L: int) -> list[int]:
    """``n`` target layer indices evenly spread over ``0..L-1`` (first and last included)."""
    if n == 1:
        return [L - 1]
    return [round(i * (L - 1) / (n - 1)) for i in range(n)]


class DraftTrainer(Trainer):
    name = "draft"
    description = "a small standalone Llama (target's tokenizer and embeddings) trained on the target's outputs"

    def add_arguments(self, p) -> None:
        g = p.add_argument_group("draft model")
        g.add_argument("--num-layers", type=int, default=2, help="decoder layers of the draft")
        g.add_argument("--save-dtype", choices=sorted(DTYPES), default="bfloat16", help="dtype of the exported weights")
        p.set_defaults(lr=3e-4)

    def positions(self, args) -> int:
        return 1  # a standalone model sees true tokens: one conditional accuracy

    def build(self, args, target, state, data, train_ids):
        from transformers import AutoConfig, AutoModelForCausalLM
        cfg = dict(target.config)
        L = int(cfg["num_hidden_layers"])
        cfg["num_hidden_layers"] = args.num_layers
        for k in ("layer_types", "_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype"):
            cfg.pop(k, None)
        config = AutoConfig.for_model(cfg.pop("model_type", "llama"), **cfg)
        model = AutoModelForCausalLM.from_config(config)
        sd = {}
        for i, src in enumerate(spaced(args.num_layers, L)):
            pre = f"model.layers.{src}."
            sd.update({f"model.layers.{i}." + k[len(pre):]: v for k, v in state.items() if k.startswith(pre)})
        for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            if k in state:
                sd[k] = state[k]
        missing, unexpected = model.load_state_dict(sd, strict=False)
        bad = [m for m in missing if m != "lm_head.weight" or not config.tie_word_embeddings]
        if bad or unexpected:
            raise RuntimeError(f"draft init from the target: missing {bad}, unexpected {unexpected}")
        model.config.speculum_init_layers = spaced(args.num_layers, L)
        return model.float()

    def loss(self, model, batch, target, args):
        vocab = loss_vocab(model, target, args)
        td = TargetDist(batch, target.lm_head, args.loss_on, vocab=vocab, full=not model.training)
        m = batch.target_mask(0, args.loss_on)
        h = model.model(input_ids=batch.tokens).last_hidden_state[m]  # [N, H]
        w = model.lm_head.weight if vocab is None else model.lm_head.weight[vocab]
        logits = torch.nn.functional.linear(h, w)
        rows = td.rows(0, m)
        pred = logits.argmax(-1)
        c, n = agreement(pred if vocab is None else vocab[pred], td.argmax[rows])
        return soft_ce(logits, td.probs[rows]), c.view(1), n.view(1)

    def export(self, model, out, target, args, meta):
        import json
        from speculum.model_source import resolve_model_path
        model.config.speculum = meta
        model.to(DTYPES[args.save_dtype]).save_pretrained(str(out))
        model.float()
        src = resolve_model_path(args.model)
        for f in TOKENIZER_FILES:
            if (src / f).exists():
                shutil.copy(src / f, out / f)
        cfg = json.loads((out / "config.json").read_text())
        cfg.setdefault("architectures", ["LlamaForCausalLM"])
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
