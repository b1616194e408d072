"""The ``mtp`` proposer: a DeepSeek-V3-style MTP module reused autoregressively.

Where the module comes from: ``model`` in the speculative config; else the target's own
checkpoint when it has MTP layers (``num_nextn_predict_layers``); else the module shipped
for the default target.
"""

from __future__ import annotations

import logging
from pathlib import Path

import attrs

from speculum.backends.torch.heads import ChainHeadProposer, TargetParts, head_checkpoint_path
from speculum_mtp.formats import has_mtp, load_mtp
from speculum_mtp.model import ORDERS

log = logging.getLogger(__name__)

HEADS = Path(__file__).resolve().parent / "heads"


@attrs.frozen
class MTPOptions:
    """``concat_order``: ``embed_hidden`` (DeepSeek-V3's weights, the default) or
    ``hidden_embed`` (its paper's equation); None = what the checkpoint says.
    ``layer``: which MTP module of the checkpoint to use (0 = the first)."""

    concat_order: str | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.in_(ORDERS)))
    layer: int = attrs.field(default=0, validator=attrs.validators.ge(0))


def make_mtp(ctx) -> ChainHeadProposer:
    opts = ctx.options or MTPOptions()
    if not ctx.config.model and ctx.target_path is not None and has_mtp(Path(ctx.target_path)):
        path = Path(ctx.target_path)
    else:
        path = head_checkpoint_path(ctx, "mtp", HEADS)
    target = TargetParts.from_runner(ctx.target)
    head = load_mtp(path, target, opts.concat_order, opts.layer)
    head = head.to(device=target.embed.device, dtype=target.embed.dtype).eval().requires_grad_(False)
    log.info("MTP module from %s (concat order %s)", path, head.concat_order)
    return ChainHeadProposer.for_head(ctx, head, (-1,), name="mtp")
