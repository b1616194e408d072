"""The contracts of the draft-verify loop (Proposer, Verifier, KVAllocator, ModelRunner,
Backend) and the data that crosses them.

Shapes are written as ``# [B, k]`` comments above fields: ``B`` is the number of
sequences in a step, ``k`` the number of draft tokens, ``V`` the vocabulary size.
Token tensors use ``-1`` as padding.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

import attrs
import torch

from speculum.devices import on_device
from speculum.tree import TokenTree

if TYPE_CHECKING:  # pragma: no cover
    from speculum.sampling import SamplingBatch


@attrs.define(eq=False)
class SequenceView:
    """What a proposer may read about one running sequence."""

    seq_id: int
    # all tokens so far: prompt followed by output
    token_ids: list[int]
    num_prompt_tokens: int
    # per-request generator for sampled drafting (None for greedy requests)
    generator: torch.Generator | None = None


@attrs.define(eq=False)
class ProposeBatch:
    """Input of :meth:`Proposer.propose` for one engine step."""

    seqs: list[SequenceView]
    # the most draft tokens wanted per sequence this step
    num_speculative_tokens: int
    sampling: "SamplingBatch"


@attrs.define(eq=False)
class Draft:
    """Draft tokens for a batch. Rows may hold fewer than k tokens (padded with -1).

    With ``tree`` set, ``token_ids[b, i]`` is the token of tree node ``i`` (see
    :class:`speculum.tree.TokenTree`): nodes in topological order, ``-1`` for padding or
    for a node the loop dropped (such a node and its subtree are never accepted). Without
    it the drafts form a chain.
    """

    # [B, k] int64, -1 padded on the right
    token_ids: torch.Tensor
    # [B, k, V] float, the draft distribution each token was sampled from; None means
    # the draft is deterministic (counts as one-hot for the rejection sampler)
    probs: torch.Tensor | None = None
    # [B] leading valid tokens per row, on the host, when the proposer knows them without
    # reading the device (saves a synchronisation); None = count from token_ids
    lengths: list[int] | None = None
    # [B] int64 on the device: each row's leading valid drafts when ``lengths`` is only an
    # upper bound (chains drafted on the device from a verdict: the host has not read how
    # many each row found); the loop reads it with the verdict, for the metrics
    counts: torch.Tensor | None = None
    # the tree shape (parent of each node), on token_ids' device; None = a chain. With
    # probs given, node i's token must be drawn from probs[b, i] independently of its
    # siblings; with probs None the nodes are deterministic (one-hot for the verifier)
    tree: TokenTree | None = None

    @property
    def num_tokens(self) -> torch.Tensor:
        """[B] number of leading non-padding draft tokens per row."""
        valid = self.token_ids >= 0
        # count only the leading run of valid tokens
        return valid.to(torch.int64).cumprod(dim=1).sum(dim=1)

    @classmethod
    def empty(cls, batch_size: int, device: torch.device | str = "cpu") -> "Draft":
        return cls(token_ids=torch.full((batch_size, 0), -1, dtype=torch.int64, device=device))

    def scatter(self, rows: Sequence[int], batch_size: int) -> "Draft":
        """This draft (of ``len(rows)`` rows) as rows ``rows`` of a ``batch_size``-row draft;
        the other rows get nothing (-1; zero probabilities; a tree without nodes)."""
        B, k = batch_size, self.token_ids.shape[1]
        dev = self.token_ids.device
        idx = on_device(list(rows), dev)
        token_ids = torch.full((B, k), -1, dtype=torch.int64, device=dev)
        token_ids[idx] = self.token_ids.to(torch.int64)
        probs = None
        if self.probs is not None:
            probs = torch.zeros((B, *self.probs.shape[1:]), dtype=self.probs.dtype, device=self.probs.device)
            probs[idx.to(probs.device)] = self.probs
        lengths = None
        if self.lengths is not None:
            lengths = [0] * B
            for r, b in enumerate(rows):
                lengths[b] = self.lengths[r]
        tree = None
        if self.tree is not None:  # rows without drafts: no nodes (their parents are the root)
            t = self.tree
            parents = torch.full((B, k), -1, dtype=torch.int64, device=dev)
            parents[idx] = t.parents
            depth = torch.ones(B, k, dtype=torch.int64, device=dev)
            depth[idx] = t.depth
            anc = torch.eye(k, dtype=torch.bool, device=dev).expand(B, k, k).clone()
            anc[idx] = t.ancestors
            tree = TokenTree(parents, depth=depth, ancestors=anc, max_depth=t.max_depth, max_children=t.max_children)
        return Draft(token_ids=token_ids, probs=probs, lengths=lengths, tree=tree)


@attrs.define(eq=False)
class Verdict:
    """Output of :meth:`Verifier.verify`."""

    # [B, k+1] int64: accepted draft tokens followed by one target token, -1 padded
    token_ids: torch.Tensor
    # [B] number of draft tokens accepted (0..k); emitted = num_accepted + 1
    num_accepted: torch.Tensor
    # [B, N] for tree drafts: the accepted nodes' indices from the root down, -1 padded
    # (token_ids holds their tokens); None for chains (the accepted drafts are 0..a-1)
    path: torch.Tensor | None = None
    # [B, 1 + k+1 (+ N)] int64 or None: num_accepted, token_ids (and a tree's path) side by
    # side, when the verifier made them as views of one tensor (:meth:`packed` checks they
    # still are): the loop and a proposer drafting from the verdict then copy it whole,
    # with no launch to join them
    rows: torch.Tensor | None = None

    @classmethod
    def from_rows(cls, rows: torch.Tensor, path_width: int = 0) -> "Verdict":
        """The verdict over ``rows`` [B, 1 + k+1 + path_width] int64: the accepted count, the
        tokens, then (a tree's, ``path_width`` > 0) the accepted path."""
        end = rows.shape[1] - path_width
        return cls(token_ids=rows[:, 1:end], num_accepted=rows[:, 0], path=rows[:, end:] if path_width else None,
                   rows=rows)

    def packed(self) -> torch.Tensor | None:
        """``rows`` while ``num_accepted``, ``token_ids`` and ``path`` are still its views (a
        verifier that replaced one leaves a stale ``rows``), else None."""
        r = self.rows
        if r is None:
            return None
        tw = self.token_ids.shape[-1]
        pw = 0 if self.path is None else self.path.shape[-1]
        if r.dim() != 2 or r.shape[1] != 1 + tw + pw:
            return None
        base, size = r.data_ptr(), r.element_size()
        views = [(self.num_accepted, base, r.stride()[:1]), (self.token_ids, base + size, r.stride())]
        if self.path is not None:
            views.append((self.path, base + size * (1 + tw), r.stride()))
        if any(t.data_ptr() != ptr or t.stride() != stride for t, ptr, stride in views):
            return None
        return r

    def as_rows(self) -> torch.Tensor:
        """[B, 1 + k+1 (+ N)] int64, count, tokens (and path) side by side: :meth:`packed`,
        else joined now (one concatenation, on the tokens' device)."""
        r = self.packed()
        if r is not None:
            return r
        dev = self.token_ids.device
        parts = [self.num_accepted.view(-1, 1), self.token_ids] + ([] if self.path is None else [self.path])
        return torch.cat([t.to(dev, torch.int64) for t in parts], dim=1)


@attrs.define(eq=False)
class StepFeedback:
    """What a proposer learns after verification (:meth:`Proposer.observe`)."""

    seq_ids: list[int]
    # [B] draft tokens accepted per row
    num_accepted: list[int]
    # [B] new sequence length (prompt + output) after this step, before stop cuts
    new_lengths: list[int]
    # requested target hidden states, if the proposer asked for any
    hidden_states: dict[int, torch.Tensor] | None = None


@runtime_checkable
class Proposer(Protocol):
    """Makes draft tokens. Model-free proposers return ``probs=None``."""

    def propose(self, batch: ProposeBatch) -> Draft:
        """Return up to ``batch.num_speculative_tokens`` draft tokens per sequence."""

    def observe(self, feedback: StepFeedback) -> None:
        """Learn the outcome of verification (roll back draft caches, adapt).

        Called after every step that drafted for the proposer's requests. A
        :class:`HiddenStateProposer` is also called after steps that did not call
        :meth:`propose` (a step whose speculation length is 0: load-aware speculation,
        ``speculum.spec_length``), to receive the target's states of the new token; then
        ``num_accepted`` is 0 and whatever it had pending must be kept. Other proposers
        catch up from the sequence's tokens at their next :meth:`propose`.
        """


@runtime_checkable
class StatefulProposer(Proposer, Protocol):
    """A proposer with per-request state (its own KV cache, for example).

    One whose state is made lazily and forgotten on its own may set ``hooks_optional =
    True``: a composite (``"method": "a+b"``, :mod:`speculum.proposers.first_draft`) may then
    use it before its last part, where its hooks are never called (n-gram lookup: its device
    copy of each sequence's tokens, made by drafting from the verdict, which a composite's
    first part never does)."""

    def add_request(self, seq: SequenceView) -> None:
        """Called once when a sequence starts running (prefill the draft state)."""

    def remove_request(self, seq_id: int) -> None:
        """Called when a sequence finishes, is preempted or aborted; free its state."""


@runtime_checkable
class RewindableProposer(StatefulProposer, Protocol):
    """A stateful proposer that can take back its last propose.

    With overlapped steps the loop drafts the next step right after this one is verified,
    before the engine's bookkeeping, and launches its forward; when the next step turns
    out different (a request joined, finished, was aborted or preempted) the loop calls
    :meth:`rewind` for the sequences still running, instead of verifying those drafts.
    Proposers without it never draft ahead.
    """

    def rewind(self, seq_ids: Sequence[int]) -> None:
        """Undo the last :meth:`propose` for these sequences (state and caches as before it);
        sequences it did not draft for are ignored."""


@runtime_checkable
class VerdictDrafter(RewindableProposer, Protocol):
    """A rewindable proposer that starts the next step's drafts from this step's verdict
    while the verdict is still on the device, before the host has read it.

    With overlapped greedy steps the loop calls :meth:`draft_from_verdict` right after the
    verifier ran, then waits for the verdict's copy to the host; the drafting runs on the
    device meanwhile, instead of after the host's bookkeeping of the step. The loop then
    calls :meth:`~Proposer.observe` as usual (which settles the drafts for the accepted
    counts; the hidden states were handed over already, so that feedback carries none)
    and either the next :meth:`~Proposer.propose` for the same sequences, which returns
    those drafts, or :meth:`~RewindableProposer.rewind`, which takes them back. The
    verdict is a chain's (``path`` None: the accepted drafts are the first columns) or a
    tree's (``path``: the accepted nodes); a proposer that drafts only one of them
    returns None for the other.
    """

    def draft_from_verdict(self, seq_ids: Sequence[int], lengths: Sequence[int], verdict: Verdict,
                           hidden_states: dict[int, torch.Tensor]) -> Draft | None:
        """Launch the next drafts of ``seq_ids`` (their lengths before this step's tokens)
        from ``verdict`` and the verify step's ``hidden_states`` (columns as the target
        computed them) and return them (every row, tensors still being computed: the loop
        may launch the target's next forward on them before the verdict reaches the host);
        None when it cannot (nothing launched)."""


@runtime_checkable
class HiddenStateProposer(StatefulProposer, Protocol):
    """A proposer that drafts from the target's hidden states (EAGLE, MTP, Medusa...).

    The engine asks the target for ``hidden_layers`` (layer ``i >= 0``: the output of
    decoder layer ``i``; ``-1``: the final normed state) at prefill, handed to
    ``add_request(seq, hidden_states={layer: [len - 1, H]})`` (every position but the
    last token's, which is the input of the first verify step), and at every verify step
    (``StepFeedback.hidden_states``, ``{layer: [B, k+1, H]}``).
    """

    hidden_layers: tuple[int, ...]

    def add_request(self, seq: SequenceView, hidden_states: dict[int, torch.Tensor] | None = None) -> None:
        """Start a sequence from the target's prefill hidden states."""


@runtime_checkable
class Verifier(Protocol):
    """Decides which draft tokens the target accepts.

    A verifier that accepts tree drafts (``Draft.tree``) sets ``supports_trees = True``
    and returns ``Verdict.path``; the engine refuses tree configs otherwise. One that sets
    ``takes_argmax = True`` is called with ``argmax=`` ([B, k+1] int64, the logits' argmax)
    when the runner made it (``ForwardOutput.argmax``) and no logits processor changed the
    logits, so it need not compute it.
    """

    #: True when output has exactly the target's distribution.
    lossless: bool

    def verify(self, target_logits: torch.Tensor, draft: Draft, sampling: "SamplingBatch") -> Verdict:
        """``target_logits``: [B, k+1, V] at the last token and each draft position (each
        tree node, for tree drafts)."""


@runtime_checkable
class KVAllocator(Protocol):
    """Bookkeeping of one cache group's KV blocks per sequence. Owns no tensors.

    What the scheduler asks: how many more blocks a sequence needs to hold ``n`` tokens,
    how many are free; what runners do: allocate, roll back by length, free.
    """

    group: str
    block_size: int
    #: the longest sequence this group holds (None: no limit)
    max_model_len: int | None

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds."""

    @property
    def num_usable_blocks(self) -> int:
        """Blocks sequences can hold in all (the scratch block excluded)."""

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """More blocks ``seq_id`` needs to hold ``num_tokens`` tokens in all."""

    def allocate(self, seq_id: int, num_tokens: int) -> None:
        """Reserve ``num_tokens`` more slots (raises ``KVCacheFull`` if they do not fit)."""

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep the first ``length`` slots; later ones are free to reuse."""

    def free(self, seq_id: int) -> None:
        """Release every slot of the sequence."""

    def length(self, seq_id: int) -> int:
        """Slots held by the sequence."""

    def usage(self) -> float:
        """Fraction of the budget in use (0..1)."""

    def check(self) -> None:
        """Raise AssertionError if a block is leaked or held twice (tests, soaks)."""


class KVCacheFull(RuntimeError):
    """Raised when an allocation does not fit the KV budget."""


@attrs.define(eq=False)
class ForwardOutput:
    # [B, q, V] float32
    logits: torch.Tensor
    # layer index -> [B, q, H]; only the layers asked for
    hidden_states: dict[int, torch.Tensor] = attrs.field(factory=dict)
    # [B] bool: every logit of the row is finite, computed by a runner that can do it for free
    # (inside its CUDA graph: five kernel launches less of host time per step); None: read
    # it through finite_rows()
    finite: torch.Tensor | None = None
    # [B, q] int64: each position's argmax of ``logits``, computed by a runner that can do it
    # for free (inside its CUDA graph: one launch less of host time per greedy step); None:
    # a verifier computes it. The loop hands it to verifiers with ``takes_argmax`` (and only
    # when no logits processor changed the logits)
    argmax: torch.Tensor | None = None

    @staticmethod
    def finite_of(logits: torch.Tensor) -> torch.Tensor:
        """[B] bool: whether every entry of ``logits`` [B, ...] is finite (no NaN, no inf)."""
        return torch.isfinite(logits).flatten(1).all(-1)

    def finite_rows(self) -> torch.Tensor:
        """:attr:`finite`, or computed from the logits now."""
        return self.finite if self.finite is not None else self.finite_of(self.logits)

    def take_rows(self, idx: torch.Tensor | slice) -> "ForwardOutput":
        """The rows ``idx`` (an index tensor or a slice) of every per-row field."""
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[idx]
        return ForwardOutput(logits=self.logits[idx], hidden_states={l: h[idx] for l, h in self.hidden_states.items()},
                             finite=pick(self.finite), argmax=pick(self.argmax))


@runtime_checkable
class ModelRunner(Protocol):
    """A backend's handle on one loaded model with a KV cache it can roll back.

    Positions: a sequence of length ``L`` keeps KV for its first ``L - 1`` tokens; the
    last token is the input of the next forward.
    """

    name: str
    vocab_size: int
    device: torch.device
    #: the longest sequence it serves
    max_model_len: int

    def add(self, seq_id: int, token_ids: Sequence[int], hidden_layers: Sequence[int] = ()) -> dict[int, torch.Tensor]:
        """Start a sequence: run the prefill over ``token_ids`` (may be empty).

        Returns ``{layer: [len(token_ids), H]}``, the requested hidden states of every
        prefilled position (see :meth:`forward` for the layer numbering).
        """

    def add_many(self, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]],
                 hidden_layers: Sequence[int] = ()) -> dict[int, dict[int, torch.Tensor]]:
        """Prefill several sequences together; returns ``{seq_id: {layer: [len, H]}}``.

        Optional keyword ``logits_sink(seq_id, start, logits [n, V])``: a runner that
        accepts it hands over the logits of every prefilled position, chunk by chunk
        (``prompt_logprobs`` need it; the engine refuses them for a runner without it).
        """

    def forward(self, seq_ids: Sequence[int], token_ids: torch.Tensor, num_tokens: Sequence[int],
                hidden_layers: Sequence[int] = ()) -> ForwardOutput:
        """Append tokens and return logits.

        ``token_ids``: [B, q] (padding past ``num_tokens[b]`` is ignored and not kept).
        Returns logits [B, q, V] and the requested hidden states. Hidden layer ``i >= 0``
        is the output stream of decoder layer ``i``; ``-1`` is the final normed state (the
        LM head's input).

        A runner with ``supports_trees = True`` also takes ``tree=`` (a
        :class:`~speculum.tree.TokenTree` of ``q - 1`` nodes: column 0 is the root; each node
        gets the position root + depth and sees its ancestors only) and has
        ``move_kv(seq_ids, src, dst)``, which copies the K/V of logical positions ``src[b]``
        to ``dst[b]`` (the accepted path, into consecutive positions).

        A runner with ``takes_last_tokens = True`` also takes ``last_tokens=`` (each row's
        column 0, a list on the host): ``token_ids`` is then [B, q - 1], the drafts after
        it, whose ids the runner clamps into the vocabulary itself (padding -1 included).
        The loop then ships the last tokens with the runner's own metadata instead of
        building [B, q] on the device (a copy, a clamp and a concatenation: ~60 us of host
        time a step on the H200). Wrappers of a runner pass every keyword through.
        """

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep KV for the first ``length`` positions only (rollback by length)."""

    def length(self, seq_id: int) -> int:
        """Positions with KV kept for the sequence."""

    def remove(self, seq_id: int) -> None:
        """Drop the sequence and its KV."""


@runtime_checkable
class CacheGroup(Protocol):
    """Something that keeps KV tensors of its own and is planned with the target's: a
    draft model's runner, a draft head's cache. The backend gives every group the same
    number of blocks (:meth:`Backend.plan_memory`) and hands each its allocator."""

    name: str
    #: bytes of KV one token costs in this group
    kv_bytes_per_token: int
    #: bytes of weights it holds (for the memory plan's log)
    weight_bytes: int
    #: the longest sequence it holds (a draft runs up to k positions past the target)
    max_model_len: int

    def attach_cache(self, allocator: KVAllocator) -> None:
        """Allocate KV tensors for ``allocator``'s blocks."""


@runtime_checkable
class Backend(Protocol):
    """Runs models for the engine: loads runners, plans their KV memory, captures graphs.

    The engine talks to a backend through this protocol only (``LLM(backend=...)``
    picks one registered through ``speculum_register_backends``).
    """

    name: str
    device: torch.device
    dtype: torch.dtype

    def load_model(self, path: Path, role: str = "target", max_model_len: int | None = None,
                   num_layers: int | None = None) -> ModelRunner:
        """Load a checkpoint as a runner for ``role`` ("target", "draft"...); a paged runner
        becomes a cache group of the memory plan."""

    def register_cache(self, group: CacheGroup) -> None:
        """Plan ``group`` (a draft head's cache...) with the runners' caches."""

    def plan_memory(self, max_model_len: int, max_num_seqs: int | None = None, lookahead: int = 0) -> None:
        """Split the KV budget into equally many blocks for every cache group (after all
        models are loaded); raises ``KVCacheFull`` when one sequence does not fit."""

    def kv_allocators(self) -> list[KVAllocator]:
        """The planned allocators of every bounded cache group (empty: no KV budget)."""

    def capture(self, runner: ModelRunner, batch_sizes: Sequence[int], query_lens: Sequence[int],
                hidden_layers: Sequence[int] = (), tree_query_lens: Sequence[int] = ()) -> int:
        """Prepare fast paths (CUDA graphs...) for these shapes, and for token-tree verify
        forwards of ``tree_query_lens`` tokens; returns how many (0: none)."""
