"""Greedy verification: accept a draft token exactly when it is the target's argmax."""

from __future__ import annotations

import functools

import torch

from speculum.interfaces import Draft, Verdict
from speculum.sampling import SamplingBatch


def greedy_verify(target_logits: torch.Tensor, draft_ids: torch.Tensor, argmax: torch.Tensor | None = None) -> Verdict:
    """Accept the longest prefix of ``draft_ids`` that matches the target argmax.

    ``target_logits``: [B, k+1, V]; ``draft_ids``: [B, k] (-1 padded), on any device. The
    emitted run is the accepted drafts followed by the target's argmax at the first
    mismatch (or the bonus position when every draft matched), -1 after it.

    Everything stays on the logits' device, unsynchronised (as the tree verifier's
    verdict): the loop copies the verdict to the host once, and a proposer that drafts
    from the verdict (:class:`~speculum.interfaces.VerdictDrafter`) starts the next
    chain before that copy. With no drafts (``k = 0``) the argmax is the verdict.
    The count and the tokens are views of one tensor (:attr:`Verdict.rows`). ``argmax``:
    ``target_logits.argmax(-1)`` [B, k+1] when the caller has it (a runner computes it inside
    its CUDA graph: ``ForwardOutput.argmax``).
    """
    B, k1, _ = target_logits.shape
    k = k1 - 1
    # [B, k+1]
    if argmax is None:
        argmax = target_logits.argmax(dim=-1)
    drafts = draft_ids.to(argmax.device, torch.int64, non_blocking=True)
    rows = _fused(argmax, drafts) if argmax.is_cuda else None  # one kernel on CUDA
    if rows is None:  # the twin: a draft is accepted when it and every draft before it match
        # (-1 padding never does); five small kernels after the argmax on a GPU
        rows = torch.empty(B, k1 + 1, dtype=torch.int64, device=argmax.device)
        # [B] int64 (a bool cumprod is int64)
        accepted = (drafts == argmax[:, :k]).cumprod(dim=1).sum(dim=1) if k else torch.zeros_like(argmax[:, 0])
        rows[:, 0] = accepted
        rows[:, 1:] = argmax.masked_fill(_columns(k1, argmax.device) > accepted.view(B, 1), -1)
    # the count and the tokens side by side: the loop copies them to the host in one piece
    return Verdict.from_rows(rows)


@functools.cache
def torch_kernel(name: str):
    """The torch backend's fused kernel ``name`` (``greedy_chain_verdict``,
    ``greedy_tree_path``), looked up once: the backend loads its kernels lazily."""
    from speculum.backends import torch as backend
    return getattr(backend, name)


def _fused(argmax: torch.Tensor, drafts: torch.Tensor):
    """The same verdict as one Triton kernel (``greedy_chain_verdict``), or None."""
    return torch_kernel("greedy_chain_verdict")(argmax, drafts)


_COLUMNS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _columns(n: int, device: torch.device) -> torch.Tensor:
    """[1, n]: 0 .. n - 1 on ``device``, made once per (n, device)."""
    key = (n, device)
    cols = _COLUMNS.get(key)
    if cols is None:
        cols = _COLUMNS[key] = torch.arange(n, device=device).view(1, n)
    return cols


class GreedyVerifier:
    """Exact argmax matching. Lossless for temperature 0; refuses sampled requests."""

    lossless = True
    supports_trees = True
    #: takes the runner's argmax of the logits (``verify(..., argmax=)``)
    takes_argmax = True

    def verify(self, target_logits: torch.Tensor, draft: Draft, sampling: SamplingBatch,
               argmax: torch.Tensor | None = None) -> Verdict:
        if not sampling.all_greedy:
            raise ValueError(
                "the greedy verifier only serves temperature 0 requests; use "
                "acceptance_method='rejection_sampler' for sampled requests"
            )
        if draft.tree is not None:
            from speculum.verifiers.tree import tree_greedy_verify
            return tree_greedy_verify(target_logits, draft.token_ids, draft.tree, argmax)
        return greedy_verify(target_logits, draft.token_ids, argmax)
