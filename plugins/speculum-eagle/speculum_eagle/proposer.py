"""The ``eagle`` and ``eagle3`` proposers: load a head, then chain-draft with it.

With no ``model`` in the speculative config, the head shipped for the target (the
default SmolLM2-135M-Instruct) is used; any other target needs a checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path

import attrs

from speculum.backends.torch.heads import ChainHeadProposer, TargetParts, head_checkpoint_path
from speculum_eagle.formats import load_eagle1, load_eagle3

log = logging.getLogger(__name__)

#: heads shipped as package data (one directory each)
HEADS = Path(__file__).resolve().parent / "heads"


def _ids(value):
    return None if value is None else tuple(int(v) for v in value)


@attrs.frozen
class Eagle3Options:
    """``aux_hidden_state_layer_ids``: target layers whose inputs are fused (vLLM's ids,
    i.e. the outputs of layers ``id - 1``); None = the checkpoint's, else (2, L//2, L-3).
    ``draft_tail``: with a head trained with ``--draft-tail``, False drafts from its own
    draft vocabulary only (a cheaper draft step where the full-vocabulary product costs
    more than the tokens outside gain, as on a CPU)."""

    aux_hidden_state_layer_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_ids)
    draft_tail: bool = attrs.field(default=True, converter=bool)


def _ready(head, target: TargetParts):
    return head.to(device=target.embed.device, dtype=target.embed.dtype).eval().requires_grad_(False)


def make_eagle(ctx) -> ChainHeadProposer:
    """EAGLE-1: features are the target's final normed hidden states."""
    path = head_checkpoint_path(ctx, "eagle", HEADS)
    target = TargetParts.from_runner(ctx.target)
    head = _ready(load_eagle1(path, target), target)
    log.info("EAGLE head %s: %d layer(s)", path, head.num_layers)
    return ChainHeadProposer.for_head(ctx, head, (-1,), name="eagle")


def make_eagle3(ctx) -> ChainHeadProposer:
    """EAGLE-3: features fuse three target layers; drafts come from a reduced vocabulary."""
    path = head_checkpoint_path(ctx, "eagle3", HEADS)
    target = TargetParts.from_runner(ctx.target)
    opts = ctx.options or Eagle3Options()
    head = _ready(load_eagle3(path, target, opts.aux_hidden_state_layer_ids), target)
    if not opts.draft_tail:
        head.drop_tail()
    head.fold_tail()
    log.info("EAGLE-3 head %s: features from target layers %s, draft vocabulary %d", path,
             head.feature_layers, head.lm_head.weight.shape[0])
    return ChainHeadProposer.for_head(ctx, head, head.feature_layers, name="eagle3")


