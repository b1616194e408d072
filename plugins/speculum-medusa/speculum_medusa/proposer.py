"""The ``medusa`` proposer: k drafts at once from one target state, no draft loop.

Per sequence it keeps the target's final normed state at the position that produced the
sequence's last token: after the prefill the last prefilled position, after a verify step
the last accepted one. Head ``i`` turns it into draft ``i + 1`` (token-aware heads also read
the sequence's last token, the one that state produced). Drafts are the heads'
argmax, or (for sampled requests) samples from each head's processed distribution,
reported as ``probs``; the heads' drafts are independent, which the verifier allows
(sequential heads: each head's distribution given the drafts before it, as a draft model's).

With a token tree in the config, the tree's nodes at depth ``d`` are top-k tokens of
head ``d - 1`` (Medusa's own tree decoding): a static tree (``speculative_token_tree``,
Medusa's ``medusa_choices``) or a dynamic one ranked by summed log-probabilities of the
heads; deterministic nodes for every request (``probs=None``).

Greedy drafts (trees, and chains of the config's k) are made from the verdict still on the
device (:class:`~speculum.interfaces.VerdictDrafter`): the state of each row's last accepted
position is gathered by the verdict's accepted count (and a tree's path), and the heads'
static function runs on it before the host has read the verdict; observe then keeps that
state, and the next propose of the same rows returns those drafts.

Heads with a prefix layer (:mod:`speculum_medusa.model`) keep the layer's KV cache and the
target states it has not read yet (:class:`~speculum_medusa.prefix.PrefixStates`): each
propose first feeds them (with the tokens they produced) through the layer and the heads
draft from its output; drafting from the verdict feeds the verify step's states first, with
the verdict's tokens, and gathers the output at the accepted count on the device (a CUDA
graph on a GPU, as the heads' drafting is; the catch-up at a propose stays eager).
"""

from __future__ import annotations

import logging
from pathlib import Path

import attrs
import torch

from speculum.backends.torch.heads import HeadKVCache, TargetParts, head_checkpoint_path, pick_tokens
from speculum.errors import ConfigError
from speculum.interfaces import Draft, ProposeBatch, SequenceView, StepFeedback, Verdict
from speculum.proposers.tree import tree_rows, unpack_tree
from speculum.tree import TokenTree, TreeSpec
from speculum_medusa.formats import load_medusa
from speculum_medusa.graph import MedusaGraphs
from speculum_medusa.prefix import PrefixStates

log = logging.getLogger(__name__)

HEADS = Path(__file__).resolve().parent / "heads"


@attrs.define(eq=False)
class _Launched:
    """Drafts made from a verdict still on the device (:meth:`MedusaProposer.draft_from_verdict`)."""

    #: the rows, in order, and the state each was drafted from [R, H]
    seq_ids: tuple[int, ...]
    x: torch.Tensor
    #: the drafts (every row), as the next propose of the same rows returns them
    draft: Draft
    #: rows whose observe has kept their state
    observed: set[int] = attrs.field(factory=set)
    #: with a prefix layer: each row's sequence length before the step (its layer cache was fed)
    lengths: dict[int, int] = attrs.field(factory=dict)


class MedusaProposer:
    hidden_layers = (-1,)
    supports_trees = True
    kv_lookahead = 0  # no positions past the sequence (a prefix layer's cache holds true positions only)

    def __init__(self, heads, sample: bool = True, tree: TreeSpec | None = None, k: int | None = None,
                 cuda_graphs: bool = False, cache: HeadKVCache | None = None):
        """``cache``: the prefix layer's KV cache (heads with a prefix layer need one)."""
        self.heads = heads
        if heads.prefixed and cache is None:
            raise ValueError("Medusa heads with a prefix layer need its KV cache (MedusaProposer.from_context plans one)")
        #: the prefix layer's state per sequence (None: heads without one)
        self.prefix = PrefixStates(heads, cache, cuda_graphs) if heads.prefixed else None
        self.sample = sample
        p = next(heads.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.last: dict[int, torch.Tensor | None] = {}
        #: the tree drafted each step (None: chains of k tokens)
        self.tree = tree
        #: greedy drafting as one static function (a CUDA graph per batch bucket on a GPU;
        #: eager elsewhere): trees always, chains of the config's k for greedy requests
        self.graphs = MedusaGraphs(heads, min(k or heads.num_heads, heads.num_heads), tree, self.device,
                                   use_graphs=cuda_graphs)
        #: drafts made from a verdict not yet on the host, until the next propose or rewind
        self._launched: _Launched | None = None

    @classmethod
    def from_context(cls, ctx) -> "MedusaProposer":
        path = head_checkpoint_path(ctx, "medusa", HEADS)
        target = TargetParts.from_runner(ctx.target)
        heads = load_medusa(path, target)
        k = ctx.config.num_speculative_tokens
        tree = ctx.config.tree
        if tree is not None and tree.depth > heads.num_heads:
            raise ConfigError(f"the {tree.describe()} needs {tree.depth} Medusa heads (one per depth) but {path} "
                              f"has {heads.num_heads}; use a tree of depth <= {heads.num_heads}")
        if tree is None and k > heads.num_heads:
            raise ConfigError(f"num_speculative_tokens={k} but {path} has {heads.num_heads} Medusa heads; "
                              f"use num_speculative_tokens <= {heads.num_heads}")
        heads = heads.to(device=target.embed.device, dtype=target.embed.dtype).eval().requires_grad_(False)
        log.info("Medusa heads %s: %d heads x %d layers%s%s%s", path, heads.num_heads, heads.num_layers,
                 " (shared LM head)" if heads.heads is None else "",
                 ", sequential" if heads.sequential else ", token-aware" if heads.token_input else "",
                 ", prefix layer" if heads.prefixed else "")
        cache = None
        if heads.prefixed:  # the prefix layer's KV cache, planned with the target's
            a = heads.prefix_arch
            cache = HeadKVCache("medusa", 1, a.num_kv_heads, a.head_dim, target.embed.dtype, target.embed.device,
                                max_model_len=ctx.max_model_len,
                                weight_bytes=sum(t.numel() * t.element_size() for t in heads.parameters()))
            cache.join_memory_plan(ctx.backend)
        return cls(heads, sample=ctx.config.draft_sample_method == "sample", tree=tree, k=k,
                   cuda_graphs=bool(getattr(ctx.target, "cuda_graphs", False)), cache=cache)

    def add_request(self, seq: SequenceView, hidden_states: dict[int, torch.Tensor] | None = None) -> None:
        h = hidden_states[-1]  # [len - 1, H]
        if self.prefix is not None:
            self.prefix.add(seq.seq_id, h)
            return
        self.last[seq.seq_id] = h[-1].clone() if h.shape[0] else None

    def remove_request(self, seq_id: int) -> None:
        self.last.pop(seq_id, None)
        if self.prefix is not None:
            self.prefix.remove(seq_id)
        if self._launched is not None and seq_id in self._launched.seq_ids:
            self._drop_launched()  # the batch changed: those drafts are for another step

    def rewind(self, seq_ids) -> None:
        """Nothing to take back: :meth:`propose` reads each sequence's last state and
        changes nothing (:class:`~speculum.interfaces.RewindableProposer`, so the loop may
        draft the next step ahead); trees drafted from a verdict are dropped (observe kept
        each row's state already). With a prefix layer the propose fed the layer true states
        only, which stay valid (:mod:`speculum_medusa.prefix`); a feed from a verdict whose row
        was never observed is cut back."""
        self._drop_launched()

    def _drop_launched(self) -> None:
        launched, self._launched = self._launched, None
        if launched is not None and self.prefix is not None:
            for sid, n in launched.lengths.items():
                if sid not in launched.observed:
                    self.prefix.take_back(sid, n)

    def draft_from_verdict(self, seq_ids, lengths, verdict: Verdict,
                           hidden_states: dict[int, torch.Tensor]) -> Draft | None:
        """Start the next drafts of ``seq_ids`` from the verify step's states at each row's
        last accepted position, found on the device from ``verdict`` (its accepted count and
        a tree's path), before the host reads it (:class:`~speculum.interfaces.VerdictDrafter`).
        For rows that drafted this step. Returns the drafts (still being computed) or None."""
        if ((self.tree is not None and verdict.path is None) or not hidden_states or self._launched is not None
                or (self.prefix is None and any(self.last.get(sid) is None for sid in seq_ids))):
            return None
        if self.prefix is not None:  # the layer fed this step's states; its output at the accepted count
            x = self.prefix.from_verdict(seq_ids, lengths, verdict, hidden_states[-1])
            if x is None:
                return None
            last_tok = None
        else:
            with torch.inference_mode():
                x = last_accepted_state(hidden_states[-1], verdict)
                last_tok = verdict.token_ids.gather(1, verdict.num_accepted.view(-1, 1)).squeeze(1) \
                    if self.heads.token_input else None  # the row's new last token, on the device
        with torch.inference_mode():
            out = self.graphs.run(x, last_tok)
        R = len(seq_ids)
        draft = Draft(token_ids=out, lengths=[out.shape[1]] * R) if self.tree is None else \
            self._tree_draft(R, list(range(R)), out)
        self._launched = _Launched(tuple(seq_ids), x, draft,
                                   lengths=dict(zip(seq_ids, lengths)) if self.prefix is not None else {})
        return draft

    def propose(self, batch: ProposeBatch) -> Draft:
        seqs, k = batch.seqs, batch.num_speculative_tokens
        B = len(seqs)
        launched = self._launched
        if (launched is not None and launched.seq_ids == tuple(s.seq_id for s in seqs)
                and launched.observed == set(launched.seq_ids)):  # drafted from the verdict already
            self._launched = None
            d = launched.draft
            return d if d.tree is not None or k == d.token_ids.shape[1] else \
                Draft(token_ids=d.token_ids[:, :k], lengths=[k] * B)
        self._drop_launched()  # drafts for another batch (a prefix layer's unobserved feeds cut back)
        if self.prefix is not None:  # the prefix layer's output at each row's last known position
            rows, x = self.prefix.catch_up(seqs)
        else:
            rows = [b for b, s in enumerate(seqs) if self.last.get(s.seq_id) is not None]
            x = torch.stack([self.last[seqs[b].seq_id] for b in rows]) if rows else None  # [R, H]
        if not rows:
            return Draft(token_ids=torch.full((B, k), -1, dtype=torch.int64, device=self.device), lengths=[0] * B)
        last_tok = torch.tensor([seqs[b].token_ids[-1] for b in rows], dtype=torch.int64).to(
            self.device, non_blocking=True) if self.heads.draft_reads_token else None  # the token each state produced
        if self.tree is not None:
            return self._tree_draft(B, rows, self.graphs.run(x, last_tok))
        sample = self.sample and not batch.sampling.all_greedy
        probs = None
        if not sample and not batch.sampling.needs_processing and k <= self.graphs.k:
            drafts = self.graphs.run(x, last_tok)[:, :k]  # a shorter step keeps a prefix of the heads' drafts
        else:
            drafts, probs = [], []
            with torch.inference_mode():
                x = self.heads.draft_input(x, last_tok)
                for i in range(k):
                    tok, p = pick_tokens(self.heads.logits(i, x), rows, batch.sampling, sample,
                                         torch.stack(drafts, dim=1) if drafts else None)
                    drafts.append(tok)
                    probs.append(p)
                    if i + 1 < k:
                        x = self.heads.advance(i, x, tok)
            drafts, probs = torch.stack(drafts, dim=1), torch.stack(probs, dim=1) if sample else None
        in_rows = set(rows)
        lengths = [k if b in in_rows else 0 for b in range(B)]
        if len(rows) == B:  # every row drafted (the usual case): no scatter
            return Draft(token_ids=drafts, probs=probs, lengths=lengths)
        idx = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)  # no synchronisation
        token_ids = torch.full((B, k), -1, dtype=torch.int64, device=self.device)
        token_ids[idx] = drafts
        q = None
        if probs is not None:
            q = torch.zeros(B, k, probs.shape[-1], dtype=probs.dtype, device=self.device)
            q[idx] = probs
        return Draft(token_ids=token_ids, probs=q, lengths=lengths)

    def _tree_draft(self, B: int, rows: list[int], packed: torch.Tensor) -> Draft:
        """The Draft of the drafting function's packed trees of ``rows`` (of ``B``)."""
        spec = self.tree
        N = spec.num_nodes
        tokens, parents, depth, anc = tree_rows(B, N, rows, unpack_tree(packed, N), self.device)
        in_rows = set(rows)
        lengths = [N if b in in_rows else 0 for b in range(B)]
        tree = TokenTree(parents, depth=depth, ancestors=anc, max_depth=spec.depth, max_children=spec.max_children)
        return Draft(token_ids=tokens, lengths=lengths, tree=tree)

    def observe(self, feedback: StepFeedback) -> None:
        launched = self._launched
        if feedback.hidden_states is None and launched is not None:  # drafted from the verdict: keep its states
            where = {sid: i for i, sid in enumerate(launched.seq_ids)}
            for sid, a in zip(feedback.seq_ids, feedback.num_accepted):
                if self.prefix is not None:
                    self.prefix.settle(sid, launched.lengths[sid], a, launched.x[where[sid]])
                else:
                    self.last[sid] = launched.x[where[sid]]
                launched.observed.add(sid)
            return
        h = feedback.hidden_states[-1]  # [B, k+1, H]
        if self.prefix is not None:  # the accepted positions' states and the new token's, fed at the next propose
            kept = h[:, : max(feedback.num_accepted, default=0) + 1].clone()  # (the target's buffers are reused)
            for b, (sid, a) in enumerate(zip(feedback.seq_ids, feedback.num_accepted)):
                self.prefix.observe(sid, kept[b, : a + 1])
            return
        acc = torch.tensor(feedback.num_accepted, dtype=torch.int64).to(h.device, non_blocking=True)  # no synchronisation
        last = h[torch.arange(h.shape[0], device=h.device), acc].clone()  # the state that made the new token
        for b, sid in enumerate(feedback.seq_ids):
            self.last[sid] = last[b]


def last_accepted_state(h: torch.Tensor, verdict: Verdict) -> torch.Tensor:
    """[B, H]: the verify step's state (``h`` [B, N+1, H], a chain's or a tree's columns) at
    each row's last accepted position (the root when none was accepted), chosen on the
    device: the value :meth:`MedusaProposer.observe` keeps from the same step's states (a
    tree's in path order)."""
    col = verdict.num_accepted.to(h.device, torch.int64).view(-1, 1)  # [B, 1]: a chain's column
    if verdict.path is not None:  # a tree's: the root, then the path's columns
        col = torch.nn.functional.pad(verdict.path.to(h.device) + 1, (1, 0)).gather(1, col)
    return h.gather(1, col.unsqueeze(-1).expand(-1, 1, h.shape[-1])).squeeze(1)
