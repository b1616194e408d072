"""``speculum train METHOD [options]``: train a draft head or model on the target's own answers.

Methods come from the ``speculum.train`` entry point group (the EAGLE, Medusa and MTP
plugins register theirs) plus the built-in ``draft``. They are loaded only when this
command runs, so the rest of the CLI stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
from pathlib import Path

from speculum.errors import ConfigError

BUILTIN = {"draft": "speculum.train.draft:DraftTrainer"}
AMP = ("bf16", "off")
GROUP = "speculum.train"


def trainers() -> dict[str, object]:
    """Every installed trainer, by method name."""
    found = dict(BUILTIN)
    for ep in md.entry_points(group=GROUP):
        found.setdefault(ep.name, ep.value)
    out = {}
    for name, value in sorted(found.items()):
        mod, _, attr = value.partition(":")
        out[name] = getattr(importlib.import_module(mod), attr)()
    return out


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a draft head (eagle, eagle3, medusa, mtp) or a draft model by "
                                     "self-distillation", add_help=False)
    p.add_argument("method", nargs="?", help="method to train; `speculum train METHOD --help` lists its options")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_train)


def common_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target and data")
    g.add_argument("--model", default=None, help="target model (default: SmolLM2-135M-Instruct)")
    g.add_argument("--prompts", default=None, help="JSONL of training prompts (field 'prompt'); "
                   "default: shared/data/train_prompts.jsonl. Never MT-bench.")
    g.add_argument("--num-prompts", type=int, default=1024)
    g.add_argument("--max-prompt-tokens", type=int, default=192, help="skip longer prompts")
    g.add_argument("--max-tokens", type=int, default=128, help="answer length per prompt")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy answers")
    g.add_argument("--extra-answers", type=int, default=0,
                   help="sampled answers added per instruction-style prompt (sources other than t0/*)")
    g.add_argument("--extra-temperature", default="0.8", metavar="T[,T...]",
                   help="temperature(s) of the sampled answers, taken in turn (e.g. 0.7,1.0)")
    g.add_argument("--long-form", type=int, default=0, metavar="N",
                   help="long-form answers per instruction-style prompt: a request for detail is appended "
                        "(the first greedy, then sampled)")
    g.add_argument("--second-turns", type=float, default=0.0, metavar="FRACTION",
                   help="fraction of single-turn prompts that get a second turn: the target writes a follow-up "
                        "question about its own answer, then answers it (all through the chat template)")
    g.add_argument("--max-turns", type=int, default=2,
                   help="user turns answered per conversation (--data conversations, MT-bench's two turns)")
    g.add_argument("--data", action="append", default=[], metavar="JSONL",
                   help="your own prompts or conversations, added to --prompts: rows with 'prompt', ShareGPT "
                        "'conversations' [{'from': 'human'|'gpt', 'value'}] or OpenAI 'messages' [{'role', "
                        "'content'}]; the target answers every user turn (repeatable)")
    g.add_argument("--data-seed", type=int, default=0)
    g.add_argument("--gen-batch", type=int, default=32, help="max_num_seqs while generating")
    g.add_argument("--gen-shard-size", type=int, default=64,
                   help="prompts per cached shard (fixed by the first run that creates a cache)")
    g.add_argument("--gen-device", default=None, help="device for generation (default: --device)")
    g.add_argument("--gen-dtype", default="auto")
    g.add_argument("--gen-max-model-len", type=int, default=2048, help="context of the generating engine")
    g.add_argument("--gen-time-limit", type=float, default=0, metavar="SECONDS",
                   help="stop generating after this long and train on the shards finished (0: no limit)")
    g.add_argument("--cached-data-only", action="store_true",
                   help="train on the shards of the cache made before (e.g. by a --prepare-only run with "
                        "--gen-time-limit); generate nothing")
    g.add_argument("--prepare-only", action="store_true",
                   help="make (or check) the self-distillation data, print its mix and exit")
    g.add_argument("--cache-dir", default=None, help="default: $SPECULUM_CACHE/distill")
    g.add_argument("--val-fraction", type=float, default=0.05, help="sequences held out for validation")
    g.add_argument("--val-max-seqs", type=int, default=64)
    g.add_argument("--eval-prompts", default=None, metavar="JSONL",
                   help="also report accuracy and acceptance length on the target's answers to these prompts "
                        "(e.g. shared/data/mt_bench.jsonl; training prompts matching them are dropped). "
                        "MT-bench is always kept out of training")
    g.add_argument("--eval-num-prompts", type=int, default=80)
    g.add_argument("--loss-on", choices=("answer", "all"), default="answer",
                   help="train on answer tokens only, or on every position")
    g.add_argument("--prompt-context", type=int, default=0,
                   help="prompt tokens kept before each answer in training (0: the whole prompt)")
    g.add_argument("--loss-vocab", type=int, default=8192,
                   help="full-vocabulary heads are trained on a softmax over the N most frequent answer "
                        "tokens (much cheaper on CPU; 0: the whole vocabulary); validation always uses all")
    t = p.add_argument_group("training")
    t.add_argument("--out", default=None, help="output directory (default: trained/<method>-<model>)")
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    t.add_argument("--max-len", type=int, default=384, help="tokens per sequence (longer ones are cut at the front)")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--warmup", type=int, default=50)
    t.add_argument("--clip", type=float, default=1.0)
    t.add_argument("--eval-every", type=int, default=250, help="validate every N steps (0: only at the end)")
    t.add_argument("--eval-batch-size", type=int, default=8,
                   help="sequences per validation batch (validation scores the whole vocabulary: keep it small)")
    t.add_argument("--eval-seconds", type=float, default=0,
                   help="also validate every this many seconds of training (the training curve)")
    t.add_argument("--save-every", type=int, default=250)
    t.add_argument("--time-limit", type=float, default=0,
                   help="stop after this many seconds of training (then validate and export as at the end)")
    t.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint.pt")
    t.add_argument("--amp", choices=sorted(AMP), default="off",
                   help="bf16: forward and loss under bf16 autocast (fp32 master weights; validation in fp32)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda")
    t.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")


def cmd_train(args) -> int:
    from speculum.train.loop import run
    found = trainers()
    if not args.method or args.method in ("-h", "--help") or args.method not in found:
        names = ", ".join(found)
        if args.method and args.method not in ("-h", "--help"):
            raise ConfigError(f"no trainer for method {args.method!r}; installed: {names}")
        print(f"usage: speculum train METHOD [options]   (METHOD: {names})")
        for n, t in found.items():
            print(f"  {n:<8} {t.description}")
        return 0
    trainer = found[args.method]
    p = argparse.ArgumentParser(prog=f"speculum train {args.method}", description=trainer.description)
    common_arguments(p)
    trainer.add_arguments(p)
    targs = p.parse_args(args.rest)
    if not targs.prompts:
        from speculum.testing import shared_dir
        targs.prompts = str(shared_dir() / "data" / "train_prompts.jsonl")
    for f in [targs.prompts, *targs.data]:
        if "mt_bench" in Path(f).name:
            raise ConfigError(f"{f}: MT-bench is for evaluation only; train on shared/data/train_prompts.jsonl "
                              "(and --data files of your own)")
    targs.argv = ["train", args.method, *args.rest]
    run(trainer, targs, all_trainers=found.values())
    return 0
