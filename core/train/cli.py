"""``speculum train METHOD [options]``: train a draft head or model on the target's own answers.

Trainers come from the ``speculum_register_trainers`` hook (the EAGLE, Medusa and MTP
plugins register theirs; the built-in ``draft`` is a default plugin). A trainer's code is
imported only when its method is trained, so the rest of the CLI stays fast.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from speculum.errors import ConfigError

AMP = ("bf16", "off")


def trainers() -> dict[str, object]:
    """Every registered trainer (plugins' ``speculum_register_trainers``), by method name.

    Trainers come through the plugin manager like every other plugin part, so
    ``SPECULUM_DISABLE_PLUGINS`` and its loading errors apply to them too."""
    from speculum.plugins import build_registry
    return dict(sorted(build_registry().trainers.items()))


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a draft head (eagle, eagle3, medusa, mtp) or a draft model by "
                                     "self-distillation", add_help=False)
    p.add_argument("-h", "--help", action="store_true", dest="train_help",
                   help="list the methods; with METHOD, its options")
    p.add_argument("method", nargs="?", help="method to train; `speculum train METHOD --help` lists its options")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_train)


def common_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target and data")
    g.add_argument("--model", default=None, help="target model (default: SmolLM2-135M-Instruct)")
    g.add_argument("--prompts", default=None, help="JSONL of training prompts (field 'prompt'); "
                   "default: the 4,728 training prompts shipped with speculum. Never MT-bench.")
    g.add_argument("--num-prompts", type=int, default=1024, help="training prompts answered by the target")
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
    g.add_argument("--template-long-form", type=int, default=0, metavar="N",
                   help="long-form answers per task-template prompt (t0/*): a request to explain the answer is "
                        "appended (the first greedy, then sampled); default 0")
    g.add_argument("--second-turns", type=float, default=0.0, metavar="FRACTION",
                   help="fraction of single-turn prompts that get a second turn: the target writes a follow-up "
                        "question about its own answer, then answers it (all through the chat template)")
    g.add_argument("--max-turns", type=int, default=2,
                   help="user turns answered per conversation (--data conversations, MT-bench's two turns)")
    g.add_argument("--data", action="append", default=[], metavar="JSONL",
                   help="your own prompts or conversations, added to --prompts: rows with 'prompt', ShareGPT "
                        "'conversations' [{'from': 'human'|'gpt', 'value'}] or OpenAI 'messages' [{'role', "
                        "'content'}]; the target answers every user turn (repeatable)")
    g.add_argument("--data-seed", type=int, default=0, help="seed of prompt selection and sampled answers")
    g.add_argument("--gen-batch", type=int, default=32, help="max_num_seqs while generating")
    g.add_argument("--gen-shard-size", type=int, default=64,
                   help="prompts per cached shard (fixed by the first run that creates a cache)")
    g.add_argument("--gen-device", default=None, help="device for generation (default: --device)")
    g.add_argument("--gen-dtype", default="auto", help="dtype for generation (auto: bf16 on CUDA, fp32 on CPU)")
    g.add_argument("--gen-max-model-len", type=int, default=2048, help="context of the generating engine")
    g.add_argument("--gen-time-limit", type=float, default=0, metavar="SECONDS",
                   help="stop generating after this long and train on the shards finished (0: no limit); each --data "
                        "file and the training prompts get a share of it by the rows they have still to answer")
    g.add_argument("--cached-data-only", action="store_true",
                   help="train on the shards of the cache made before (e.g. by a --prepare-only run with "
                        "--gen-time-limit); generate nothing")
    g.add_argument("--prepare-only", action="store_true",
                   help="make (or check) the self-distillation data, print its mix and exit")
    g.add_argument("--answers-only", action="store_true",
                   help="with --prepare-only: make the answers but not the hidden states of answers carried in "
                        "without them (`distill import`): a call whose answers another call trains on skips that "
                        "prefill (92 s for 4.7 M tokens on the H200)")
    g.add_argument("--record-for", default=None, metavar="METHOD[,METHOD...]",
                   help="record the target's hidden states only for these methods (the one trained always among "
                        "them; default: every installed method's, so that all train on one data set): EAGLE-3 "
                        "alone needs four states a token, a 64 GB disk held 12 M tokens of them no more. Answers "
                        "made for more layers are reused, their states added by prefill")
    g.add_argument("--states", choices=("disk", "online"), default="disk",
                   help="disk: the target's hidden states of every answer token are recorded once and read by every "
                        "run (fast steps; EAGLE-3's take 4.6 KB a token for the default model); online: the data holds "
                        "the answers only and the target prefills each batch while training (no disk, no prefill "
                        "before the first step; a target forward a step). The states are the same either way")
    g.add_argument("--cache-dir", default=None, help="default: $SPECULUM_CACHE/distill")
    g.add_argument("--val-fraction", type=float, default=0.05, help="sequences held out for validation")
    g.add_argument("--val-max-seqs", type=int, default=64, help="at most this many validation sequences")
    g.add_argument("--eval-prompts", default=None, metavar="JSONL",
                   help="also report accuracy and acceptance length on the target's answers to these prompts "
                        "(e.g. mt_bench: the shipped MT-bench questions, or other_tasks: the shipped prompts "
                        "of five other task types; training prompts matching them are dropped). "
                        "MT-bench is always kept out of training")
    g.add_argument("--eval-num-prompts", type=int, default=80, help="prompts of --eval-prompts used")
    g.add_argument("--eval-answer-tokens", type=int, default=256,
                   help="the final report also scores the first this many tokens of the first-turn answers to "
                        "--eval-prompts: what `bench offline --max-tokens N` measures on them (default 256)")
    g.add_argument("--loss-on", choices=("answer", "all"), default="answer",
                   help="train on answer tokens only, or on every position")
    g.add_argument("--prompt-context", type=int, default=0,
                   help="prompt tokens kept before each answer in training (0: the whole prompt)")
    g.add_argument("--loss-vocab", type=int, default=8192,
                   help="full-vocabulary heads are trained on a softmax over the N most frequent answer "
                        "tokens (much cheaper on CPU; 0: the whole vocabulary); validation always uses all")
    t = p.add_argument_group("training")
    t.add_argument("--out", default=None, help="output directory (default: trained/<method>-<model>)")
    t.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    t.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    t.add_argument("--max-len", type=int, default=384, help="tokens per sequence (longer ones are cut at the front)")
    t.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW, warm-up then cosine decay)")
    t.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    t.add_argument("--warmup", type=int, default=50, help="learning-rate warm-up steps")
    t.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping")
    t.add_argument("--eval-every", type=int, default=250, help="validate every N steps (0: only at the end)")
    t.add_argument("--eval-batch-size", type=int, default=8,
                   help="sequences per validation batch (validation scores the whole vocabulary: keep it small)")
    t.add_argument("--eval-seconds", type=float, default=0,
                   help="also validate every this many seconds of training (the training curve)")
    t.add_argument("--keep-best", action=argparse.BooleanOptionalAction, default=False,
                   help="export the weights of the validation (never --eval-prompts) with the best expected "
                        "acceptance length, counting the start (step 0: a --init-from checkpoint is never "
                        "exported worse than it came), instead of the last step's, which then go into "
                        "OUT/last-step; --no-keep-best after it turns it off again (a phase that lowers the "
                        "token acceptance on purpose)")
    t.add_argument("--save-every", type=int, default=250, help="write a resumable checkpoint every N steps")
    t.add_argument("--profile-steps", type=int, default=0, metavar="N",
                   help="time the phases of N steps (after two): the batch (with --states online the target's "
                        "prefill), forward and loss, backward, optimizer; median ms each in the log and in "
                        "training.json (step_phases_ms). Each phase then ends with a device sync (default 0: off)")
    t.add_argument("--time-limit", type=float, default=0,
                   help="stop after this many seconds from the first step (wall clock, validation included; then "
                        "validate and export as at the end)")
    t.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint.pt")
    t.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from this checkpoint of the method (e.g. the shipped head) instead of a fresh "
                        "initialisation: its weights (and EAGLE-3's draft vocabulary), with a new optimiser and "
                        "schedule; --resume, when it finds a checkpoint, wins (default: none)")
    t.add_argument("--amp", choices=sorted(AMP), default="off",
                   help="bf16: forward and loss under bf16 autocast (fp32 master weights; validation in fp32)")
    t.add_argument("--seed", type=int, default=0, help="seed of initialisation and batch order")
    t.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda")
    t.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: the CPUs this process may use, less those busy with other "
                        "processes)")


def cmd_train(args) -> int:
    from speculum.train.loop import run
    found = trainers()
    if args.train_help and args.method:
        args.rest = ["--help"]
    if not args.method or args.method in ("-h", "--help") or args.method not in found:
        names = ", ".join(found)
        if args.method and args.method not in ("-h", "--help"):
            raise ConfigError(f"no trainer for method {args.method!r}; installed: {names}")
        print(f"usage: speculum train METHOD [options]   (METHOD: {names})\n\n"
              "Train a draft head or a draft model on the target's own answers (self-distillation).\n"
              "`speculum train METHOD --help` lists the options of one method.\n\nmethods:")
        for n, t in found.items():
            print(f"  {n:<8} {t.description}")
        return 0
    trainer = found[args.method].create()
    from speculum.cli import HelpFormatter
    p = argparse.ArgumentParser(prog=f"speculum train {args.method}", description=trainer.description,
                                formatter_class=HelpFormatter)
    common_arguments(p)
    trainer.add_arguments(p)
    targs = p.parse_args(args.rest)
    if not targs.prompts:
        from speculum.datasets import train_prompts_path
        targs.prompts = str(train_prompts_path())
    from speculum.datasets import eval_set_path, is_eval_set
    if targs.eval_prompts:
        targs.eval_prompts = eval_set_path(targs.eval_prompts)
    for f in [targs.prompts, *targs.data]:
        if is_eval_set(f):
            raise ConfigError(f"{f}: {Path(f).stem} is for evaluation only; leave --prompts unset to train on the "
                              "shipped training prompts (and add --data files of your own)")
    if targs.states == "online" and targs.record_for is not None:
        raise ConfigError("--record-for chooses the hidden states written to disk; --states online writes none: "
                          "leave one of them out")
    if targs.answers_only and not targs.prepare_only:
        raise ConfigError("--answers-only makes data for another run to train on: use it with --prepare-only")
    targs.argv = ["train", args.method, *args.rest]
    # the distillation data (cached, shared) records the layers every installed method needs (--record-for: some)
    record = set(found) if targs.record_for is None else {m.strip() for m in targs.record_for.split(",") if m.strip()}
    if unknown := sorted(record - set(found)):
        raise ConfigError(f"--record-for: no trainer for {', '.join(unknown)}; installed: {', '.join(found)}")
    run(trainer, targs, all_trainers=[trainer] + [t.create() for n, t in found.items()
                                                  if n != args.method and n in record])
    return 0
