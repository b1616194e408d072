"""Greedy Medusa drafting as one static-shape function (a CUDA graph per batch bucket).

Eagerly, a greedy chain of four drafts is four heads' residual blocks, LM heads and
argmaxes plus the glue around them, launched one kernel at a time from Python: about
1.5 ms a step on the H200 at batch 1, as much as the target's verify forward
(docs/benchmarks.md, ninth session). Here the whole draft of a batch is one function of
a static buffer of target states ``x`` [Bb, H]:

- chains: the argmax of each head, ``[Bb, k]``;
- trees: the tree's tokens, parents, depths and ancestor matrix, ``[Bb, 3N + N*N]``
  (Medusa's own tree decoding, :class:`MedusaExpander`), so no
  tree bookkeeping is left to the host.

Token-aware heads also read each row's last token ``tok`` [Bb] (a second static input);
sequential heads read each head's draft in the next one (chains: one loop over the heads;
trees: each frontier node's features from its parent's and its token).
It is captured once per batch bucket and replayed after one device copy of the inputs.
With ``use_graphs=False`` (CPU, tests) the same function runs eagerly, so the CPU tests
check what the graph computes. Sampled drafts and logits processors stay on the eager
path of the proposer.
"""

from __future__ import annotations

import torch

from speculum.backends.torch.heads import GraphPool, StaticGraph, bucket, topk, topk_logprobs
from speculum.proposers.tree import StaticPlan, draft_tree, packed_tree
from speculum.tree import TreeSpec


class MedusaExpander:
    """Medusa heads as a :class:`speculum.proposers.tree.Expander` (head ``level`` gives
    depth ``level + 1``): a node's children depend only on its depth, or, for sequential
    heads, on its path too (the features of each frontier node, from its parent's)."""

    def __init__(self, heads, x: torch.Tensor):
        self.heads, self.x, self.device = heads, x, x.device  # x: [R, H] the heads' features
        self.frontier = x.unsqueeze(1)  # sequential heads: the last frontier's features [R, F, H]

    #: frontiers and nodes of dynamic trees chosen by the fused top-k on CUDA
    topk = staticmethod(topk)

    def root(self, width: int):
        return topk_logprobs(self.heads.logits(0, self.x), width)

    def expand(self, level, parent, tokens, vis, slots, width):
        if self.heads.sequential:  # [R, F, H]: the parents' features, each advanced by its node's token
            up = self.frontier.gather(1, parent.unsqueeze(-1).expand(-1, -1, self.frontier.shape[-1]))
            self.frontier = self.heads.advance(level - 1, up, tokens)
            return topk_logprobs(self.heads.logits(level, self.frontier), width)
        lp, ids = topk_logprobs(self.heads.logits(level, self.x), width)  # [R, width]
        F = tokens.shape[1]
        return lp.unsqueeze(1).expand(-1, F, -1), ids.unsqueeze(1).expand(-1, F, -1)


class MedusaGraphs:
    """Static-shape greedy drafting for :class:`~speculum_medusa.proposer.MedusaProposer`."""

    def __init__(self, heads, k: int, tree: TreeSpec | None, device: torch.device, use_graphs: bool):
        self.heads, self.k, self.tree = heads, k, tree
        self.device = torch.device(device)
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.plan = StaticPlan(tree, self.device) if tree is not None and tree.is_static else None
        #: batch bucket -> (graph, its input buffers: target states [Bb, H], last tokens [Bb])
        self._graphs: dict[int, tuple[StaticGraph, torch.Tensor, torch.Tensor]] = {}
        self._pool = GraphPool()

    def _draft(self, x: torch.Tensor, tok: torch.Tensor | None) -> torch.Tensor:
        """The static function: target states [Bb, H] (and last tokens [Bb]; with a prefix layer
        its outputs, no tokens) -> drafts (see the module doc)."""
        x = self.heads.draft_input(x, tok)
        if self.tree is None:
            drafts = []
            for i in range(self.k):
                drafts.append(self.heads.logits(i, x).argmax(dim=-1))
                if i + 1 < self.k:
                    x = self.heads.advance(i, x, drafts[-1])
            return torch.stack(drafts, dim=1)
        return packed_tree(*draft_tree(MedusaExpander(self.heads, x), self.tree, self.plan))

    def run(self, x: torch.Tensor, tok: torch.Tensor | None = None) -> torch.Tensor:
        """Drafts of the rows of ``x`` [R, H] whose last tokens are ``tok`` [R] (read by
        token-aware heads only; graph outputs: valid until the next run)."""
        tok = tok if self.heads.draft_reads_token else None
        with torch.inference_mode():
            if not self.use_graphs:
                return self._draft(x, tok)
            R = x.shape[0]
            Bb = bucket(R)
            graph, buf, tbuf = self._graphs.get(Bb) or self._capture(Bb, x.shape[-1], x.dtype)
            buf[:R].copy_(x)
            if tok is not None:
                tbuf[:R].copy_(tok)
            return graph.replay()[:R]

    def _capture(self, Bb: int, H: int, dtype: torch.dtype) -> tuple[StaticGraph, torch.Tensor, torch.Tensor]:
        buf = torch.zeros(Bb, H, dtype=dtype, device=self.device)  # the inputs: filled before each replay
        tbuf = torch.zeros(Bb, dtype=torch.int64, device=self.device)
        tok = tbuf if self.heads.draft_reads_token else None
        entry = (self._pool.capture(lambda: self._draft(buf, tok)), buf, tbuf)
        self._graphs[Bb] = entry
        return entry
