"""Drafting token trees level by level: static trees and dynamic (EAGLE-2) trees.

Both builders drive an :class:`Expander`, the draft model seen one tree level at a
time: ``root(w)`` gives the ``w`` best children of the root, ``expand`` runs the draft
over a *frontier* (nodes of one depth) in one batched call and gives each node's ``w``
best children. Everything is tensor ops over the batch with shapes fixed by the
:class:`~speculum.tree.TreeSpec` (no per-node Python, no reads of the device), so a
builder can run inside a CUDA graph.

Draft KV of the frontier nodes (for drafts with their own cache) lives in a *region* of
``S`` slots after the committed context: frontier node ``j`` of level ``l`` writes slot
``slots[j]`` and attends to the context plus the slots of its ancestors (``vis``) and its
own. Scores are log-probabilities under the draft (``log_softmax``), summed along a path.

- Static trees (``paths`` of top-k ranks): node ``(r1, ..., rd)`` is the ``rd``-th best
  child of node ``(r1, ..., r(d-1))``. Only nodes with children are expanded.
- Dynamic trees (EAGLE-2, as SGLang): the root's ``topk`` children are the first
  frontier; each level expands the frontier's ``topk`` children each (``topk**2``
  candidates) and keeps the ``topk`` best by cumulative score as the next frontier; after
  ``depth`` levels the best ``num_nodes`` of all candidates form the tree. A child never
  scores above its parent, and ties keep the earlier (shallower) candidate, so the kept
  nodes always include their parents.
"""

from __future__ import annotations

from typing import Protocol

import torch

from speculum.devices import on_device
from speculum.tree import TreeSpec, tree_ancestors


class Expander(Protocol):
    """The draft model, one tree level at a time (see the module doc).

    An expander may also have ``topk(x, k)``: (values, indices) of the ``k`` largest of
    ``x`` [R, n] with ties to the lower index, as :func:`topk_stable`; dynamic trees then
    choose their frontiers and nodes with it (the torch heads' fused kernel on CUDA)."""

    def root(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs [R, width], token ids [R, width]) of the root's best children."""

    def expand(self, level: int, parent: torch.Tensor, tokens: torch.Tensor, vis: torch.Tensor,
               slots: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the draft over the frontier of depth ``level`` (1 = the root's children).

        ``parent`` [R, F]: each frontier node's parent as an index into the previous
        frontier (level 1: 0, the root); ``tokens`` [R, F]; ``vis`` [R, F, S] region slots of
        its ancestors; ``slots`` [F] its own region slot. Returns (log-probs, token ids),
        each [R, F, width]: its best children."""


def region_size(spec: TreeSpec) -> int:
    """Draft-KV region slots one tree step needs (frontier nodes of levels 1..depth-1)."""
    if not spec.is_static:
        return (spec.depth - 1) * spec.topk
    return sum(len(f) for f in _static_frontiers(spec)[:-1])


def _static_frontiers(spec: TreeSpec) -> list[list[int]]:
    """Per depth, the static nodes that have children (the last level has none)."""
    parents = spec.static_parents()
    has_children = set(p for p in parents if p >= 0)
    return [[i for i in lvl if i in has_children] for lvl in spec.static_levels()]


class StaticPlan:
    """Index tensors of a static tree, made once (see :func:`static_tree`)."""

    def __init__(self, spec: TreeSpec, device):
        self.spec = spec
        parents = spec.static_parents()
        ranks = [p[-1] for p in spec.paths]
        levels = spec.static_levels()
        frontiers = _static_frontiers(spec)
        self.N, self.S = spec.num_nodes, region_size(spec)
        t = (lambda v: torch.tensor(v, dtype=torch.int64, device=device))
        # level 1: nodes and ranks among the root's children
        self.first_nodes = t(levels[0])
        self.first_ranks = t([ranks[i] for i in levels[0]])
        self.first_width = max(ranks[i] for i in levels[0]) + 1
        slot_of: dict[int, int] = {}
        self.steps = []  # per expanded level: (frontier nodes, parent idx, slots, vis, children, child parent idx, ranks, width)
        off = 0
        for lvl in range(1, spec.depth):
            front = frontiers[lvl - 1]
            children = levels[lvl]
            if not front or not children:
                break
            pos_in_front = {n: j for j, n in enumerate(front)}
            prev_front = frontiers[lvl - 2] if lvl >= 2 else []
            prev_pos = {n: j for j, n in enumerate(prev_front)}
            parent_idx = [prev_pos[parents[n]] if lvl >= 2 else 0 for n in front]
            slots = list(range(off, off + len(front)))
            for n, sl in zip(front, slots):
                slot_of[n] = sl
            vis = torch.zeros(len(front), max(self.S, 1), dtype=torch.bool)
            for j, n in enumerate(front):
                a = parents[n]
                while a >= 0:
                    vis[j, slot_of[a]] = True
                    a = parents[a]
            self.steps.append((t(front), t(parent_idx), t(slots), vis.to(device), t(children),
                               t([pos_in_front[parents[c]] for c in children]), t([ranks[c] for c in children]),
                               max(ranks[c] for c in children) + 1))
            off += len(front)
        self.parents = t(parents)


def static_tree(ex: Expander, plan: StaticPlan) -> torch.Tensor:
    """Tokens [R, N] of ``plan``'s static tree (parents: ``plan.parents``)."""
    lp, ids = ex.root(plan.first_width)
    R = ids.shape[0]
    tokens = torch.zeros(R, plan.N, dtype=torch.int64, device=ids.device)
    tokens[:, plan.first_nodes] = ids[:, plan.first_ranks]
    for lvl, (front, parent_idx, slots, vis, children, child_parent, ranks, width) in enumerate(plan.steps, start=1):
        F = front.shape[0]
        _, ids = ex.expand(lvl, parent_idx.expand(R, F), tokens[:, front], vis.expand(R, -1, -1), slots, width)
        tokens[:, children] = ids[:, child_parent, ranks]  # [R, C]
    return tokens


def dynamic_tree(ex: Expander, spec: TreeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-2 tree (see the module doc): (tokens [R, N], parents [R, N]), nodes in
    breadth-first order of their candidates."""
    K, D, N = spec.topk, spec.depth, spec.num_nodes
    S = max(region_size(spec), 1)
    select = getattr(ex, "topk", topk_stable)  # an expander's own (fused) top-k, same order
    score, ids = ex.root(K)  # [R, K]
    R, dev = ids.shape[0], ids.device
    scores, tokens, parents = [score], [ids], [torch.full((R, K), -1, dtype=torch.int64, device=dev)]
    f_score, f_tok = score, ids
    # 0, 1, 2, ...: slot numbers, candidate and node indices, made once (one kernel, not one a level)
    count = torch.arange(max(S, (D - 1) * K, K, N), device=dev)
    f_cand = count[:K].expand(R, K)  # candidate index of each frontier node
    f_parent = torch.zeros(R, K, dtype=torch.int64, device=dev)
    vis = torch.zeros(R, K, S, dtype=torch.bool, device=dev)
    base = K
    for lvl in range(1, D):
        slots = count[(lvl - 1) * K: lvl * K]
        lp, cid = ex.expand(lvl, f_parent, f_tok, vis, slots, K)  # [R, K, K]
        cum = (f_score.unsqueeze(-1) + lp.clamp_max(0)).reshape(R, K * K)
        cid = cid.reshape(R, K * K)
        scores.append(cum)
        tokens.append(cid)
        parents.append(f_cand.repeat_interleave(K, dim=1))
        f_score, top = select(cum, K)
        pj = top // K  # which frontier node each new frontier node descends from
        # own[i, slots[i]]: built by comparison, not by an indexed write of a Python scalar
        # (that copies a CPU tensor, which a CUDA graph capture refuses)
        own = count[:S].view(1, S) == slots.view(K, 1)
        vis = (vis | own).gather(1, pj.unsqueeze(-1).expand(R, K, S))
        f_parent, f_tok, f_cand = pj, cid.gather(1, top), base + top
        base += K * K
    all_s, all_t, all_p = torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents, 1)
    best = select(all_s, N)[1]
    sel = best.sort(dim=1).values  # [R, N] candidate order: parents before children
    inv = torch.full_like(all_p, -1).scatter_(1, sel, count[:N].expand(R, N))
    cp = all_p.gather(1, sel)
    node_parents = torch.where(cp >= 0, inv.gather(1, cp.clamp_min(0)), -1)
    return all_t.gather(1, sel), node_parents


def draft_tree(ex: Expander, spec: TreeSpec, plan: StaticPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [R, N], parents [R, N]) of ``spec``'s tree, drafted with ``ex``."""
    if spec.is_static:
        plan = plan or StaticPlan(spec, ex_device(ex))
        tokens = static_tree(ex, plan)
        return tokens, plan.parents.expand(tokens.shape[0], -1)
    return dynamic_tree(ex, spec)


def topk_stable(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the ``k`` largest of ``x`` [..., n], ties to the lower index."""
    v, i = x.sort(dim=-1, descending=True, stable=True)
    return v[..., :k], i[..., :k]


def ex_device(ex) -> torch.device:
    return getattr(ex, "device", torch.device("cpu"))


def packed_tree(tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """A drafted tree as one int64 tensor [R, 3N + N*N]: tokens, parents, depths and the
    ancestor matrix (the output of a graphed drafting function: no tree bookkeeping is
    left for the host). :func:`unpack_tree` reads it back."""
    R, N = tokens.shape
    anc = tree_ancestors(parents)
    return torch.cat([tokens, parents, anc.sum(-1), anc.reshape(R, N * N).to(torch.int64)], dim=1)


def unpack_tree(out: torch.Tensor, N: int):
    """:func:`packed_tree`'s [R, 3N + N*N] -> tokens, parents, depths [R, N] and
    ancestors [R, N, N] (bool)."""
    tokens, parents, depth, anc = out.split([N, N, N, N * N], dim=1)
    return tokens, parents, depth, anc.reshape(-1, N, N).bool()


def tree_rows(B: int, N: int, rows: list[int], parts, device) -> tuple[torch.Tensor, ...]:
    """(tokens, parents, depths, ancestors) of a batch of ``B`` rows of ``N`` nodes from
    those of the drafting ``rows`` (``parts``, as :func:`unpack_tree` gives them; None
    without rows); the other rows get no nodes (tokens -1, parents -1, depth 1, each node
    its own only ancestor)."""
    if len(rows) == B:  # every row drafted (the usual case): no scatter
        return tuple(parts)
    full = (torch.full((B, N), -1, dtype=torch.int64, device=device),
            torch.full((B, N), -1, dtype=torch.int64, device=device),
            torch.ones(B, N, dtype=torch.int64, device=device),
            torch.eye(N, dtype=torch.bool, device=device).expand(B, N, N).clone())
    if rows:
        idx = on_device(rows, device)
        for t, part in zip(full, parts):
            t[idx] = part
    return full
