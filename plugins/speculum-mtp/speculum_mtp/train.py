"""``speculum train mtp``: an MTP module by self-distillation.

The module is unrolled over ``--num-positions`` steps (from step 2 on it reads its own
output hidden state, as when reused autoregressively) and learns the target's
next-token distributions (soft cross-entropy), step ``j`` weighted ``--step-decay ** j``;
``--reg-weight`` adds EAGLE-1's feature regression (the module's normed output onto the
target's next final normed state), ``--ce-weight`` weighs the token loss beside it.
Its decoder layer starts as a copy of a target layer (``--init-layer``, default the
last; with ``--num-layers L`` the module's layers copy the L target layers ending there),
``eh_proj`` as a pass-through of the hidden state, the head norm as the target's final norm.
``--init-from`` a module with fewer layers than ``--num-layers`` grows it: its layers, then
new ones that add nothing until trained (it drafts as before at first).
"""

from __future__ import annotations

import logging

import attrs
import torch

from speculum.backends.torch.heads import arch_from_config, grow_layers, init_layer
from speculum.errors import ConfigError
from speculum.train.base import Trainer, chain_loss, feature_regression, layer_from_target, layers_to_add, loss_vocab
from speculum_mtp.formats import load_mtp, save_mtp
from speculum_mtp.model import ORDERS, MTPHead

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
log = logging.getLogger(__name__)


def _check_weights(args) -> None:
    if args.ce_weight <= 0 or args.reg_weight < 0:
        raise ConfigError(f"--ce-weight {args.ce_weight} --reg-weight {args.reg_weight}: give the token loss a "
                          "positive weight and the regression 0 or more")


class MTPTrainer(Trainer):
    name = "mtp"
    description = "DeepSeek-V3-style MTP module (enorm/hnorm, eh_proj, decoder layer(s), shared head)"

    def add_arguments(self, p) -> None:
        g = p.add_argument_group("MTP")
        g.add_argument("--num-positions", type=int, default=4, help="autoregressive steps unrolled in training")
        g.add_argument("--step-decay", type=float, default=0.8, help="loss weight of chain step i is decay**i")
        g.add_argument("--concat-order", choices=ORDERS, default="embed_hidden", help="order of [embedding, hidden state] in the MTP input")
        g.add_argument("--init-layer", type=int, default=-1,
                       help="target layer copied into the module's last decoder layer, earlier ones from the layers "
                            "before it (-1: the target's last; -2: random)")
        g.add_argument("--num-layers", type=int, default=1,
                       help="decoder layers in the module (DeepSeek-V3: 1; more is a speculum extension of its "
                            "format, speculum_mtp_num_layers)")
        g.add_argument("--reg-weight", type=float, default=0.0,
                       help="weight of a feature regression beside the token loss: SmoothL1 of the module's normed "
                            "output (its shared head's norm) onto the target's next final normed state, EAGLE-1's "
                            "auxiliary loss (0: none, DeepSeek-V3's loss)")
        g.add_argument("--ce-weight", type=float, default=1.0,
                       help="weight of the token loss beside --reg-weight (EAGLE-1's paper: 0.1 with a regression "
                            "weight of 1, a regression-led phase)")
        g.add_argument("--save-dtype", choices=sorted(DTYPES), default="bfloat16", help="dtype of the exported weights")
        p.set_defaults(lr=1e-3)

    def build(self, args, target, state, data, train_ids):
        _check_weights(args)
        if args.num_layers < 1:
            raise ConfigError(f"--num-layers {args.num_layers}: a module needs at least one decoder layer")
        arch = arch_from_config(target.config, num_layers=args.num_layers)
        head = MTPHead(arch, target.embed, target.lm_head, args.concat_order)
        H = arch.hidden_size
        with torch.no_grad():
            head.eh_proj.weight.normal_(0, 0.01)
            cols = slice(H, 2 * H) if args.concat_order == "embed_hidden" else slice(0, H)
            head.eh_proj.weight[:, cols] += torch.eye(H)
            if "model.norm.weight" in state:
                head.head_norm.weight.copy_(state["model.norm.weight"])
        last = args.init_layer if args.init_layer >= 0 else target.num_layers - 1
        if args.init_layer != -2 and last + 1 < args.num_layers:
            raise ConfigError(f"--init-layer {args.init_layer}: {args.num_layers} decoder layers cannot copy the "
                              f"target's layers up to {last}")
        for i, layer in enumerate(head.layers):
            if args.init_layer == -2:
                init_layer(layer)
            else:
                layer_from_target(layer, state, last - (args.num_layers - 1 - i))
        return head

    def loss(self, head, batch, target, args):
        vocab = loss_vocab(head, target, args)
        return chain_loss(head, batch, target, args, vocab, lambda o: head.logits(o, vocab),
                          feature_regression(batch, args.ce_weight, args.reg_weight, head.head_norm))

    def export(self, head, out, target, args, meta):
        save_mtp(head, out, target.config, meta=meta, dtype=DTYPES[args.save_dtype])

    def load(self, path, target, args):
        """The module at ``path``; with ``--num-layers`` above its own, grown to that many
        decoder layers (its layers, then ones that start as identity maps)."""
        _check_weights(args)
        head = load_mtp(path, target, None, 0)
        if head.concat_order != args.concat_order:
            raise ConfigError(f"--init-from {path}: its concat order is {head.concat_order!r}; pass "
                              f"--concat-order {head.concat_order}")
        if not layers_to_add(path, "the module", head.num_layers, args.num_layers):
            return head
        grown = MTPHead(attrs.evolve(head.arch, num_layers=args.num_layers), head.embed_weight,
                        head.lm_head_weight if head.own_head is None else None, head.concat_order)
        keep = {k: v for k, v in head.state_dict().items() if not k.startswith("layers.")}
        missing, unexpected = grown.load_state_dict(keep, strict=False)
        assert not unexpected and all(k.startswith("layers.") for k in missing), (missing, unexpected)
        grow_layers(grown.layers, head.layers)
        log.info("%s: grown from %d to %d decoder layers (the new ones start as identity maps)", path,
                 head.num_layers, grown.num_layers)
        return grown
