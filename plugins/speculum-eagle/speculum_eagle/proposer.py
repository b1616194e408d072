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
    ``draft_tail``: with a head trained with ``--draft-tail``, whether it drafts every token
    (True) or its own draft vocabulary only (False: one cheaper product a draft step); None =
    on a GPU only. Measured with the shipped head, chain k=4: on the H200 the tail gives MAL
    2.46 against 2.35 at the same speed (1.54x against 1.47x autoregressive decoding); on a
    CPU (fp32, one thread) MAL 2.06 against 1.98 but 0.83x against 1.00x, the full-vocabulary
    product of every draft step costing more than the tokens outside gain."""

    aux_hidden_state_layer_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_ids)
    draft_tail: bool | None = None


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
    if not (opts.draft_tail if opts.draft_tail is not None else target.embed.device.type == "cuda"):
        head.drop_tail()
    head.fold_tail()
    log.info("EAGLE-3 head %s: features from target layers %s, draft vocabulary %d", path,
             head.feature_layers, head.lm_head.weight.shape[0])
    return ChainHeadProposer.for_head(ctx, head, head.feature_layers, name="eagle3")


