"""``speculum train eagle`` / ``speculum train eagle3``: EAGLE heads by self-distillation.

Both unroll the head over ``--num-positions`` draft steps per anchor (the training-time
test of EAGLE-3: from step 2 on the head reads its own output, as when drafting).

- EAGLE-1 (paper's loss): SmoothL1 regression of the predicted feature onto the target's
  next final normed state, plus ``--ce-weight`` x cross-entropy of the logits (through the
  target's LM head) against the target's next-token distribution.
- EAGLE-3: cross-entropy against the target's distribution restricted to the draft
  vocabulary (``--draft-vocab`` most frequent answer tokens); in validation a target
  token outside that vocabulary counts as a miss.

Step ``j`` is weighted ``--step-decay ** j``. EAGLE-3's decoder layer starts as a copy of
a target layer (``--init-layer``, default the last), EAGLE-1's at random (its layer has
no input norm and lives in the scale of the normed final state).
"""

from __future__ import annotations

import logging

import attrs
import torch

from speculum.backends.torch.heads import arch_from_config, grow_layers
from speculum.errors import ConfigError
from speculum.train.base import (Trainer, chain_loss, feature_regression, frequent_tokens, layer_from_target,
                                 layers_to_add, loss_vocab)
from speculum_eagle.formats import aux_ids_to_layers, default_aux_ids, load_eagle1, load_eagle3, save_eagle1, save_eagle3
from speculum_eagle.model import Eagle1Head, Eagle3Head

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
log = logging.getLogger(__name__)


def _common(p, positions: int = 4, init_layer: int = -1) -> None:
    g = p.add_argument_group("EAGLE")
    g.add_argument("--num-positions", type=int, default=positions, help="draft steps unrolled in training")
    g.add_argument("--step-decay", type=float, default=0.8, help="loss weight of step j is decay**j")
    g.add_argument("--init-layer", type=int, default=init_layer, help="target layer copied into the head "
                   "(-1: the last; -2: random init)")
    g.add_argument("--save-dtype", choices=sorted(DTYPES), default="bfloat16", help="dtype of the exported weights")


def _init_layer(layer, target, state, index: int) -> None:
    from speculum.backends.torch.heads import init_layer
    if index == -2:
        init_layer(layer)
    else:
        layer_from_target(layer, state, index if index >= 0 else target.num_layers - 1)


class EagleTrainer(Trainer):
    name = "eagle"
    description = "EAGLE-1 head: feature regression + token cross-entropy, unrolled over the draft chain"

    def add_arguments(self, p) -> None:
        # random init: EAGLE-1's layer has no input norm and works in the scale of the
        # target's normed final state, not in a target layer's residual stream
        _common(p, init_layer=-2)
        p.add_argument("--ce-weight", type=float, default=0.1, help="weight of the token loss (paper: 0.1)")
        p.add_argument("--reg-weight", type=float, default=1.0, help="weight of the feature regression")
        p.add_argument("--num-layers", type=int, default=1, help="decoder layers of the head (EAGLE: 1)")
        p.set_defaults(lr=1e-3)

    def build(self, args, target, state, data, train_ids):
        arch = arch_from_config(target.config, num_layers=args.num_layers)
        head = Eagle1Head(arch, target.embed, target.lm_head, fc_bias=True)
        H = arch.hidden_size
        with torch.no_grad():  # fc starts by passing the feature through
            head.fc.weight.normal_(0, 0.01)
            head.fc.weight[:, H:] += torch.eye(H)
            head.fc.bias.zero_()
        for layer in head.layers:
            _init_layer(layer, target, state, args.init_layer)
        return head

    def loss(self, head, batch, target, args):
        vocab = loss_vocab(head, target, args)
        return chain_loss(head, batch, target, args, vocab, lambda o: head.logits(o, vocab),
                          feature_regression(batch, args.ce_weight, args.reg_weight))  # the paper's loss

    def export(self, head, out, target, args, meta):
        save_eagle1(head, out, meta=meta, dtype=DTYPES[args.save_dtype])

    def load(self, path, target, args):
        """The checkpoint at ``path``; with ``--num-layers`` above its own, grown to that many
        layers: its layers first, then layers whose output projections (attention and MLP) start
        at zero, so each adds nothing to the residual stream until trained. The grown head drafts
        exactly as the checkpoint's did at first: depth is added to a head without losing the
        training already in it (``--keep-best`` then exports it only if it got better)."""
        head = load_eagle1(path, target)
        if not layers_to_add(path, "the head", head.num_layers, args.num_layers):
            return head
        grown = Eagle1Head(attrs.evolve(head.arch, num_layers=args.num_layers), head.embed_weight,
                           head.lm_head_weight, fc_bias=head.fc.bias is not None)
        grown.fc.load_state_dict(head.fc.state_dict())
        grow_layers(grown.layers, head.layers)
        log.info("%s: grown from %d to %d layers (the new ones start as identity maps)", path, head.num_layers,
                 grown.num_layers)
        return grown


class Eagle3Trainer(Trainer):
    name = "eagle3"
    description = "EAGLE-3 head: fused low/mid/high features, reduced vocabulary, training-time test"

    def add_arguments(self, p) -> None:
        _common(p)
        p.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size")
        p.add_argument("--draft-tail", action="store_true",
                       help="draft every target token: the draft vocabulary through the head's own LM head, every "
                            "other token through the target's (shared, not stored; the loss then covers the whole "
                            "vocabulary). A head trained without it grows one (--init-from)")
        p.set_defaults(loss_vocab=0)  # the draft vocabulary is the loss vocabulary
        p.add_argument("--aux-layers", default=None,
                       help="comma separated aux layer ids (inputs of target layers, as vLLM); default 2,L/2,L-3")
        p.set_defaults(lr=1e-3)

    def _layers(self, args, L: int) -> tuple[int, ...]:
        ids = [int(x) for x in args.aux_layers.split(",")] if getattr(args, "aux_layers", None) else default_aux_ids(L)
        return aux_ids_to_layers(ids, L)

    def data_layers(self, args, num_target_layers):
        return tuple(sorted(set(self._layers(args, num_target_layers)) | {-1}))

    def build(self, args, target, state, data, train_ids):
        arch = arch_from_config(target.config, num_layers=1)
        V, Vd = target.vocab_size, min(args.draft_vocab, target.vocab_size)
        layers = self._layers(args, target.num_layers)
        head = Eagle3Head(arch, target.embed, target.hidden_size, Vd, layers)
        ids = frequent_tokens(data, train_ids, Vd, V)  # the most frequent answer tokens
        head.set_vocab(ids)
        H = arch.hidden_size
        with torch.no_grad():
            head.fc.weight.normal_(0, 0.01)
            head.fc.weight[:, -H:] += torch.eye(H)  # start from the highest fused layer
            head.lm_head.weight.copy_(target.lm_head[ids].float())
            norm = state.get("model.norm.weight")
            if norm is not None:
                head.norm.weight.copy_(norm)
        _init_layer(head.layer, target, state, args.init_layer)
        if args.draft_tail:
            head.use_target_tail(target.lm_head)
        return head

    def loss(self, head, batch, target, args):
        # the target's distribution over the draft vocabulary (all of it with the target's
        # tail); validation compares with its argmax over the whole vocabulary (a token outside
        # the draft vocabulary is a miss)
        return chain_loss(head, batch, target, args, None if head.tail is not None else head.draft_to_target,
                          head.draft_logits)

    def export(self, head, out, target, args, meta):
        save_eagle3(head, out, meta=meta, dtype=DTYPES[args.save_dtype])

    def load(self, path, target, args):
        ids = [int(x) for x in args.aux_layers.split(",")] if getattr(args, "aux_layers", None) else None
        head = load_eagle3(path, target, ids)
        if head.tail is not None and not args.draft_tail:
            raise ConfigError(f"{path} drafts every token through the target's LM head (speculum_target_tail); "
                              "continue it with --draft-tail (without it that part would be dropped)")
        if head.tail is None and args.draft_tail:  # grown: the map fitted to the head's own rows
            head.use_target_tail(target.lm_head)
            head.fit_tail_map()
        return head
