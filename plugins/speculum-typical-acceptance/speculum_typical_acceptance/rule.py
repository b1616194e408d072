"""The typical acceptance rule (Cai et al., "Medusa", 2024, section 2.3.1), vectorised.

Notation: ``p_i`` is the target's distribution at draft position ``i`` (after
temperature, top-k and top-p), ``H(p_i) = -sum_x p_i(x) log p_i(x)`` its entropy in nats.
Draft token ``x_i`` is accepted when::

    p_i(x_i) > min(posterior_threshold, posterior_alpha * exp(-H(p_i)))

and the accepted drafts are the longest prefix of accepted tokens. The next token is
then sampled from ``p`` at the first position not accepted (after a rejection, or the
bonus position): plain target sampling, no residual. The draft's own probabilities play
no part. The rule is deterministic given ``p`` and the drafts; only the sampled token
uses noise (the rows' generators, ``V`` exponentials per row).

It is not lossless: a draft the target finds plausible is kept even where the target
would have sampled something else, so outputs drift towards the target's likelier tokens
(less diverse). At temperature 0 ``p_i`` is one-hot, ``H = 0``, the threshold is
``min(posterior_threshold, posterior_alpha) < 1``: exactly the argmax is accepted and the
next token is the argmax, i.e. greedy matching.

Trees: every node is tested with the same rule against the target's distribution at its
parent; a node counts when it and all its ancestors pass. The deepest such node is kept
with its path, ties broken by the target likelihood of the path (the sum of ``log p`` of
its tokens), and the next token is sampled from ``p`` after it.
"""

from __future__ import annotations

import torch

from speculum.interfaces import Verdict
from speculum.verifiers import RowNoise, path_verdict, race


def typical_accept(p: torch.Tensor, draft_ids: torch.Tensor, generators, posterior_threshold: float = 0.09,
                   posterior_alpha: float = 0.3) -> Verdict:
    """One typical-acceptance step, vectorised over the batch.

    ``p``: [B, k+1, V] processed target probabilities; ``draft_ids``: [B, k], -1 padded;
    ``generators``: one per row, one for all rows, or a :class:`speculum.verifiers.RowNoise`.
    """
    noise = generators if isinstance(generators, RowNoise) else RowNoise(generators)
    B, k1, V = p.shape
    k = k1 - 1
    device = p.device
    pos = torch.arange(k1, device=device).view(1, k1)
    if k > 0:
        valid = (draft_ids >= 0).to(torch.int64).cumprod(dim=1).bool()  # [B, k]
        p_x = p[:, :k].gather(-1, draft_ids.clamp_min(0).unsqueeze(-1)).squeeze(-1)  # [B, k]
        entropy = -torch.special.xlogy(p[:, :k], p[:, :k]).sum(dim=-1)  # [B, k], nats
        threshold = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)
        accept = (p_x > threshold) & valid
        num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
        drafted = torch.cat([draft_ids, draft_ids.new_full((B, 1), -1)], dim=1)
    else:
        num_accepted = torch.zeros(B, dtype=torch.int64, device=device)
        drafted = torch.full((B, 1), -1, dtype=torch.int64, device=device)
    p_next = p.gather(1, num_accepted.view(B, 1, 1).expand(B, 1, V)).squeeze(1)  # [B, V]
    last = race(p_next, noise.exponentials(B, V, device))
    tokens = torch.where(pos < num_accepted.view(B, 1), drafted, torch.full_like(drafted, -1))
    tokens = torch.where(pos == num_accepted.view(B, 1), last.view(B, 1), tokens)
    return Verdict(token_ids=tokens, num_accepted=num_accepted)


def typical_accept_tree(p: torch.Tensor, token_ids: torch.Tensor, tree, generators,
                        posterior_threshold: float = 0.09, posterior_alpha: float = 0.3) -> Verdict:
    """The rule over a token tree: the deepest node whose whole path passes, ties by likelihood.

    ``p``: [B, N+1, V] processed target probabilities (root, then nodes); ``token_ids``:
    [B, N], -1 = no node; ``tree``: :class:`speculum.tree.TokenTree`.
    """
    noise = generators if isinstance(generators, RowNoise) else RowNoise(generators)
    B, Q, V = p.shape
    N = Q - 1
    dev = p.device
    if N == 0:
        last = race(p[:, 0], noise.exponentials(B, V, dev))
        return Verdict(token_ids=last.view(B, 1), num_accepted=torch.zeros(B, dtype=torch.int64, device=dev),
                       path=torch.zeros(B, 0, dtype=torch.int64, device=dev))
    token_ids = token_ids.to(dev)
    parents = tree.parents.to(dev)
    p_par = p.gather(1, (parents + 1).view(B, N, 1).expand(B, N, V))  # [B, N, V] p at each node's parent
    p_x = p_par.gather(-1, token_ids.clamp_min(0).unsqueeze(-1)).squeeze(-1)  # [B, N]
    entropy = -torch.special.xlogy(p_par, p_par).sum(dim=-1)
    threshold = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)
    passed = (token_ids >= 0) & (p_x > threshold)
    anc = tree.ancestors.to(dev)  # [B, N, N]: anc[b, i, j] = j is on i's path (i included)
    ok = ~(anc & ~passed.unsqueeze(1)).any(-1)
    loglik = (anc.to(p.dtype) * torch.log(p_x.clamp_min(1e-30)).unsqueeze(1)).sum(-1)  # [B, N]
    depth = tree.depth.to(dev)
    # deepest first; among equally deep paths the likeliest (loglik <= 0, so within (-inf, 0])
    score = torch.where(ok, depth.double() * 1e6 + loglik.double().clamp_min(-1e5), -1.0)
    best_score, best = score.max(dim=-1)
    found = best_score >= 0
    num_accepted = torch.where(found, depth.gather(1, best.view(B, 1)).squeeze(1), 0)
    on_path = anc.gather(1, best.view(B, 1, 1).expand(B, 1, N)).squeeze(1) & found.view(B, 1)
    idx = torch.arange(N, device=dev).view(1, N)
    slots = torch.full((B, N + 1), -1, dtype=torch.int64, device=dev)
    slots.scatter_(1, torch.where(on_path, depth - 1, N), idx.expand(B, N))
    p_next = p.gather(1, torch.where(found, best + 1, 0).view(B, 1, 1).expand(B, 1, V)).squeeze(1)
    last = race(p_next, noise.exponentials(B, V, dev))
    return path_verdict(token_ids, slots[:, :N], num_accepted, last)
