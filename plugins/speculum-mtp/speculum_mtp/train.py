"""``speculum train mtp``: an MTP module by self-distillation.

The module is unrolled over ``--num-positions`` steps (from step 2 on it reads its own
output hidden state, as when reused autoregressively) and learns the target's
next-token distributions (soft cross-entropy), step ``j`` weighted ``--step-decay ** j``.
Its decoder layer starts as a copy of a target layer (``--init-layer``, default the
last), ``eh_proj`` as a pass-through of the hidden state, the head norm as the
target's final norm.
"""

from __future__ import annotations

import torch

from speculum.backends.torch.heads import arch_from_config, init_layer
from speculum.train.base import Trainer, chain_loss, layer_from_target, loss_vocab
from speculum_mtp.formats import load_mtp, save_mtp
from speculum_mtp.model import ORDERS, MTPHead

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class MTPTrainer(Trainer):
    name = "mtp"
    description = "DeepSeek-V3-style MTP module (enorm/hnorm, eh_proj, one decoder layer, shared head)"

    def add_arguments(self, p) -> None:
        g = p.add_argument_group("MTP")
        g.add_argument("--num-positions", type=int, default=4, help="autoregressive steps unrolled in training")
        g.add_argument("--step-decay", type=float, default=0.8, help="loss weight of chain step i is decay**i")
        g.add_argument("--concat-order", choices=ORDERS, default="embed_hidden", help="order of [embedding, hidden state] in the MTP input")
        g.add_argument("--init-layer", type=int, default=-1, help="target layer copied in (-1: last; -2: random)")
        g.add_argument("--save-dtype", choices=sorted(DTYPES), default="bfloat16", help="dtype of the exported weights")
        p.set_defaults(lr=1e-3)

    def build(self, args, target, state, data, train_ids):
        arch = arch_from_config(target.config, num_layers=1)
        head = MTPHead(arch, target.embed, target.lm_head, args.concat_order)
        H = arch.hidden_size
        with torch.no_grad():
            head.eh_proj.weight.normal_(0, 0.01)
            cols = slice(H, 2 * H) if args.concat_order == "embed_hidden" else slice(0, H)
            head.eh_proj.weight[:, cols] += torch.eye(H)
            if "model.norm.weight" in state:
                head.head_norm.weight.copy_(state["model.norm.weight"])
        if args.init_layer == -2:
            init_layer(head.layer)
        else:
            layer_from_target(head.layer, state, args.init_layer if args.init_layer >= 0 else target.num_layers - 1)
        return head

    def loss(self, head, batch, target, args):
        vocab = loss_vocab(head, target, args)
        return chain_loss(head, batch, target, args, vocab, lambda o: head.logits(o, vocab))

    def export(self, head, out, target, args, meta):
        save_mtp(head, out, target.config, meta=meta, dtype=DTYPES[args.save_dtype])

    def load(self, path, target, args):
        head = load_mtp(path, target, None, 0)
        if head.concat_order != args.concat_order:
            from speculum.errors import ConfigError
            raise ConfigError(f"--init-from {path}: its concat order is {head.concat_order!r}; pass "
                              f"--concat-order {head.concat_order}")
        return head
