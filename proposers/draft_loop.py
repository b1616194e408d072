"""An autoregressive draft loop over any backend ModelRunner (shared by model-based proposers).

Each step the draft model first catches up on the tokens it has not seen (the last
accepted run plus the target's token), then drafts ``k`` tokens one at a time. After
verification :func:`rollback` keeps only the KV of accepted positions.
"""

from __future__ import annotations

from typing import Sequence

import torch

from speculum.devices import on_device
from speculum.interfaces import Draft, ModelRunner, SequenceView
from speculum.sampling import SamplingBatch, processed_probs, sample_rows


def pending_tokens(runner: ModelRunner, seqs: Sequence[SequenceView]) -> tuple[torch.Tensor, list[int]]:
    """Tokens each sequence's draft cache lacks: ([B, P] right padded, counts per row)."""
    rows = [s.token_ids[runner.length(s.seq_id):] for s in seqs]
    counts = [len(r) for r in rows]
    if min(counts) < 1:
        raise RuntimeError("draft cache is ahead of its sequence; rollback was skipped")
    ids = torch.zeros(len(rows), max(counts), dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return ids, counts  # runners take host tokens (one copy with the step metadata)


def draft_autoregressive(runner: ModelRunner, seqs: Sequence[SequenceView], k: int,
                         sampling: SamplingBatch, sample: bool = True) -> Draft:
    """Draft ``k`` tokens per sequence with ``runner``.

    ``sample``: sampled requests draw drafts from the processed draft distribution and
    report it as ``probs``; otherwise drafts are the draft argmax and ``probs`` is None.
    """
    seq_ids = [s.seq_id for s in seqs]
    B = len(seqs)
    ids, counts = pending_tokens(runner, seqs)
    sample = sample and not sampling.all_greedy
    gens = sampling.generators if sample else [None] * B
    tokens, probs = [], []
    for i in range(k):
        out = runner.forward(seq_ids, ids, counts)
        # [B, V] logits at each row's last valid input
        last = out.logits[:, -1] if max(counts) == min(counts) else \
            out.logits[torch.arange(B, device=out.logits.device), on_device(counts, out.logits.device) - 1]
        if sampling.needs_processing:  # penalties etc. counting this step's drafts so far
            last = sampling.process_logits(last.unsqueeze(1), torch.stack(tokens, dim=1) if tokens else None, i)[:, 0]
        if sample:
            p = processed_probs(last.unsqueeze(1), sampling.temperature, sampling.top_k, sampling.top_p,
                                sampling.flags(last.shape[-1]))[:, 0]
            tok = sample_rows(p, gens)
            probs.append(p)
        else:
            tok = last.argmax(dim=-1)
        tokens.append(tok)
        if i + 1 < k:
            ids, counts = tok.view(B, 1), [1] * B
    token_ids = torch.stack(tokens, dim=1) if tokens else torch.empty(B, 0, dtype=torch.int64)
    return Draft(token_ids=token_ids, probs=torch.stack(probs, dim=1) if sample and probs else None,
                 lengths=[k] * B)


def draft_chain_from_verdict(runner, seq_ids: Sequence[int], lengths: Sequence[int], rows: torch.Tensor,
                             last: Sequence[int], k: int) -> torch.Tensor | None:
    """Greedy chains of ``k`` drafts per row with ``runner``, started from a verdict still on
    the device (the host has not read how many drafts each row accepted).

    Row ``b``'s draft cache holds its ``lengths[b]`` tokens and the ``k - 1`` drafts of the step
    just verified. ``rows`` [B, 1 + k+1] (the verdict's ``as_rows()``, on the device): each row's
    accepted count ``a`` and the tokens the step emitted; ``last``: each row's last token before
    the step (position ``lengths[b] - 1``). The first forward rewrites position
    ``lengths[b] - 1 + a`` (the last accepted draft, or ``last[b]``: the last draft of a fully
    accepted chain was never fed) and appends the new token; each next forward appends the
    draft before it; every position is counted on the device from the accepted count
    (``runner.chain_from_verdict``, one static function, a CUDA graph on a GPU: the host
    allocates each row for the longest outcome, so the caller truncates to ``lengths[b] + a + k``
    once it knows ``a``). Returns the drafts [B, k] (still being computed), or None when the
    runner cannot (no room for the longest outcome, or no graph): every row is then cut back to
    ``lengths[b] - 1`` positions, from which the next propose catches up as usual."""
    out = None
    try:
        out = runner.chain_from_verdict(list(seq_ids), [n - 1 for n in lengths], rows, last, k)
    finally:  # None or an error: nothing of the chain stays
        if out is None:
            for sid, n in zip(seq_ids, lengths):
                if runner.length(sid) > n - 1:
                    runner.truncate(sid, n - 1)
    return out


def rollback(runner: ModelRunner, seq_ids: Sequence[int], num_accepted: Sequence[int],
             new_lengths: Sequence[int]) -> None:
    """Keep draft KV only for positions the target accepted."""
    for sid, a, new_len in zip(seq_ids, num_accepted, new_lengths):
        old_len = new_len - a - 1
        keep = min(runner.length(sid), old_len + a)
        runner.truncate(sid, keep)
