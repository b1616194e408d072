"""The trainer contract (one per method) and the losses the methods share.

A trainer is found through the entry point group ``speculum.train`` (plugins register
theirs in their ``pyproject.toml``; ``draft`` is built in). The generic loop in
:mod:`speculum.train.loop` owns data, optimiser, checkpoints and validation; a trainer
only says what it needs, builds the module, computes the loss and writes its format.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import attrs
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from speculum.errors import ConfigError
from speculum.train.data import Batch, DistillData

if TYPE_CHECKING:  # the torch heads load when a trainer runs, not when plugins are listed
    from speculum.backends.torch import TargetParts


class Trainer:
    """Base class of method trainers (subclass and override)."""

    #: method name (``speculum train <name>``)
    name = ""
    description = ""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Method-specific options."""

    def data_layers(self, args: argparse.Namespace, num_target_layers: int) -> tuple[int, ...]:
        """Target hidden layers the data must hold (``-1`` = final normed state)."""
        return (-1,)

    def positions(self, args: argparse.Namespace) -> int:
        """Draft positions trained and reported (validation accuracy per position)."""
        return int(getattr(args, "num_positions", 1))

    def build(self, args: argparse.Namespace, target: TargetParts, target_state: dict[str, torch.Tensor],
              data: DistillData, train_ids: list[int]) -> nn.Module:
        """The module to train, initialised (``target_state``: the target's weights)."""
        raise NotImplementedError

    def loss(self, module: nn.Module, batch: Batch, target: TargetParts,
             args: argparse.Namespace) -> tuple[torch.Tensor, "Score"]:
        """(scalar loss, :class:`Score`): top-1 agreement with the target per draft position
        and chain acceptance (:func:`chain_score`). A 3-tuple (loss, correct [K], counted
        [K]) is accepted too (no acceptance length then)."""
        raise NotImplementedError

    def export(self, module: nn.Module, out: Path, target: TargetParts, args: argparse.Namespace,
               meta: dict[str, Any]) -> None:
        """Write the trained module in its public checkpoint format."""
        raise NotImplementedError

    def load(self, path: Path, target: TargetParts, args: argparse.Namespace) -> nn.Module:
        """A checkpoint of this method's public format, as a module whose state :meth:`build`'s
        module takes (``--init-from``: start training from it)."""
        raise ConfigError(f"`speculum train {self.name}` cannot start from a checkpoint (--init-from); "
                          "train from scratch, or --resume a run of its own")


@attrs.define(eq=False)
class Score:
    """Top-1 agreement with the target per draft position, and greedy-chain acceptance.

    An *anchor* ``t`` is a position whose token ``x_{t+1}`` is known: a chain drafted
    there predicts ``x_{t+2}, x_{t+3}, ...`` (draft positions ``0, 1, ...``).
    ``correct[j] / count[j]`` is the agreement at draft position ``j`` over every answer
    anchor. On a greedy answer the tokens are the target's argmax, so a chain from ``t``
    is accepted through position ``j`` exactly when positions ``0..j`` agree: ``runs[j]``
    counts such anchors among ``anchors`` (greedy-answer anchors scored at every position).

    ``tokens / steps`` replays greedy chain drafting over each greedy answer, as the
    engine runs it: from the first answer anchor, accept the leading agreeing drafts
    (at most ``K``, and never past the answer), emit them plus the target's token, and
    continue from there. That is the mean acceptance length the engine measures on these
    answers with the same numerics: :meth:`acceptance_length`. (Averaging chains over every
    anchor instead overstates it, since acceptance comes in bursts: an easy stretch holds
    many anchors but the engine starts few chains in it.)
    """

    correct: torch.Tensor  # [K]
    count: torch.Tensor    # [K]
    runs: torch.Tensor     # [K]
    anchors: torch.Tensor  # []
    #: answer tokens and verify steps of the replay (0 when not replayed, e.g. in training)
    tokens: float = 0.0
    steps: float = 0.0

    @classmethod
    def zeros(cls, K: int) -> "Score":
        return cls(torch.zeros(K), torch.zeros(K), torch.zeros(K), torch.zeros(()))

    @classmethod
    def coerce(cls, value) -> "Score":
        """A Score, or one from a trainer's (correct, count) pair (no chain figures)."""
        if isinstance(value, Score):
            return value
        correct, count = value
        return cls(correct.float(), count.float(), torch.zeros_like(correct.float()), torch.zeros(()))

    def __add__(self, other: "Score") -> "Score":
        return Score(self.correct + other.correct, self.count + other.count, self.runs + other.runs,
                     self.anchors + other.anchors, self.tokens + other.tokens, self.steps + other.steps)

    def accuracy(self) -> list[float]:
        """Agreement per position."""
        return [round(float(c / n), 4) if n else 0.0 for c, n in zip(self.correct, self.count)]

    def acceptance(self) -> list[float]:
        """Per position: the chance a greedy chain from an answer anchor is accepted there,
        given it was accepted up to there."""
        prev = [self.anchors] + list(self.runs[:-1])
        return [round(float(r / p), 4) if p else 0.0 for r, p in zip(self.runs, prev)]

    def acceptance_length(self) -> float | None:
        """Mean acceptance length of greedy chain drafting with ``K`` drafts per step over the
        greedy answers (the replay; None when nothing was replayed)."""
        if not self.steps:
            return None
        return round(self.tokens / self.steps, 3)


def replay_chains(lead: torch.Tensor, first: torch.Tensor, remaining: torch.Tensor) -> tuple[float, float]:
    """(tokens, steps) of greedy chain drafting over rows of answers.

    ``lead`` [B, T]: leading agreeing drafts from each anchor; ``first`` [B]: a row's first
    answer anchor (-1: none); ``remaining`` [B]: tokens after the first anchor's known token.
    Each step accepts ``min(lead[t], left - 1)`` drafts and emits them plus one target token.
    """
    lead_l, first_l, rem_l = lead.tolist(), first.tolist(), remaining.tolist()
    tokens = steps = 0
    for row, t, left in zip(lead_l, first_l, rem_l):
        if t < 0:
            continue
        T = len(row)
        while left > 0:
            a = min(row[t] if t < T else 0, left - 1)
            steps += 1
            tokens += a + 1
            left -= a + 1
            t += a + 1
    return float(tokens), float(steps)


def chain_score(ok: Sequence[torch.Tensor], scored: Sequence[torch.Tensor], greedy: torch.Tensor | None,
                valid: torch.Tensor | None = None) -> Score:
    """A :class:`Score` from per-position results aligned at anchors.

    ``ok[j]`` / ``scored[j]`` ([B, T_j] bool, anchor ``t`` at column ``t``): the draft for
    position ``j`` from anchor ``t`` agrees with the target / is scored (a target token of
    the answer). ``greedy`` [B]: rows whose answer is greedy (None: all). ``valid`` [B, T]
    (the batch's positions with a hidden state) turns on the replay of chain drafting.
    """
    K = len(ok)
    T = min(o.shape[1] for o in ok)
    correct = torch.stack([(o & s).sum() for o, s in zip(ok, scored)]).float().cpu()
    count = torch.stack([s.sum() for s in scored]).float().cpu()
    every = scored[0][:, :T].clone()
    for s in scored[1:]:
        every &= s[:, :T]
    rows = torch.ones(ok[0].shape[0], dtype=torch.bool, device=every.device) if greedy is None \
        else greedy.to(every.device)
    every &= rows.view(-1, 1)
    run = every
    runs = []
    for j in range(K):
        run = run & ok[j][:, :T]
        runs.append(run.sum())
    score = Score(correct, count, torch.stack(runs).float().cpu(), every.sum().float().cpu())
    if valid is not None:
        Tf = valid.shape[1]
        pad = lambda x: torch.nn.functional.pad(x, (0, Tf - x.shape[1]))  # noqa: E731
        lead = torch.zeros(valid.shape, dtype=torch.int64, device=valid.device)
        on = torch.ones(valid.shape, dtype=torch.bool, device=valid.device)
        for o, s in zip(ok, scored):
            on = on & pad(o & s)
            lead += on
        s0 = pad(scored[0]) & rows.view(-1, 1)
        has = s0.any(dim=1)
        first = torch.where(has, s0.int().argmax(dim=1), -1)
        # tokens after anchor t's known token x_{t+1}: positions t + 2 .. n - 1 (n - 1 = valid count)
        remaining = torch.where(has, valid.sum(dim=1) - first - 1, 0)
        score.tokens, score.steps = replay_chains(lead.cpu(), first.cpu(), remaining.cpu())
    return score


def scatter_rows(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A bool tensor shaped like ``mask`` holding ``values`` where ``mask`` is set."""
    out = torch.zeros_like(mask)
    out[mask] = values
    return out


def soft_ce(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``logits`` [N, V] against target probabilities [N, V] (mean over N)."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    return -(probs * F.log_softmax(logits.float(), dim=-1)).sum(dim=-1).mean()


#: logits of at most this many elements [rows x vocabulary] are scored at once (1 GiB in fp32)
CE_CHUNK_ELEMENTS = 1 << 28


def row_chunks(n: int, width: int, elements: int | None = None) -> list[slice]:
    """Slices of ``n`` rows, each holding at most ``elements`` (default :data:`CE_CHUNK_ELEMENTS`)
    values of ``width`` (one row at least)."""
    step = max(1, (elements or CE_CHUNK_ELEMENTS) // width)
    return [slice(s, s + step) for s in range(0, n, step)]


def _ce_sum(score, o: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = score(o)
    return -(probs[rows] * F.log_softmax(logits.float(), dim=-1)).sum(), logits.argmax(-1)


def scored_ce(score, o: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor,
              chunk_elements: int = CE_CHUNK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft cross-entropy (mean over rows) of ``score(o)`` [N, V] against ``probs[rows]``, and
    the argmax of ``score(o)`` (the draft's top token in ``score``'s vocabulary).

    Up to ``chunk_elements`` logits this is :func:`soft_ce` on them. Above, rows go in chunks
    whose logits are recomputed in the backward pass (``torch.utils.checkpoint``): autograd
    then keeps ``o`` instead of several [N, V] float tensors per call. A whole-vocabulary loss
    over a batch of 32 x 640 tokens holds ~10 GB per unrolled step without it, which let one
    trainer take 74 GB of the H200 and the next one beside it run out of memory (2026-12-05).
    """
    N, V = o.shape[0], probs.shape[-1]
    if N * V <= chunk_elements or N == 0:
        logits = score(o)
        return soft_ce(logits, probs[rows]), logits.argmax(-1)
    total, preds = o.new_zeros((), dtype=torch.float32), []
    for c in row_chunks(N, V, chunk_elements):
        args = (score, o[c], probs, rows[c])
        if torch.is_grad_enabled() and o.requires_grad:
            part, pred = torch.utils.checkpoint.checkpoint(_ce_sum, *args, use_reentrant=False)
        else:
            part, pred = _ce_sum(*args)
        total, preds = total + part, preds + [pred]
    return total / N, torch.cat(preds)


class TargetDist:
    """The target's next-token distribution at every training position of a batch, once.

    Position ``s`` (``batch.target_mask(0)``) holds the target's distribution of
    ``x_{s+1}``, from its final normed state and LM head. With ``vocab`` (sorted target
    ids) the probabilities are over that sub-vocabulary: EAGLE-3's draft vocabulary, or
    the frequent tokens a full-vocabulary head is trained on to save compute. ``argmax``
    is the target's top token (target ids): over the whole vocabulary when ``full``
    (validation), else within ``vocab``.
    """

    def __init__(self, batch: Batch, lm_head: torch.Tensor, loss_on: str = "answer",
                 vocab: torch.Tensor | None = None, full: bool = False):
        need = batch.target_mask(0, loss_on)
        self.index = torch.full(need.shape, -1, dtype=torch.int64, device=need.device)
        self.index[need] = torch.arange(int(need.sum()), device=need.device)
        feats = batch.hidden[-1][need]
        w = lm_head if vocab is None else lm_head[vocab]
        whole = full and vocab is not None  # the top token over the whole vocabulary, not within vocab
        N = feats.shape[0]
        self.probs = torch.empty(N, w.shape[0], device=feats.device)  # [N, V or Vs], filled in chunks
        top = torch.empty(N, dtype=torch.int64, device=feats.device)
        # (the whole [N, V] logits at once would double the peak)
        for c in row_chunks(N, lm_head.shape[0] if whole else w.shape[0]):
            logits = target_logits(feats[c], w)
            self.probs[c] = logits.softmax(dim=-1)
            top[c] = (target_logits(feats[c], lm_head) if whole else logits).argmax(dim=-1)
        self.argmax = vocab[top] if vocab is not None and not whole else top

    def rows(self, shift: int, anchors: torch.Tensor) -> torch.Tensor:
        """Rows of the positions ``t + shift`` for the anchors ``t`` selected by ``anchors``."""
        return self.index[:, shift:][anchors]


def target_logits(feats: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """The target's logits from its final normed states [N, H] (no gradient)."""
    with torch.no_grad():
        return F.linear(feats.to(lm_head.dtype), lm_head).float()


def agreement(pred: torch.Tensor, want: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows where the predicted token ids equal the target's, rows), on the CPU."""
    return (pred == want).float().sum().detach().cpu(), torch.tensor(float(pred.shape[0]))


def chain_unroll(head, batch: Batch, steps: int):
    """Run a chain head ``steps`` times over every anchor of a batch (training-time test).

    Step 0 reads the true features ``f_t`` and tokens ``x_{t+1}`` at position ``t``; step
    ``j`` reads the head's own output of step ``j - 1`` and ``x_{t+j+1}`` at position
    ``t + j``, attending as it would at inference. Yields ``(j, out [B, T, H])``; the
    output of step ``j`` at anchor ``t`` predicts ``x_{t+j+2}``.
    """
    from speculum.backends.torch import TrainContext
    from speculum.train.data import shifted
    B, T = batch.tokens.shape
    ctx = TrainContext()
    pos = torch.arange(T, device=batch.tokens.device).expand(B, T)
    feat = head.features(batch.hidden)
    for j in range(steps):
        ctx.next_step()
        out = head(feat, shifted(batch.tokens, j + 1), pos + j, ctx)
        yield j, out
        feat = out


def chain_loss(head, batch: Batch, target: TargetParts, args, vocab: torch.Tensor | None, score,
               extra=None) -> tuple[torch.Tensor, Score]:
    """The unrolled loss of a chain head (EAGLE, EAGLE-3, MTP) and its agreement per step.

    At step ``j`` the output at anchor ``t`` is scored (``score(o) -> logits`` over
    ``vocab``, None = the whole vocabulary) against the target's distribution of
    ``x_{t+j+2}`` with soft cross-entropy; ``extra(ce, j, o, mask)`` may turn that into
    the step's loss (EAGLE-1 adds its feature regression). Step ``j`` weighs
    ``args.step_decay ** j``.
    """
    K = args.num_positions
    td = TargetDist(batch, target.lm_head, args.loss_on, vocab=vocab, full=not head.training)
    T = batch.tokens.shape[1]
    total = torch.zeros((), device=batch.tokens.device)
    ok, scored = [], []
    for j, out in chain_unroll(head, batch, K):
        m = batch.target_mask(j + 1, args.loss_on)
        rows = td.rows(j + 1, m)
        o = out[:, : T - j - 1][m]
        step, pred = scored_ce(score, o, td.probs, rows)
        if extra is not None:
            step = extra(step, j, o, m)
        total = total + args.step_decay ** j * step
        ok.append(scatter_rows(m, (pred if vocab is None else vocab[pred]) == td.argmax[rows]))
        scored.append(m)
    return total, chain_score(ok, scored, batch.greedy, None if head.training else batch.valid)


def feature_regression(batch: Batch, ce_weight: float, reg_weight: float, feature=lambda o: o):
    """``chain_loss``'s ``extra`` for EAGLE-1's loss: ``ce_weight`` x the step's cross-entropy plus
    ``reg_weight`` x SmoothL1 of ``feature(o)`` (the head's predicted normed state) onto the target's
    next final normed state, the feature the head reads at the next position (not computed at
    ``reg_weight`` 0)."""
    def extra(ce, j, o, m):
        if not reg_weight:
            return ce_weight * ce
        want = batch.hidden[-1][:, j + 1:][m]
        return ce_weight * ce + reg_weight * F.smooth_l1_loss(feature(o).float(), want.float())
    return extra


def layers_to_add(path, noun: str, have: int, want: int) -> int:
    """How many decoder layers ``--num-layers want`` adds to the checkpoint at ``path`` (``noun``:
    "the head", "the module"), which has ``have``; fewer than it has is a ConfigError (a trained
    layer is never dropped silently)."""
    if want < have:
        raise ConfigError(f"--init-from {path}: {noun} has {have} layers, --num-layers asks for {want}; give "
                          f"--num-layers {have} (or more: its layers, then new ones that start as identity maps)")
    return want - have


def layer_from_target(layer, target_state: dict[str, torch.Tensor], index: int) -> None:
    """Initialise a head's decoder layer from target layer ``index`` (same shapes).

    A wider attention input (EAGLE-3's [embedding; feature]) gets the target's weights on
    the feature half and zeros on the embedding half.
    """
    from speculum.backends.torch import load_layer
    prefix = f"model.layers.{index}."
    qkv = layer.attn.qkv
    width = layer.mlp_norm.weight.shape[0]
    if qkv.in_features == width:
        load_layer(layer, target_state, prefix, "target")
        return
    with torch.no_grad():
        w = torch.cat([target_state[prefix + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        qkv.weight.zero_()
        qkv.weight[:, qkv.in_features - width:] = w.to(qkv.weight.dtype)
        layer.attn.o.weight.copy_(target_state[prefix + "self_attn.o_proj.weight"])
        layer.mlp.gate_up.weight.copy_(torch.cat([target_state[prefix + "mlp.gate_proj.weight"],
                                                  target_state[prefix + "mlp.up_proj.weight"]]))
        layer.mlp.down.weight.copy_(target_state[prefix + "mlp.down_proj.weight"])
        layer.mlp_norm.weight.copy_(target_state[prefix + "post_attention_layernorm.weight"])
        if layer.input_norm is not None:
            layer.input_norm.weight.copy_(target_state[prefix + "input_layernorm.weight"])


def frequent_tokens(data: DistillData, ids: list[int], n: int, vocab_size: int) -> torch.Tensor:
    """The ``n`` most frequent answer tokens of sequences ``ids`` (then the most frequent of
    all tokens, then the lowest ids), as ascending target ids."""
    n = min(n, vocab_size)
    counts = torch.bincount(data.answer_tokens(ids).cpu(), minlength=vocab_size).double() * 1e6
    counts += torch.bincount(data.tokens.cpu(), minlength=vocab_size).double()[:vocab_size]
    counts += torch.linspace(1e-3, 0, vocab_size, dtype=torch.float64)  # deterministic ties
    return counts.topk(n).indices.sort().values


def loss_vocab(module, target: TargetParts, args) -> torch.Tensor | None:
    """The sub-vocabulary the loss uses in training (None: the whole vocabulary, and always
    in validation, so reported accuracy is exact)."""
    if not module.training or not getattr(args, "loss_vocab", 0):
        return None
    return module.loss_vocab
