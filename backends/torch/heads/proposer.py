"""Hidden-state draft heads: the shared proposer for EAGLE, EAGLE-3 and MTP-style heads.

Such a head reads the target's hidden states instead of running a second model. At
position ``t`` it takes a *feature* ``f_t`` (made from the target's hidden states at ``t``)
and the embedding of the next token ``x_{t+1}``, runs its decoder layer(s) over its own KV
cache and predicts ``x_{t+2}``; its output hidden state is the feature of the next draft
step, so one head drafts a chain of ``k`` tokens.

Per sequence the proposer keeps *pending* features: true target features the head has
not consumed yet (the prefill's, then those of the accepted verify positions). Each step

1. catches up: runs the head over the pending ``(f_t, x_{t+1})`` pairs; the output at
   the last one gives draft 1;
2. feeds its own output back ``k - 1`` times (draft 2..k), with the drafts as tokens;
3. after verification (:meth:`ChainHeadProposer.observe`) truncates its KV cache to the
   positions made from true features, and keeps the target's states of the accepted
   positions as the next pending features. Rejected work is overwritten, never copied.

Heads implement :class:`ChainHead`. Drafts are the head's argmax, or samples from its
processed distribution (returned as ``probs``) for sampled requests, so the rejection
sampler keeps output lossless either way.

With a token tree in the config (``speculative_token_tree``, or ``tree_topk`` /
``tree_depth`` / ``num_draft_tokens``) step 2 drafts a tree instead: one batched head
forward per depth over the frontier nodes (:class:`~speculum.backends.torch.heads.graph.HeadTreeGraphs`),
deterministic top-k children for greedy and sampled requests alike (``probs=None``; the
tree verifier treats them as one-hot, which is exact). The verify step hands back the
accepted path's target states in path order, so step 3 is unchanged.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol, Sequence

import attrs
import torch

from speculum.backends.torch.heads.cache import HeadKVCache
from speculum.backends.torch.heads.graph import HeadDraftGraphs, HeadTreeGraphs, greedy_tokens
from speculum.devices import on_device
from speculum.errors import ConfigError
from speculum.interfaces import Draft, KVCacheFull, ProposeBatch, SequenceView, StepFeedback, Verdict
from speculum.proposers.head_checkpoint import find_shipped_head, read_config, shipped_names, target_fingerprint
from speculum.proposers.tree import region_size, tree_rows, unpack_tree
from speculum.sampling import SamplingBatch, processed_probs, sample_rows
from speculum.tree import TokenTree, TreeSpec, gather_path

log = logging.getLogger(__name__)


class ChainHead(Protocol):
    """What :class:`ChainHeadProposer` needs from a head module."""

    #: cache geometry of the head's decoder layers
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def features(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """Target hidden states {layer: [..., Ht]} -> true features [..., H]."""

    def forward(self, feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """feats [B, q, H], tokens [B, q] (x_{t+1}), positions [B, q] -> output hidden [B, q, H]."""

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Output hidden [..., H] -> logits over the target vocabulary [..., V]."""

    # optional: ``greedy(out) -> [...]`` argmax target ids, when cheaper than logits().argmax


def target_weights(runner) -> tuple[torch.Tensor, torch.Tensor]:
    """(input embedding [V, H], LM head [V, H]) of a target runner, shared, not copied.

    Returned detached: plain tensors over the target's storage, so a head that keeps them
    as attributes does not register them as its own parameters (nor count, move or save
    them)."""
    model = getattr(runner, "model", None)
    if model is not None and hasattr(model, "embed") and hasattr(model, "lm_head"):  # native runner
        return model.embed.weight.detach(), model.lm_head.weight.detach()
    if model is not None and hasattr(model, "get_input_embeddings"):  # transformers runner
        return model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach()
    raise ConfigError(f"hidden-state heads need the target's embedding and LM head; the {type(runner).__name__} "
                      "runner exposes neither (use the torch backend)")


@attrs.define(eq=False)
class TargetParts:
    """What a head shares with or checks against its target."""

    # [V, H] input embedding and LM head (shared tensors, same device and dtype as the target)
    embed: torch.Tensor
    lm_head: torch.Tensor
    num_layers: int
    name: str | None = None
    #: the target's config.json (when read from a checkpoint)
    config: dict = attrs.field(factory=dict)

    @property
    def hidden_size(self) -> int:
        return int(self.embed.shape[1])

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.shape[0])

    @classmethod
    def from_runner(cls, runner) -> "TargetParts":
        embed, head = target_weights(runner)
        return cls(embed, head, int(getattr(runner, "num_layers", 0) or 0))

    @classmethod
    def from_checkpoint(cls, path: Path, dtype: torch.dtype = torch.float32, device="cpu") -> "TargetParts":
        """Embedding and LM head read from a transformers checkpoint (for training)."""
        from speculum.backends.torch.native.weights import read_state_dict
        cfg = read_config(path)
        sd = read_state_dict(path)
        embed = sd["model.embed_tokens.weight"].to(device, dtype)
        tied = cfg.get("tie_word_embeddings") or "lm_head.weight" not in sd
        head = embed if tied else sd["lm_head.weight"].to(device, dtype)
        return cls(embed, head, int(cfg.get("num_hidden_layers", 0)), Path(path).name, cfg)

    def fingerprint(self) -> dict:
        return target_fingerprint(self.embed, self.name, self.num_layers)

    def check(self, what: str, hidden_size: int | None = None, vocab_size: int | None = None) -> None:
        """ConfigError when a head's hidden size or vocabulary does not fit this target."""
        if hidden_size is not None and hidden_size != self.hidden_size:
            raise ConfigError(f"{what} has hidden size {hidden_size}, but the target's is {self.hidden_size}; "
                              "the head was made for another model. Use a head trained for this target.")
        if vocab_size is not None and vocab_size != self.vocab_size:
            raise ConfigError(f"{what} vocabulary size {vocab_size} differs from the target's {self.vocab_size}; "
                              "the head was made for another model. Use a head trained for this target.")


def head_checkpoint_path(ctx, method: str, shipped_root: Path) -> Path:
    """``model`` of the speculative config, or the shipped head made for this target."""
    have = shipped_names(shipped_root, method)
    if ctx.config.model:
        shipped = (f"or leave 'model' unset to use the {method} head shipped for {', '.join(have)}" if have
                   else "")
        return ctx.resolve_draft_path(hint=f"{shipped}{', ' if shipped else 'or '}train one with "
                                           f"`speculum train {method} --model <target>`")
    fp = TargetParts.from_runner(ctx.target).fingerprint()
    found = find_shipped_head(shipped_root, method, fp)
    if found is None:
        raise ConfigError(
            f"method {method!r} needs 'model': the path of a {method} checkpoint for this target. "
            f"The plugin ships heads only for: {', '.join(have) or '(none)'}; train one with "
            f"`speculum train {method} --model <target>`."
        )
    log.info("%s: using the shipped head %s", method, found.name)
    return found


def pick_tokens(logits: torch.Tensor, rows: Sequence[int], sampling: SamplingBatch,
                sample: bool, drafted: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft token per row from logits [R, V] (rows index the step's batch).

    Greedy requests (or ``sample=False``) take the argmax and no probabilities; sampled
    ones draw from the processed distribution and return it ([R, V]). ``drafted`` [R, i]:
    this step's drafts so far, which penalties and bad words count
    (:meth:`SamplingBatch.process_logits`).
    """
    if sampling.needs_processing:
        logits = sampling.process_logits(logits.unsqueeze(1), drafted, 0 if drafted is None else drafted.shape[1],
                                         rows=rows)[:, 0]
    if not sample or sampling.all_greedy:
        return logits.argmax(dim=-1), None
    idx = on_device(list(rows), sampling.temperature.device)
    p = processed_probs(logits.unsqueeze(1), sampling.temperature[idx], sampling.top_k[idx],
                        sampling.top_p[idx])[:, 0]
    gens = sampling.generators
    gens = [gens] * len(rows) if isinstance(gens, torch.Generator) or gens is None else [gens[b] for b in rows]
    return sample_rows(p, gens), p


@attrs.define(eq=False)
class _Launched:
    """Drafts launched from a verdict still on the device (:meth:`ChainHeadProposer.draft_from_verdict`)."""

    seq_ids: tuple[int, ...]
    #: per sequence, its head-cache length before the catch-up
    bases: dict[int, int]
    #: [R, Q, H] the catch-up's true features (row order of seq_ids)
    feats: torch.Tensor
    #: the drafts (every row), as the next propose of the same rows returns them
    draft: Draft
    #: sequences whose accepted count observe() has applied
    observed: set[int] = attrs.field(factory=set)


class ChainHeadProposer:
    """Chain (or tree) drafting with a :class:`ChainHead` over its own paged KV cache."""

    #: drafts token trees when the config asks for one
    supports_trees = True

    def __init__(self, head, hidden_layers: Sequence[int], cache: HeadKVCache, sample: bool = True,
                 k: int | None = None, cuda_graphs: bool = False, static_draft: bool | None = None,
                 tree: TreeSpec | None = None):
        self.head = head
        #: target layers whose hidden states the engine hands over
        self.hidden_layers = tuple(hidden_layers)
        self.cache = cache
        self.sample = sample
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.pending: dict[int, torch.Tensor | None] = {}
        #: per sequence drafted for by the last propose: (its pending states, head-cache
        #: length) before it, for :meth:`rewind`
        self._before: dict[int, tuple[torch.Tensor, int]] = {}
        #: per sequence, states of steps it did not draft for (speculation length 0, or
        #: another proposer drafted: ``"ngram+eagle3"``), as (the step's features [B, q, H],
        #: row, positions kept: the accepted drafts and the new token): folded into
        #: ``pending`` when it drafts next
        self.backlog: dict[int, list[tuple[torch.Tensor, int, int]]] = {}
        # greedy steps after a request's first run as one static function, replayed as a
        # CUDA graph (``static_draft`` forces the static function on or off; tests run it
        # eagerly on the CPU)
        self.graphs = None
        #: the tree drafted each step (None: chains); trees always use the static function
        self.tree = tree
        #: drafts made from a verdict not yet on the host, until the next propose or rewind
        self._launched: _Launched | None = None
        if tree is not None:
            self.graphs = HeadTreeGraphs(head, cache, tree, self.dtype, self.device, use_graphs=cuda_graphs)
        elif k and (cuda_graphs if static_draft is None else static_draft):
            self.graphs = HeadDraftGraphs(head, cache, k, self.dtype, self.device, use_graphs=cuda_graphs)

    @property
    def kv_lookahead(self) -> int:
        """Head-cache positions a step may append beyond the sequence (engine KV accounting)."""
        return self.graphs.extra + 1 if self.tree is not None else 0

    @classmethod
    def for_head(cls, ctx, head, hidden_layers: Sequence[int], name: str) -> "ChainHeadProposer":
        """Build the proposer and its cache, planned with the target's (``ctx`` of the engine)."""
        p = next(head.parameters())
        # the head's own weights (the target's embedding / LM head are not its parameters)
        weight_bytes = sum(t.numel() * t.element_size() for t in head.parameters())
        tree = ctx.config.tree
        extra = ctx.config.num_speculative_tokens
        if tree is not None:
            extra = max(extra, region_size(tree) + 1)
        cache = HeadKVCache(name, head.num_layers, head.num_kv_heads, head.head_dim, p.dtype, p.device,
                            max_model_len=ctx.max_model_len + extra, weight_bytes=weight_bytes)
        cache.join_memory_plan(ctx.backend)
        return cls(head, hidden_layers, cache, sample=ctx.config.draft_sample_method == "sample",
                   k=ctx.config.num_speculative_tokens, cuda_graphs=bool(getattr(ctx.target, "cuda_graphs", False)),
                   tree=tree)

    # -- per-request state ------------------------------------------------------------------
    def add_request(self, seq: SequenceView, hidden_states: dict[int, torch.Tensor] | None = None) -> None:
        if hidden_states is None:
            raise RuntimeError(f"{type(self).__name__} needs the target's prefill hidden states; the engine "
                               "passes them to proposers that declare hidden_layers")
        self.cache.add(seq.seq_id)
        with torch.inference_mode():
            self.pending[seq.seq_id] = self.head.features(hidden_states)  # [len - 1, H]

    def remove_request(self, seq_id: int) -> None:
        if self._launched is not None:
            self._launched.bases.pop(seq_id, None)  # the batch changed: the next propose takes these back
        self.cache.remove(seq_id)
        self.pending.pop(seq_id, None)
        self.backlog.pop(seq_id, None)
        self._before.pop(seq_id, None)

    # -- drafting ---------------------------------------------------------------------------
    def _run(self, seq_ids, feats, tokens, counts) -> torch.Tensor:
        positions, ctx = self.cache.prepare(seq_ids, counts, tokens.shape[1])
        return self.head(feats, tokens, positions, ctx)

    def _take_launched(self, seqs) -> Draft | None:
        """The drafts :meth:`draft_from_verdict` launched for exactly ``seqs``, every row
        observed since; anything else launched is taken back. Clears the launch."""
        launched, self._launched = self._launched, None
        if launched is None:
            return None
        if tuple(s.seq_id for s in seqs) == launched.seq_ids and launched.observed == set(launched.seq_ids):
            return launched.draft
        self._take_back(launched)
        return None

    def propose(self, batch: ProposeBatch) -> Draft:
        if self.tree is not None:
            return self._propose_tree(batch)
        seqs, k = batch.seqs, batch.num_speculative_tokens
        B = len(seqs)
        launched = self._take_launched(seqs)
        if launched is not None:  # drafted from the verdict already (greedy, every row)
            return launched if k == launched.token_ids.shape[1] else Draft(token_ids=launched.token_ids[:, :k],
                                                                         lengths=[k] * B)
        for s in seqs:
            self._fold(s.seq_id)
        rows = [b for b, s in enumerate(seqs) if self.pending.get(s.seq_id) is not None
                and self.pending[s.seq_id].shape[0] > 0]
        def blank() -> torch.Tensor:  # [B, k] of -1 (made only when some row has no draft)
            return torch.full((B, k), -1, dtype=torch.int64, device=self.device)

        if not rows:  # e.g. one-token prompts: no target state to start from yet
            return Draft(token_ids=blank(), lengths=[0] * B)
        sids = [seqs[b].seq_id for b in rows]
        feats = [self.pending[s] for s in sids]
        self._remember(sids, feats)
        counts = [f.shape[0] for f in feats]
        R, P = len(rows), max(counts)
        sample = self.sample and not batch.sampling.all_greedy
        lengths = [0] * B
        for b in rows:
            lengths[b] = k
        if self.graphs is not None and not sample and self.graphs.fits(counts):
            # [R, graphs' k]: the static function drafts the engine's k; a shorter step keeps a prefix
            out = self.graphs.run(sids, feats, [seqs[b].token_ids[-n:] for b, n in zip(rows, counts)], counts)[:, :k]
            for s in sids:
                self.pending[s] = None  # consumed: the cache now holds them
            if R == B:  # every row drafted (the usual case): no scatter
                return Draft(token_ids=out, lengths=lengths)
            token_ids = blank()
            token_ids[on_device(rows, self.device)] = out  # no synchronisation: the draft is still running
            return Draft(token_ids=token_ids, lengths=lengths)
        x = torch.zeros(R, P, feats[0].shape[-1], dtype=self.dtype, device=self.device)
        toks = torch.zeros(R, P, dtype=torch.int64)
        for i, (b, f, n) in enumerate(zip(rows, feats, counts)):
            x[i, :n] = f
            toks[i, :n] = torch.tensor(seqs[b].token_ids[-n:], dtype=torch.int64)  # x_{t+1} of each pending t
        toks = toks.to(self.device, non_blocking=True)
        drafts, probs = [], []
        # argmax ids straight from the head when nothing reads the logits (EAGLE-3: no
        # scatter of its draft vocabulary into the whole one, no argmax over all of it)
        direct = not sample and not batch.sampling.needs_processing
        with torch.inference_mode():
            out = self._run(sids, x, toks, counts)
            last = out[torch.arange(R, device=self.device), on_device(counts, self.device) - 1]
            for i in range(k):
                if direct:
                    tok, p = greedy_tokens(self.head, last), None
                else:
                    tok, p = pick_tokens(self.head.logits(last), rows, batch.sampling, sample,
                                         torch.stack(drafts, dim=1) if drafts else None)
                drafts.append(tok)
                probs.append(p)
                if i + 1 < k:
                    last = self._run(sids, last.unsqueeze(1), tok.view(R, 1), [1] * R)[:, 0]
        for s in sids:
            self.pending[s] = None  # consumed: the cache now holds them
        idx = on_device(rows, self.device)
        token_ids = blank()
        token_ids[idx] = torch.stack(drafts, dim=1)
        q = None
        if sample:
            V = probs[0].shape[-1]
            q = torch.zeros(B, k, V, dtype=probs[0].dtype, device=self.device)
            q[idx] = torch.stack(probs, dim=1)
        return Draft(token_ids=token_ids, probs=q, lengths=lengths)

    def _propose_tree(self, batch: ProposeBatch) -> Draft:
        """A token tree per sequence (the rows with pending target states)."""
        seqs, spec, graphs = batch.seqs, self.tree, self.graphs
        B, N, dev = len(seqs), spec.num_nodes, self.device
        launched = self._take_launched(seqs)
        if launched is not None:  # drafted from the verdict already
            return launched
        for s in seqs:
            self._fold(s.seq_id)
        rows = [b for b, s in enumerate(seqs) if self.pending.get(s.seq_id) is not None
                and self.pending[s.seq_id].shape[0] > 0]
        lengths, out = [0] * B, None
        if rows:
            sids = [seqs[b].seq_id for b in rows]
            feats = [self.pending[s] for s in sids]
            self._remember(sids, feats)
            counts = [f.shape[0] for f in feats]
            toks = [seqs[b].token_ids[-n:] for b, n in zip(rows, counts)]  # x_{t+1} of each pending t
            over = [i for i, n in enumerate(counts) if n > graphs.Q]
            if over:  # a first step: the catch-up beyond what the static function takes, eagerly
                pre = [counts[i] - graphs.Q for i in over]
                x = torch.zeros(len(over), max(pre), feats[0].shape[-1], dtype=self.dtype, device=dev)
                t = torch.zeros(len(over), max(pre), dtype=torch.int64)
                for j, (i, n) in enumerate(zip(over, pre)):
                    x[j, :n] = feats[i][:n]
                    t[j, :n] = torch.tensor(toks[i][:n], dtype=torch.int64)
                with torch.inference_mode():
                    self._run([sids[i] for i in over], x, t.to(dev, non_blocking=True), pre)
                for i, n in zip(over, pre):
                    feats[i], toks[i], counts[i] = feats[i][n:], toks[i][n:], graphs.Q
            out = unpack_tree(graphs.run(sids, feats, toks, counts), N)
            for s in sids:
                self.pending[s] = None  # consumed: the cache now holds them
            for b in rows:
                lengths[b] = N
        return self._tree_draft(B, rows, out, lengths)

    def _tree_draft(self, B: int, rows: list[int], out, lengths: list[int]) -> Draft:
        """The Draft of ``rows`` (of ``B``) from the drafting function's unpacked trees ``out``."""
        spec = self.tree
        token_ids, parents, depth, anc = tree_rows(B, spec.num_nodes, rows, out, self.device)
        tree = TokenTree(parents, depth=depth, ancestors=anc, max_depth=spec.depth, max_children=spec.max_children)
        return Draft(token_ids=token_ids, lengths=lengths, tree=tree)

    def _remember(self, sids: Sequence[int], feats: Sequence[torch.Tensor]) -> None:
        """What a propose about to consume ``feats`` changes, for :meth:`rewind`."""
        self._before = {sid: (f, self.cache.length(sid)) for sid, f in zip(sids, feats)}

    def rewind(self, seq_ids: Sequence[int]) -> None:
        """Undo the last propose for ``seq_ids`` (a step drafted ahead that never ran): its
        pending states come back and the head-cache positions it appended are dropped (their
        K/V is overwritten when the states are consumed again)."""
        if self._launched is not None:
            self._take_back(self._launched)
            self._launched = None
        for sid in seq_ids:
            self._restore(sid)

    def _restore(self, sid: int) -> None:
        """A sequence's pending states and head-cache length as before the last propose (if it had one)."""
        before = self._before.pop(sid, None)
        if before is not None and sid in self.pending:
            self.pending[sid], length = before
            self.cache.truncate(sid, length)

    # -- drafting from a verdict still on the device (VerdictDrafter) ------------------------
    def draft_from_verdict(self, seq_ids: Sequence[int], lengths: Sequence[int], verdict: Verdict,
                           hidden_states: dict[int, torch.Tensor]) -> Draft | None:
        """Start the next drafts of ``seq_ids`` now, from the device verdict of the step just
        verified (:class:`~speculum.interfaces.VerdictDrafter`): the catch-up runs over the
        accepted drafts' states and tokens (a tree's along its accepted path), as many as the
        verdict accepted plus one, which only the device knows yet. Greedy drafting by the
        static function (trees; chains where it drafts them: CUDA graphs), and only for rows
        whose pending states this step's propose consumed (the usual step: no backlog, not
        a first step). Returns the drafts (still being computed) or None."""
        if (self.graphs is None or (self.tree is not None and verdict.path is None) or not hidden_states
                or self._launched is not None):
            return None
        if any(sid not in self.pending or self.pending[sid] is not None or self.backlog.get(sid) for sid in seq_ids):
            return None
        Q = self.graphs.Q
        bases = [n - 1 for n in lengths]  # the head caches the positions made from true features: 0 .. length - 2
        with torch.inference_mode():
            # the accepted states as observe() gets them (the same features, bit for bit), first Q columns
            states = hidden_states if verdict.path is None else gather_path(hidden_states, verdict.path)
            feats = self.head.features(states)[:, :Q]
            # [count | tokens (| path)]: a greedy verdict has them in one tensor already
            rows = verdict.as_rows().to(self.device)
            try:
                out = self.graphs.run_from_device(list(seq_ids), bases, feats, rows)
            except KVCacheFull:  # the longest outcome does not fit now: draft after the copy, as usual
                return None
        R = len(seq_ids)
        if self.tree is None:
            draft = Draft(token_ids=out, lengths=[out.shape[1]] * R)
        else:
            N = self.tree.num_nodes
            draft = self._tree_draft(R, list(range(R)), unpack_tree(out, N), [N] * R)
        self._launched = _Launched(tuple(seq_ids), dict(zip(seq_ids, bases)), feats, draft)
        self._before = {}  # the last propose was verified: nothing of it to take back
        return draft

    def _settle(self, sid: int, num_accepted: int) -> bool:
        """observe() for a row drafted from its verdict: the accepted count cuts the head
        cache to what that drafting keeps; its states are remembered for a rewind."""
        launched = self._launched
        if launched is None or sid not in launched.bases or sid in launched.observed:
            return False
        base, i = launched.bases[sid], launched.seq_ids.index(sid)
        self.graphs.settle(sid, base, num_accepted + 1)
        self.pending[sid] = None  # consumed by that drafting
        self._before[sid] = (launched.feats[i, : num_accepted + 1], base)
        launched.observed.add(sid)
        return True

    def _take_back(self, launched: _Launched) -> None:
        """Undo drafts launched from a verdict that no propose took: rows observed get their
        pending states back (as observe() would have left them), every row its head cache
        as before the catch-up."""
        for sid, base in launched.bases.items():
            if sid in launched.observed:  # _settle remembered (its states, base)
                self._restore(sid)
            elif sid in self.pending:
                self.cache.truncate(sid, base)

    def _fold(self, seq_id: int) -> None:
        """Join a sequence's backlog of draft-less steps to its pending states."""
        backlog = self.backlog.pop(seq_id, None)
        if backlog:
            with torch.inference_mode():
                self.pending[seq_id] = torch.cat([self.pending[seq_id]] + [f[b, :n] for f, b, n in backlog])

    def observe(self, feedback: StepFeedback) -> None:
        rows = [b for b, (sid, a) in enumerate(zip(feedback.seq_ids, feedback.num_accepted)) if not self._settle(sid, a)]
        if not rows:  # every row was drafted from its verdict already (the loop then hands no states)
            return
        hs = feedback.hidden_states
        if hs is None:
            raise RuntimeError(f"{type(self).__name__} got no hidden states from the verify step")
        with torch.inference_mode():
            feats = self.head.features(hs)  # [B, k+1, H]
            # the states of the accepted positions, copied once for every row (the target's
            # buffers are reused) and kept by reference: no tensor op per row
            kept = feats[:, : max(feedback.num_accepted, default=0) + 1].clone()
        for b in rows:
            sid, a, new_len = feedback.seq_ids[b], feedback.num_accepted[b], feedback.new_lengths[b]
            # this step's drafts were verified: nothing of them to take back (a later rewind
            # concerns only the propose that follows, which may leave this row to another part)
            self._before.pop(sid, None)
            prev = self.pending.get(sid)
            if prev is not None and prev.shape[0] > 0:
                # no propose for this row this step (speculation length 0, or another
                # proposer drafted): nothing was cached; the states of the accepted drafts
                # and the new token join what is still to catch up on
                backlog = self.backlog.setdefault(sid, [])
                backlog.append((kept, b, a + 1))
                if len(backlog) >= 64:  # bounded: fold now and then
                    self._fold(sid)
                continue
            # keep KV of the positions made from true features: 0 .. old length - 2
            self.cache.truncate(sid, new_len - a - 2)
            # the target's states of the last token and the accepted drafts come next
            self.pending[sid] = kept[b, : a + 1]
