"""``speculum train medusa``: Medusa-1 heads by self-distillation.

Head ``i`` at position ``t`` reads the target's final normed state ``h_t`` and learns the
target's distribution of ``x_{t+i+2}`` (soft cross-entropy against the target's own
next-token distribution at ``t + i + 1``), weighted ``--head-decay ** i`` as in Medusa.
Blocks start as the identity (zero weights) so each head starts as the target's head.
``--token-input``: token-aware heads (:mod:`speculum_medusa.model`) that also read the token
``x_{t+1}``; with ``--init-from`` a Medusa-1 checkpoint they start as its heads (the token
map at zero). ``--sequential``: token-aware heads that also read the tokens drafted before
them (:mod:`speculum_medusa.model`), trained on the true ones (teacher forcing: the drafts an
accepted prefix holds are the true tokens); with ``--init-from`` token-aware heads they start
as those (the maps at zero). ``--prefix-layer``: a decoder layer over the heads' features of
every position, causal (after Hydra++'s prefix attention; :mod:`speculum_medusa.model`),
whose output the heads read; it starts as the identity, so with ``--init-from`` heads without
one they start as those.
"""

from __future__ import annotations

import torch

from speculum.backends.torch.heads import arch_from_config
from speculum.errors import ConfigError
from speculum.train.base import TargetDist, Trainer, chain_score, loss_vocab, scatter_rows, scored_ce
from speculum.train.data import shifted
from speculum_medusa.formats import load_medusa, save_medusa
from speculum_medusa.model import MedusaHeads

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class MedusaTrainer(Trainer):
    name = "medusa"
    description = "Medusa-1 heads (ResBlocks + shared or own LM head), one per draft position"

    def add_arguments(self, p) -> None:
        g = p.add_argument_group("Medusa")
        g.add_argument("--num-heads", type=int, default=4, help="Medusa heads (draft positions)")
        g.add_argument("--num-layers", type=int, default=1, help="ResBlocks per head")
        g.add_argument("--own-lm-head", action="store_true",
                       help="give each head its own LM head (a V x H copy each; default: share the target's)")
        g.add_argument("--token-input", action="store_true",
                       help="token-aware heads: each head also reads the token x_{t+1} its state produced "
                            "(the sequence's last token, known when the heads run; speculum's extension)")
        g.add_argument("--sequential", action="store_true",
                       help="sequentially dependent heads (after Hydra): head i also reads the tokens drafted by "
                            "heads 0..i-1 (implies --token-input; speculum's extension)")
        g.add_argument("--prefix-layer", action="store_true",
                       help="a decoder layer of the target's shape over the heads' features of every position, "
                            "whose output the heads read (after Hydra++'s prefix attention; speculum's extension; "
                            "starts as the identity, so --init-from heads without one start as those)")
        g.add_argument("--head-decay", type=float, default=0.8, help="loss weight of head i is decay**i")
        g.add_argument("--save-dtype", choices=sorted(DTYPES), default="bfloat16", help="dtype of the exported weights")
        p.set_defaults(lr=1e-3)

    def positions(self, args) -> int:
        return args.num_heads

    def build(self, args, target, state, data, train_ids):
        heads = MedusaHeads(target.hidden_size, target.vocab_size, args.num_heads, args.num_layers,
                            lm_head=None if args.own_lm_head else target.lm_head,
                            embed=target.embed if token_aware(args) else None, sequential=args.sequential,
                            prefix=prefix_arch(args, target))
        if heads.heads is not None:
            with torch.no_grad():
                for h in heads.heads:
                    h.weight.copy_(target.lm_head)
        return heads

    def loss(self, heads, batch, target, args):
        K = args.num_heads
        vocab = loss_vocab(heads, target, args)
        td = TargetDist(batch, target.lm_head, args.loss_on, vocab=vocab, full=not heads.training)
        nxt = shifted(batch.tokens, 1)
        x = heads.sequence_features(batch.hidden[-1], nxt)  # h_t and x_{t+1} (through the prefix layer)
        T = x.shape[1]
        total = torch.zeros((), device=x.device)
        ok, scored = [], []
        for i, z in enumerate(heads.teacher_forced(x, nxt, K)):
            m = batch.target_mask(i + 1, args.loss_on)
            rows = td.rows(i + 1, m)
            ce, pred = scored_ce(lambda zz, i=i: heads.logits(i, zz, vocab), z[:, : T - i - 1][m], td.probs, rows)
            total = total + args.head_decay ** i * ce
            ok.append(scatter_rows(m, (pred if vocab is None else vocab[pred]) == td.argmax[rows]))
            scored.append(m)
        # heads 0..i agree at anchor t: a greedy chain from t is accepted through draft i
        return total, chain_score(ok, scored, batch.greedy, None if heads.training else batch.valid)

    def export(self, heads, out, target, args, meta):
        save_medusa(heads, out, base_model=target.name or "", meta=meta, dtype=DTYPES[args.save_dtype])

    def load(self, path, target, args):
        """The checkpoint at ``path``; with ``--num-layers`` above its own, grown to that many
        blocks per head: the checkpoint's blocks first, then zero-initialised ones (identity
        maps); with ``--token-input`` and Medusa-1 heads, given a zero token map; with
        ``--sequential`` and heads that are not, given zero maps of the drafted tokens; with
        ``--prefix-layer`` and heads without one, given one that starts as the identity. Either
        way the grown heads start out drafting exactly as the checkpoint's did."""
        heads = load_medusa(path, target)
        extra = args.num_layers - heads.num_layers
        if extra < 0:
            raise ConfigError(f"--init-from {path}: its heads have {heads.num_layers} blocks each, --num-layers "
                              f"asks for {args.num_layers}; give --num-layers {heads.num_layers} (or more: the "
                              "checkpoint's blocks, then identity ones)")
        if heads.sequential and not args.sequential:
            raise ConfigError(f"--init-from {path}: its heads are sequential (speculum_sequential); give --sequential")
        if heads.token_input and not token_aware(args):
            raise ConfigError(f"--init-from {path}: its heads are token-aware (speculum_token_input); give --token-input")
        pre_asked = bool(getattr(args, "prefix_layer", False))
        if heads.prefixed and not pre_asked:
            raise ConfigError(f"--init-from {path}: its heads have a prefix layer (speculum_prefix_layer); give "
                              "--prefix-layer")
        token = token_aware(args) and not heads.token_input
        seq = args.sequential and not heads.sequential
        pre = pre_asked and not heads.prefixed
        if extra <= 0 and not token and not seq and not pre:
            return heads
        grown = MedusaHeads(heads.hidden_size, heads.vocab_size, heads.num_heads, args.num_layers,
                            lm_head=heads.shared_lm_head, embed=target.embed if token_aware(args) else None,
                            sequential=args.sequential, prefix=heads.prefix_arch or prefix_arch(args, target))
        with torch.no_grad():
            for old, new in zip(heads.blocks, grown.blocks):
                for j, block in enumerate(old):
                    new[j].load_state_dict(block.state_dict())
            if heads.heads is not None:  # their own LM heads
                for old, new in zip(heads.heads, grown.heads):
                    new.weight.copy_(old.weight)
            if heads.token_input:
                grown.token_proj.weight.copy_(heads.token_proj.weight)
            for old, new in zip(heads.seq_proj or (), grown.seq_proj or ()):
                new.weight.copy_(old.weight)
            if heads.prefixed:
                grown.prefix.load_state_dict(heads.prefix.state_dict())
        return grown


def prefix_arch(args, target):
    """The prefix layer's shape (the target's decoder layer), or None without --prefix-layer."""
    if not getattr(args, "prefix_layer", False):
        return None
    if not target.config:
        raise ConfigError("--prefix-layer takes the target's layer shape from its config.json, which this target lacks")
    return arch_from_config(target.config, num_layers=1)


def token_aware(args) -> bool:
    """Whether the heads read the token their state produced (--token-input, or --sequential)."""
    return bool(args.token_input or getattr(args, "sequential", False))
