"""Hidden-state draft heads on the torch backend: the public building blocks of EAGLE,
EAGLE-3, MTP and Medusa (what their plugins import).

Layers (:mod:`~speculum.backends.torch.heads.layers`)
    :class:`HeadDecoderLayer` (a Llama decoder layer for inference and training),
    :class:`RMSNorm`, :class:`Rope`, :class:`TrainContext` (EAGLE-3's training-time test),
    :func:`arch_from_config` (a :class:`LlamaArch` from a ``config.json`` dict),
    :func:`layer_state` / :func:`load_layer` (Hugging Face Llama weight names),
    :func:`copy_weight` (shape-checked copy) and :func:`init_layer` (random init).
    :class:`LlamaArch` is the backend's Llama-family config, re-exported.
The head's KV cache (:mod:`~speculum.backends.torch.heads.cache`)
    :class:`HeadKVCache` (one more paged cache group in the backend's memory plan) and
    :class:`PagedContext` (a head forward's attention over it).
Drafting (:mod:`~speculum.backends.torch.heads.proposer`, :mod:`~speculum.backends.torch.heads.graph`)
    :class:`ChainHeadProposer` drafts chains or token trees with any :class:`ChainHead`;
    :class:`TargetParts` / :func:`target_weights` (the target's embedding and LM head,
    shared), :func:`head_checkpoint_path` (a configured or shipped head),
    :func:`pick_tokens` (greedy or sampled drafts from logits). :class:`HeadDraftGraphs`
    and :class:`HeadTreeGraphs` are the static-shape (CUDA-graphed) greedy chain and tree
    drafting, :class:`HeadExpander` a head as a tree :class:`~speculum.proposers.tree.Expander`,
    :func:`head_topk` / :func:`greedy_tokens` a head's best tokens. :class:`GraphPool`,
    :class:`StaticGraph` and :func:`bucket` (the batch buckets of :data:`BATCH_BUCKETS`)
    capture a plugin's own static drafting function the same way (Medusa's).

Backend-neutral pieces stay in :mod:`speculum.proposers`: checkpoints
(:mod:`speculum.proposers.head_checkpoint`) and tree builders (:mod:`speculum.proposers.tree`).
The submodules are this package's layout, not its API: import from here.
"""

from speculum.backends.torch.graphs import BATCH_BUCKETS, GraphPool, StaticGraph, bucket
from speculum.backends.torch.heads.cache import HeadKVCache, PagedContext
from speculum.backends.torch.heads.graph import (HeadDraftGraphs, HeadExpander, HeadTreeGraphs, greedy_tokens,
                                                 head_topk)
from speculum.backends.torch.heads.layers import (HeadAttention, HeadDecoderLayer, RMSNorm, Rope, TrainContext,
                                                  arch_fields, arch_from_config, copy_weight, grow_layers, init_layer,
                                                  layer_state, load_layer, rope_cos_sin)
from speculum.backends.torch.heads.proposer import (ChainHead, ChainHeadProposer, TargetParts,
                                                    head_checkpoint_path, pick_tokens, target_weights)
from speculum.backends.torch.native.arch import LlamaArch
from speculum.backends.torch.native.kernels import topk, topk_logprobs

__all__ = [
    # layers
    "HeadAttention", "HeadDecoderLayer", "LlamaArch", "RMSNorm", "Rope", "TrainContext", "arch_fields",
    "arch_from_config", "copy_weight", "grow_layers", "init_layer", "layer_state", "load_layer", "rope_cos_sin",
    # the head's KV cache
    "HeadKVCache", "PagedContext",
    # drafting
    "ChainHead", "ChainHeadProposer", "TargetParts", "head_checkpoint_path", "pick_tokens", "target_weights",
    "HeadDraftGraphs", "HeadExpander", "HeadTreeGraphs", "greedy_tokens", "head_topk", "topk", "topk_logprobs",
    "BATCH_BUCKETS", "GraphPool", "StaticGraph", "bucket",
]
