"""Exact-match sampling: the target samples every position, a draft token stays when it is that sample.

At each verified position ``j`` the target's token is drawn by the exponential race with
noise keyed by (the request's seed, the token's position), never by a stream
(:func:`~speculum.verifiers.noise.keyed_exponentials`). Drafts are kept while they equal
the target's samples; the first mismatch emits the target's sample. Every emitted token
is the target's own sample at its position, so the law is exactly the target's whatever
the draft (draft probabilities are not used). With batch-invariant logits
(``LLM(..., batch_invariant=True)``) the tokens are a function of the seed alone: the
same with speculation on or off, at any batch size. For one-hot drafts (n-gram, greedy
heads) a draft is kept with probability ``p(x)`` as under rejection sampling; for
sampled drafts rejection sampling keeps more.

Token trees: the sample after a node at depth ``d`` uses the noise of position ``d``
after the root (a chain's column ``d``), and the accepted path is the deepest one whose
every token is the sample after its parent (:func:`exact_match_tree`). The emitted
tokens are again the target's own samples at their positions, so batch-invariant trees
give the same tokens as plain decoding too.
"""

from __future__ import annotations

import torch

from speculum.devices import on_device
from speculum.interfaces import Draft, Verdict
from speculum.sampling import SamplingBatch
from speculum.tree import TokenTree
from speculum.verifiers.noise import keyed_exponentials
from speculum.verifiers.sampled import verify_sampled
from speculum.verifiers.tree import greedy_path, verify_tree_sampled


def exact_match_sample(p: torch.Tensor, draft_ids: torch.Tensor, e: torch.Tensor) -> Verdict:
    """``p`` [B, k+1, V] target probabilities, ``draft_ids`` [B, k] (-1 padded), ``e``
    [B, k+1, V] Exp(1) noise: each position's sample is ``argmax(p / e)``; drafts are
    accepted while they equal it."""
    B, k1, _ = p.shape
    k = k1 - 1
    samples = (p / e).argmax(dim=-1)  # [B, k+1]
    if k:
        match = (draft_ids == samples[:, :k]) & (draft_ids >= 0)
        num_accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)
    else:
        num_accepted = torch.zeros(B, dtype=torch.int64, device=p.device)
    pos = torch.arange(k1, device=p.device).view(1, k1)
    tokens = torch.where(pos <= num_accepted.view(B, 1), samples, torch.full_like(samples, -1))
    return Verdict(token_ids=tokens, num_accepted=num_accepted)


def exact_match_tree(p: torch.Tensor, token_ids: torch.Tensor, tree: TokenTree, e: torch.Tensor) -> Verdict:
    """``p`` [B, N+1, V] target probabilities (root, then nodes), ``token_ids`` [B, N] (-1 =
    no node), ``e`` [B, D+1, V] Exp(1) noise of the positions root .. root + D (D >= the
    deepest node): the sample after each column is ``argmax(p / e[depth])``; the path is
    the deepest one whose tokens are those samples (:func:`greedy_path` on the samples)."""
    B, N1, V = p.shape
    dev = p.device
    depth = tree.depth.to(dev)
    cdepth = torch.cat([depth.new_zeros(B, 1), depth], dim=1)  # [B, N+1]: the root at depth 0
    noise = e.gather(1, cdepth.clamp_max(e.shape[1] - 1).unsqueeze(-1).expand(B, N1, V))
    samples = (p / noise).argmax(dim=-1)  # [B, N+1]
    out, num_accepted, path = greedy_path(samples, token_ids.to(dev), tree.parents.to(dev), tree.ancestors.to(dev),
                                          depth)
    return Verdict(token_ids=out, num_accepted=num_accepted, path=path)


class ExactMatchVerifier:
    """Lossless at any temperature; with batch-invariant kernels a seeded request gives
    the same tokens with and without speculation. Greedy rows use argmax matching."""

    lossless = True
    supports_trees = True

    def verify(self, target_logits: torch.Tensor, draft: Draft, sampling: SamplingBatch) -> Verdict:
        if sampling.keys is None and not sampling.all_greedy:
            raise ValueError("exact-match sampling needs each row's (seed, position): build the batch with "
                             "SamplingBatch.from_params(..., keys=)")

        def noise(p, n):  # [B, n, V], keyed by (seed, position) from the root on
            seeds = on_device([s for s, _ in sampling.keys], p.device)
            positions = on_device([t for _, t in sampling.keys], p.device)
            return keyed_exponentials(seeds, positions, n, p.shape[2])

        if draft.tree is not None:
            def tree_rule(p, _q, ids, tree, _generators):
                deepest = tree.max_depth if tree.max_depth is not None else ids.shape[1]
                return exact_match_tree(p, ids, tree, noise(p, deepest + 1))

            return verify_tree_sampled(tree_rule, target_logits, draft, sampling)

        def rule(p, _q, ids, _generators):  # draft probabilities and streams are not used
            return exact_match_sample(p, ids, noise(p, p.shape[1]))

        return verify_sampled(rule, target_logits, draft, sampling)
