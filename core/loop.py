"""One engine step of the draft-verify loop, over a batch of running sequences.

    proposer.propose -> target forward over [last token + drafts] -> verifier.verify
    -> KV rollback by length -> stop checks -> proposer.observe -> metrics

With no proposer the same step is plain autoregressive decoding (k = 0), so speculative
and baseline runs share every line of code but the draft.
"""

from __future__ import annotations

from typing import Sequence as Seq

import torch

from speculum.interfaces import Draft, ModelRunner, ProposeBatch, Proposer, StepFeedback, Verifier
from speculum.sampling import SamplingBatch
from speculum.sequence import Sequence
from speculum.tokenizer import Tokenizer
from speculum.tree import drop_nodes, gather_path, path_moves


class DraftVerifyLoop:
    """Runs steps for a target runner, an optional proposer and a verifier."""

    def __init__(self, target: ModelRunner, verifier: Verifier, tokenizer: Tokenizer,
                 proposer: Proposer | None = None, num_speculative_tokens: int = 0,
                 hidden_layers: Seq[int] = ()):
        self.target = target
        self.verifier = verifier
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.k = num_speculative_tokens if proposer is not None else 0
        self.hidden_layers = tuple(hidden_layers)

    def start(self, seqs: list[Sequence]) -> None:
        """Prefill new sequences: everything but the last token goes into the KV cache.

        A proposer that declared ``hidden_layers`` gets the prefill's hidden states too:
        ``add_request(view, hidden_states={layer: [len - 1, H]})``.
        """
        if not seqs:
            return
        ids, prompts = [s.seq_id for s in seqs], [s.token_ids[:-1] for s in seqs]
        hidden = None
        if self.hidden_layers:  # {seq_id: {layer: [len - 1, H]}} for proposers that asked
            hidden = self.target.add_many(ids, prompts, hidden_layers=self.hidden_layers)
        else:
            self.target.add_many(ids, prompts)
        add = getattr(self.proposer, "add_request", None)
        if add is not None:
            for s in seqs:
                if hidden is None:
                    add(s.view())
                else:
                    add(s.view(), hidden_states=hidden[s.seq_id])

    def finish(self, seq: Sequence) -> None:
        """Free a sequence's KV and proposer state."""
        self.target.remove(seq.seq_id)
        remove = getattr(self.proposer, "remove_request", None)
        if remove is not None:
            remove(seq.seq_id)

    def step(self, seqs: list[Sequence]) -> None:
        """Advance every sequence in ``seqs`` by one verify step (1..k+1 tokens each)."""
        B = len(seqs)
        device = self.target.device
        sampling = SamplingBatch.from_params([s.params for s in seqs], [s.generator for s in seqs], device)
        draft = self._propose(seqs, sampling)
        tree = draft.tree
        # draft tokens per row (host), capped so no row drafts past what it may emit
        lengths = draft.lengths if draft.lengths is not None else draft.num_tokens.tolist()
        k = draft.token_ids.shape[1]
        ids = draft.token_ids
        if tree is None:
            drafted = [min(n, max(s.room() - 1, 0)) for n, s in zip(lengths, seqs)]
            if k and drafted != [k] * B:
                n = torch.tensor(drafted).view(B, 1).to(ids.device)
                ids = torch.where(torch.arange(k, device=ids.device).view(1, k) < n, ids, -1)
        else:  # a tree keeps its nodes; those deeper than a row may emit are never accepted
            drafted = [n if s.room() > 1 else 0 for n, s in zip(lengths, seqs)]
            caps = [s.room() - 1 for s in seqs]
            if k and (drafted != [k] * B or min(caps) < tree.depth_bound):
                ids = drop_nodes(ids, tree, drafted, caps)
        draft.token_ids = ids
        # [B, k+1]: last token, then drafts; built where the drafts live (host for
        # model-free proposers, so the runner ships everything in one copy)
        last = torch.tensor([s.token_ids[-1] for s in seqs], dtype=torch.int64).view(B, 1).to(ids.device)
        inputs = torch.cat([last, ids.clamp_min(0)], dim=1)
        extra = {} if tree is None else {"tree": tree}
        out = self.target.forward([s.seq_id for s in seqs], inputs, [n + 1 for n in drafted], self.hidden_layers,
                                  **extra)
        verdict = self.verifier.verify(out.logits, draft, sampling)
        # the one host synchronisation of the step (none left if the verifier synced)
        parts = [verdict.num_accepted.view(B, 1), verdict.token_ids]
        if tree is not None:
            parts.append(verdict.path.to(verdict.token_ids.device))
        both = torch.cat(parts, dim=1).tolist()
        accepted = [r[0] for r in both]
        width = verdict.token_ids.shape[1]
        tokens = [r[1: 1 + width] for r in both]
        hidden = out.hidden_states or None
        if tree is not None:
            self._keep_paths(seqs, accepted, [r[1 + width:] for r in both])
            if hidden:  # the accepted path's states in path order, as for a chain
                hidden = gather_path(hidden, verdict.path)
        new_lengths = []
        for b, s in enumerate(seqs):
            a = accepted[b]
            old_len = len(s.token_ids)
            # KV kept: old tokens plus the accepted drafts (the new last token has none yet)
            self.target.truncate(s.seq_id, old_len + a)
            s.metrics.record_step(drafted[b], a)
            if tree is not None:
                s.metrics.record_tree(drafted[b])
            s.append(tokens[b][: a + 1], self.tokenizer)
            new_lengths.append(old_len + a + 1)
        if self.proposer is not None:
            self.proposer.observe(StepFeedback(
                seq_ids=[s.seq_id for s in seqs], num_accepted=accepted, new_lengths=new_lengths,
                hidden_states=hidden))

    def _keep_paths(self, seqs: list[Sequence], accepted: list[int], paths: list[list[int]]) -> None:
        """Move each accepted tree path's K/V into consecutive positions (the rest is then
        dropped by the truncation that follows)."""
        moves = [(s.seq_id, *path_moves(p, a, len(s.token_ids) - 1)) for s, a, p in zip(seqs, accepted, paths)]
        moves = [m for m in moves if m[1]]
        if moves:
            self.target.move_kv([m[0] for m in moves], [m[1] for m in moves], [m[2] for m in moves])

    def _propose(self, seqs: list[Sequence], sampling: SamplingBatch) -> Draft:
        if self.proposer is None or self.k == 0:
            return Draft.empty(len(seqs))
        draft = self.proposer.propose(ProposeBatch([s.view() for s in seqs], self.k, sampling))
        if draft.token_ids.shape[0] != len(seqs) or draft.token_ids.shape[1] > self.k:
            raise RuntimeError(
                f"proposer {type(self.proposer).__name__} returned draft of shape "
                f"{tuple(draft.token_ids.shape)}; expected [{len(seqs)}, <= {self.k}]"
            )
        if draft.tree is not None:
            draft.tree.check(draft.token_ids)
        return draft
