"""Lossless verification of token trees (SpecInfer, Miao et al. 2024; EAGLE-2).

Notation as in :mod:`speculum.verifiers.rejection`: ``p`` is the target distribution,
``q`` the draft's. Column 0 of the target output is the root (the last committed
token), column ``i + 1`` is node ``i``; the target distribution after node ``i``'s path
is ``p[:, i + 1]``.

Temperature 0: the deepest node whose whole path matches the target's argmax at every
step (the first such node on ties) is accepted with its ancestors, then the argmax after
it is emitted.

Temperature > 0: multi-round recursive rejection sampling over siblings. At the current
node (the root first), with ``p`` the target distribution there, try its children in
order: child ``x ~ q_x`` is accepted with probability ``min(1, p(x) / q_x(x))``; after a
rejection ``p`` becomes the normalised residual ``max(0, p - q_x)`` before the next
sibling is tried. An accepted child becomes the current node (with the target's
distribution after it); when every child is rejected, or the node has none, one token
is drawn from what is left of ``p``. Without draft probabilities a child is one-hot
(``q_x(x) = 1``): it is accepted with probability ``p(x)``, and the residual is ``p``
with ``x`` removed, renormalised. The emitted tokens then follow the target exactly,
provided each child's token was drawn from its ``q`` independently of its siblings (or
is deterministic, with ``probs=None``).
"""

from __future__ import annotations

import torch

from speculum.interfaces import Verdict
from speculum.tree import TokenTree
from speculum.verifiers.greedy import torch_kernel
from speculum.verifiers.noise import Generators, RowNoise, as_noise, race


def sibling_ranks(parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, N] rank of each valid node among its valid siblings (0 = first); -1 if invalid."""
    B, N = parents.shape
    idx = torch.arange(N, device=parents.device)
    same = (parents.unsqueeze(2) == parents.unsqueeze(1)) & valid.unsqueeze(1)  # [B, i, j]
    earlier = idx.view(1, 1, N) < idx.view(1, N, 1)
    rank = (same & earlier).sum(-1)
    return torch.where(valid, rank, -1)


def path_verdict(token_ids: torch.Tensor, path: torch.Tensor, num_accepted: torch.Tensor,
                 last: torch.Tensor) -> Verdict:
    """The verdict of a tree rule: node tokens ``token_ids`` [B, N], the accepted nodes
    ``path`` [B, N] (root first, -1 padded), their count ``num_accepted`` [B] and the token
    emitted after them ``last`` [B]."""
    B, N = path.shape
    toks = torch.where(path >= 0, token_ids.gather(1, path.clamp_min(0)), -1)
    out = torch.cat([toks, toks.new_full((B, 1), -1)], dim=1)  # [B, N+1]
    pos = torch.arange(N + 1, device=out.device).view(1, -1)
    out = torch.where(pos == num_accepted.view(B, 1), last.view(B, 1), out)
    return Verdict(token_ids=out, num_accepted=num_accepted, path=path)


def tree_greedy_verify(target_logits: torch.Tensor, token_ids: torch.Tensor, tree: TokenTree,
                       argmax: torch.Tensor | None = None) -> Verdict:
    """Accept the deepest node whose path matches the target's argmax; all tensor ops.

    ``target_logits``: [B, N+1, V] (root, then nodes); ``token_ids``: [B, N], -1 = no node.
    It runs after the graphed verify forward, so each of its ~25 small kernels would be
    host time: on CUDA everything after the argmax is one fused kernel (the torch backend's
    ``greedy_tree_path``), elsewhere (and for trees of 128 nodes or more) it runs eagerly
    (:func:`greedy_path`). ``argmax``: the logits' argmax [B, N+1] when the caller has it
    (a runner computes it inside its CUDA graph).
    """
    B, N = token_ids.shape
    am = target_logits.argmax(dim=-1) if argmax is None else argmax  # [B, N+1]
    if N == 0:
        return Verdict(token_ids=am[:, :1], num_accepted=torch.zeros(B, dtype=torch.int64, device=am.device),
                       path=am.new_zeros(B, 0))
    dev = am.device
    args = (am, token_ids.to(dev), tree.parents.to(dev), tree.ancestors.to(dev), tree.depth.to(dev))
    rows = _fused(*args) if dev.type == "cuda" else None
    if rows is None:  # the twin, its outputs joined as the kernel writes them
        out, num_accepted, path = greedy_path(*args)
        rows = torch.cat([num_accepted.view(B, 1), out, path], dim=1)
    # count, tokens and path side by side: the loop copies them to the host in one piece
    return Verdict.from_rows(rows, path_width=N)


def greedy_path(am: torch.Tensor, token_ids: torch.Tensor, parents: torch.Tensor, anc: torch.Tensor,
                depth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`tree_greedy_verify` from the argmax ``am`` [B, N+1] and the tree (parents,
    depths [B, N], ancestors [B, N, N]): (tokens emitted [B, N+1], accepted count [B],
    accepted nodes [B, N] root first, -1 padded). Static shapes, no device reads, no
    scalars made device tensors: capturable as a CUDA graph."""
    B, N = token_ids.shape
    dev = am.device
    match = token_ids == am.gather(1, parents + 1)  # [B, N]; a missing node (-1) never matches
    ok = (anc & match.unsqueeze(1)).sum(-1) == depth  # every node on its path matches
    idx = torch.arange(N, device=dev)
    score = (depth * (N + 1) - idx) * ok  # deepest first, then the earliest; 0 = not a candidate
    best_score, best = score.max(dim=-1)
    found = best_score > 0
    best = best.view(B, 1)
    num_accepted = depth.gather(1, best).squeeze(1) * found  # [B]
    on_path = anc.gather(1, best.unsqueeze(-1).expand(B, 1, N)).squeeze(1) & found.view(B, 1)
    slots = torch.full((B, N + 1), -1, dtype=torch.int64, device=dev)
    slots.scatter_(1, (depth - 1).masked_fill(~on_path, N), idx.expand(B, N))
    path = slots[:, :N]
    # emitted: the argmax at the root, then after each accepted node (a matched node's
    # token is the argmax at its parent; the last is the target's own token after the path)
    cols = torch.cat([torch.zeros_like(path[:, :1]), path + 1], dim=1)  # [B, N+1]; padding reads column 0
    out = am.gather(1, cols).masked_fill(torch.arange(N + 1, device=dev) > num_accepted.view(B, 1), -1)
    return out, num_accepted, path


def _fused(*args):
    """:func:`greedy_path` as one CUDA kernel (its outputs side by side in one tensor), or
    None where it does not apply."""
    return torch_kernel("greedy_tree_path")(*args)


def tree_rejection_sample(p: torch.Tensor, q: torch.Tensor | None, token_ids: torch.Tensor, tree: TokenTree,
                          generators: Generators | RowNoise, sibling_residual: bool = True) -> Verdict:
    """One verification step of a tree, vectorised over the batch (see the module doc).

    ``p``: [B, N+1, V] target probabilities (root, then nodes); ``q``: [B, N, V] the
    distribution each node was drawn from, or None (deterministic nodes); ``token_ids``:
    [B, N], -1 = no node. Loops ``max_depth x max_children`` times (the tree's host-side
    bounds), never reading the device. ``sibling_residual=False`` skips the residual
    update between siblings (the residual is taken once, after the last one): a wrong
    variant, so tests can show it is caught.
    """
    B, Q, V = p.shape
    N = Q - 1
    dev = p.device
    rows = torch.arange(B, device=dev)
    cur_p = p[:, 0]  # [B, V] what is left of the target distribution at the current node
    num_accepted = torch.zeros(B, dtype=torch.int64, device=dev)
    path = torch.full((B, N), -1, dtype=torch.int64, device=dev)
    if N:
        token_ids = token_ids.to(dev)
        parents = tree.parents.to(dev)
        valid = token_ids >= 0
        rank = sibling_ranks(parents, valid)
        D, R = min(tree.depth_bound, N), min(tree.children_bound, N)
        u = as_noise(generators).uniforms(B, D * R, dev).view(B, D, R)  # [B, D, R]
        cur = torch.full((B,), -1, dtype=torch.int64, device=dev)  # current node, -1 = root
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        for d in range(D):
            moved = torch.zeros(B, dtype=torch.bool, device=dev)
            last_q, any_rejected = torch.zeros_like(cur_p), torch.zeros(B, dtype=torch.bool, device=dev)
            for r in range(R):
                is_child = (parents == cur.view(B, 1)) & (rank == r)  # [B, N]
                has = is_child.any(-1) & ~done & ~moved
                c = is_child.to(torch.int64).argmax(-1)  # [B]
                x = token_ids[rows, c].clamp_min(0)
                if q is not None:
                    q_c = q[rows, c].to(cur_p.dtype)  # [B, V]
                    q_x = q_c[rows, x]
                else:
                    q_c = torch.zeros_like(cur_p).scatter_(1, x.view(B, 1), 1.0)
                    q_x = torch.ones(B, dtype=cur_p.dtype, device=dev)
                accept = has & (u[:, d, r] * q_x < cur_p[rows, x])  # u < p/q without dividing
                rejected = has & ~accept
                if sibling_residual:
                    res = (cur_p - q_c).clamp_min(0)
                    z = res.sum(-1, keepdim=True)
                    # p <= q everywhere makes a rejection impossible; guard rounding anyway
                    res = torch.where(z > 0, res / z.clamp_min(1e-30), cur_p)
                    cur_p = torch.where(rejected.view(B, 1), res, cur_p)
                else:
                    last_q = torch.where(rejected.view(B, 1), q_c, last_q)
                    any_rejected |= rejected
                moved |= accept
                cur = torch.where(accept, c, cur)
                path[:, d] = torch.where(accept, c, path[:, d])
            if not sibling_residual:
                tried = any_rejected & ~moved
                res = (cur_p - last_q).clamp_min(0)
                z = res.sum(-1, keepdim=True)
                res = torch.where(z > 0, res / z.clamp_min(1e-30), cur_p)
                cur_p = torch.where(tried.view(B, 1), res, cur_p)
            num_accepted += moved.to(torch.int64)
            done |= ~moved
            cur_p = torch.where(moved.view(B, 1), p[rows, cur + 1], cur_p)
    # exponential race: argmax(dist / E), E ~ Exp(1), samples from dist (unnormalised ok)
    last = race(cur_p, as_noise(generators).exponentials(B, V, dev))
    return path_verdict(token_ids.to(dev) if N else p.new_zeros(B, 0, dtype=torch.int64), path, num_accepted, last)


def verify_tree_sampled(rule, target_logits: torch.Tensor, draft, sampling, argmax: torch.Tensor | None = None) -> Verdict:
    """Verify a tree draft with ``rule(p, q, token_ids, tree, generators) -> Verdict`` on
    the processed target distribution (temperature, top-k, top-p, as the draft's were);
    greedy rows take the argmax path, and an all-greedy step never builds ``p``. The
    tree counterpart of :func:`speculum.verifiers.verify_sampled`."""
    from speculum.sampling import processed_probs
    tree = draft.tree
    if sampling.all_greedy:
        return tree_greedy_verify(target_logits, draft.token_ids, tree, argmax)
    flags = sampling.flags(target_logits.shape[-1])
    p = processed_probs(target_logits, sampling.temperature, sampling.top_k, sampling.top_p, flags)
    ids = draft.token_ids.to(p.device)
    probs = draft.probs.to(p.device) if draft.probs is not None else None
    verdict = rule(p, probs, ids, tree, sampling.generators)
    greedy_rows = sampling.temperature == 0
    if flags[2] if flags is not None else bool(greedy_rows.any()):
        g = tree_greedy_verify(target_logits, ids, tree, argmax)
        gr = greedy_rows.view(-1, 1)
        verdict = Verdict(token_ids=torch.where(gr, g.token_ids, verdict.token_ids),
                          num_accepted=torch.where(greedy_rows, g.num_accepted, verdict.num_accepted),
                          path=torch.where(gr, g.path, verdict.path))
    return verdict


def verify_tree(target_logits: torch.Tensor, draft, sampling, argmax: torch.Tensor | None = None) -> Verdict:
    """What :class:`~speculum.verifiers.RejectionSampler` does for a tree draft: greedy
    rows take the argmax path, sampled rows recursive rejection sampling over siblings."""
    return verify_tree_sampled(tree_rejection_sample, target_logits, draft, sampling, argmax)
