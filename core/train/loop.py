"""The generic training loop: distillation data, optimiser, checkpoints, validation, export.

``run(trainer, args)`` makes (or reuses) the self-distillation data, builds the method's
module, trains it with AdamW (linear warm-up, then cosine decay over ``--steps`` or, with
``--time-limit``, over the time budget, whichever ends first; gradient clipping;
optionally bf16 autocast) under a tqdm progress bar, checkpoints to
``<out>/checkpoint.pt`` (``--resume`` continues from there: module, optimiser, sampler
state, history), validates on held-apart prompts' answers (top-1 agreement with the
target per draft position and the expected acceptance length of a greedy chain,
:class:`speculum.train.base.Score`), and writes the public checkpoint format plus
``<out>/training.json`` (the report, with the training curve in ``history``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import attrs
import torch

from speculum.train.base import Score, Trainer, frequent_tokens
from speculum.train.data import VAL_SPLIT, DistillData
from speculum.train.distill import DistillSpec, ensure_distill, ensure_parts, new_file_mode, parts_summary
from speculum.train.generate import release_engines
from speculum.train.mix import ANSWER, KINDS
from speculum.train.online import online_states
from speculum.train.phases import StepPhases

if TYPE_CHECKING:
    from speculum.backends.torch import TargetParts

log = logging.getLogger(__name__)

AMP = {"off": None, "bf16": torch.bfloat16}


def record_layers(trainers: Iterable[Trainer], args, num_target_layers: int) -> tuple[int, ...]:
    """Layers to record once for every installed method, so they all share one data set."""
    from speculum.errors import ConfigError
    layers = set()
    for t in trainers:
        try:
            layers |= set(t.data_layers(args, num_target_layers))
        except ConfigError:  # a method that cannot train on this target adds nothing
            pass
    return tuple(sorted(layers))


def model_name(model: str) -> str:
    """A readable target name: a GGUF file's name without quantisation suffix and extension."""
    name = Path(model).name
    return re.sub(r"(\.(q\d\w*|f16|f32|bf16))?\.gguf$", "", name, flags=re.IGNORECASE)


def placement(size: int, device) -> str | torch.device:
    """Where distillation data of ``size`` bytes lives: on a GPU when it takes at most a
    third of its free memory (batches are then gathered there), else on the host."""
    if torch.device(device).type != "cuda":
        return "cpu"
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    if size > free // 3:
        log.info("distillation data (%.1f GiB) stays on the host", size / 2**30)
        return "cpu"
    return device


def load_data(path: Path, layers, shards, device) -> DistillData:
    """The cached data, loaded straight to where it will live (:func:`placement`)."""
    return DistillData.load(path, layers=layers, shards=shards,
                            device=placement(DistillData.nbytes(path, layers, shards), device))


def lr_factor(step: int, warmup: int, total: int, elapsed: float = 0.0, time_limit: float = 0.0) -> float:
    """Learning-rate multiplier: linear warm-up over ``warmup`` steps, then cosine from 1 to
    0.1 over the rest of ``total`` steps, or of ``time_limit`` seconds when that ends first."""
    if step < warmup:
        return (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    if time_limit:
        frac = max(frac, elapsed / time_limit)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


def length_buckets(data: DistillData, ids: list[int], batch_size: int, rng: random.Random,
                   pool: int = 16) -> list[list[int]]:
    """One epoch of batches in random order, each of sequences of similar length.

    Sequences are shuffled, cut into pools of ``pool`` batches, sorted by length inside a
    pool and split into batches: little padding, still random. Returned as a stack (pop).
    """
    order = list(ids)
    rng.shuffle(order)
    lens = (data.offsets[1:] - data.offsets[:-1]).tolist()
    batches = []
    for i in range(0, len(order), batch_size * pool):
        chunk = sorted(order[i: i + batch_size * pool], key=lambda j: lens[j])
        batches += [chunk[k: k + batch_size] for k in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def evaluate(trainer: Trainer, module, data: DistillData, ids: list[int], target: TargetParts, args,
             device, answer_tokens: int = 0) -> Score:
    """Top-1 agreement with the target per draft position and greedy-chain acceptance on
    the answers of sequences ``ids`` (answer tokens only, whatever ``--loss-on`` trains
    on; fp32, the whole vocabulary; the first ``answer_tokens`` of each answer if > 0)."""
    import copy
    K = trainer.positions(args)
    total = Score.zeros(K)
    eval_args = copy.copy(args)
    eval_args.loss_on = "answer"
    lens = (data.offsets[1:] - data.offsets[:-1]).tolist()
    ids = sorted(ids, key=lambda j: lens[j])  # batches of similar lengths: little padding
    module.eval()
    with torch.no_grad():
        bs = getattr(args, "eval_batch_size", 0) or args.batch_size
        for i in range(0, len(ids), bs):
            batch = data.batch(ids[i: i + bs], args.max_len, device, args.prompt_context, answer_tokens)
            total = total + score_of(trainer.loss(module, batch, target, eval_args))
    module.train()
    return total


def start_from(module, loaded, where: str) -> None:
    """Copy the weights (and buffers, e.g. EAGLE-3's draft vocabulary) of ``loaded`` into
    ``module``, cast to its dtypes; ConfigError when the shapes differ."""
    from speculum.errors import ConfigError
    want, have = module.state_dict(), loaded.state_dict()
    missing = sorted(set(want) - set(have))
    wrong = sorted(k for k in set(want) & set(have) if want[k].shape != have[k].shape)
    if missing or wrong:
        why = ([f"missing {', '.join(missing[:4])}"] if missing else []) + \
              ([f"other shapes: {', '.join(f'{k} {tuple(have[k].shape)} vs {tuple(want[k].shape)}' for k in wrong[:3])}"]
               if wrong else [])
        raise ConfigError(f"--init-from {where}: the checkpoint does not fit the module these options build "
                          f"({'; '.join(why)}); give the options it was trained with (layers, draft vocabulary, "
                          "heads)")
    with torch.no_grad():
        for k, v in want.items():
            v.copy_(have[k].to(v.device, v.dtype))
    log.info("starting from %s", where)


def lineage(init_from: str | Path | None) -> list[dict]:
    """What the head ``--init-from`` names was trained with, then what it grew from, newest
    first (from its config.json's ``speculum.training``): a continued head records its whole
    recipe. Empty without one, or for a checkpoint made elsewhere."""
    if not init_from:
        return []
    try:
        t = json.loads((Path(init_from) / "config.json").read_text()).get("speculum", {}).get("training") or {}
    except (OSError, ValueError, AttributeError):
        return []
    if not t:
        return []
    if (t.get("kept") or {}).get("step") == 0 and t.get("grown_from"):
        # --keep-best exported its start: the same weights as its own parent's, nothing to add
        return list(t["grown_from"])
    keep = ("command", "device", "steps", "train_seconds", "expected_acceptance_length", "eval_first_turns")
    split = {"val_split": t["data"]["val_split"]} if "val_split" in (t.get("data") or {}) else {}
    return [{**{k: t[k] for k in keep if k in t}, **split}, *t.get("grown_from", [])]


class BestWeights:
    """``--keep-best``: a host copy of the module's weights at its best validated step (by
    expected acceptance length on the validation split; a tie goes to the later, more
    trained step). ``start_competes=False`` leaves step 0 out: a head continued from one
    trained on another validation split has trained on this split's validation prompts, so
    its start scores high on them however well training goes (:func:`warn_if_other_split`)."""

    def __init__(self, on: bool, start_competes: bool = True):
        self.on, self.start_competes, self.step, self.score, self.state = on, start_competes, None, None, None

    def offer(self, step: int, score: float | None, module) -> None:
        if not self.on or score is None or (self.score is not None and score < self.score):
            return
        if step == 0 and not self.start_competes:
            return
        self.step, self.score = step, score
        self.state = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}

    def would_restore(self, last_step: int) -> bool:
        """Whether :meth:`restore` will load weights other than the last step's."""
        return self.on and self.state is not None and self.step != last_step

    def restore(self, module, last_step: int) -> dict | None:
        """Load the best weights into ``module`` if they are not the last step's; returns
        ``{"step", "val_acceptance_length"}`` of what was loaded, else None."""
        if not self.would_restore(last_step):
            return None
        module.load_state_dict(self.state)
        return {"step": self.step, "val_acceptance_length": self.score}


LAST_STEP = "last-step"


def command_of(args) -> str:
    """The command line that started this training run, as its report records it."""
    return "speculum " + " ".join(args.argv) if getattr(args, "argv", None) else " ".join(sys.argv)


def save_last_step(trainer, module, out: Path, target, args, steps: int, seconds: float, history: list) -> Path:
    """``--keep-best`` exporting an earlier step: the last step's weights into ``out/last-step``
    in the same public format, its config recording the run and the last validation (bench
    it beside the kept export; ``--init-from`` continues it)."""
    last = next((h for h in reversed(history) if h["step"] == steps), {})
    training = {"command": command_of(args), "steps": steps, "train_seconds": round(seconds, 1),
                "last_step": "the last step of the run exported one folder up, which --keep-best exported "
                             "from an earlier step",
                **{k: last[k] for k in ("val_accuracy", "val_acceptance_length", "eval_accuracy",
                                        "eval_acceptance_length") if k in last},
                "data": {"val_split": VAL_SPLIT}}
    meta = {"method": trainer.name, "target": target.fingerprint(), "training": training}
    if grown := lineage(getattr(args, "init_from", None)):
        training["grown_from"] = grown
    dst = Path(out) / LAST_STEP
    trainer.export(module, dst, target, args, meta)
    normalize_modes(dst)
    log.info("--keep-best: the last step's weights (step %d) are in %s", steps, dst)
    return dst


def score_of(result) -> Score:
    """The Score of a trainer's loss() result: (loss, Score) or (loss, correct, count)."""
    return Score.coerce(result[1] if len(result) == 2 else result[1:])


def distill_spec(args, model_path: Path, layers: tuple[int, ...]) -> DistillSpec:
    """The self-distillation data the arguments ask for (MT-bench and ``--eval-prompts``
    excluded from training)."""
    temps = tuple(float(t) for t in str(args.extra_temperature).split(",") if t.strip())
    from speculum.datasets import MT_BENCH, data_path
    exclude = [str(data_path(MT_BENCH))]  # shipped with the package: always checked
    if getattr(args, "eval_prompts", None):
        exclude.append(str(args.eval_prompts))
    return DistillSpec(model=str(model_path), prompts=str(args.prompts), num_prompts=args.num_prompts,
                       max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens,
                       temperature=args.temperature, seed=args.data_seed, layers=layers,
                       extra_answers=args.extra_answers, extra_temperature=temps[0] if len(temps) == 1 else temps,
                       long_form=args.long_form, template_long_form=args.template_long_form,
                       second_turns=args.second_turns, max_turns=args.max_turns,
                       data=tuple(str(d) for d in args.data or ()), exclude=tuple(sorted(set(exclude))))


def _gen_kwargs(args) -> dict:
    return dict(max_num_seqs=args.gen_batch, device=args.gen_device or args.device, dtype=args.gen_dtype,
                shard_size=args.gen_shard_size, max_model_len=args.gen_max_model_len)


def normalize_modes(folder: Path) -> None:
    """Give every file in ``folder`` the mode a new file gets (0644 under umask 022):
    safetensors writes its files 0600, everything else is written 0644."""
    mode = new_file_mode()
    for f in Path(folder).rglob("*"):
        if f.is_file():
            f.chmod(mode)


def warn_if_other_split(init_from: Path, keep_best: bool) -> bool:
    """Warn (and say so) when the head continued from, or a run it grew from (its lineage),
    was trained on another validation split: those runs trained on some of this run's
    validation prompts, so validation flatters its starting weights, and ``--keep-best`` leaves
    step 0 out of its choice (the thirty-eighth session: it kept step 0 while the replay on
    MT-bench's answers rose; the last step of the same training, exported in another run,
    benched MAL 1.95 against 1.86). Heads grown from one trained before 2026-12-06 stay so."""
    runs = lineage(init_from)  # each run its weights come from, newest first (none without a report)
    if all(r.get("val_split") == VAL_SPLIT for r in runs):
        return False
    log.warning("%s (or a run it grew from) was trained on another validation split than this run's (%s): it has "
                "trained on some of this run's validation prompts, so validation flatters its starting weights%s",
                init_from, VAL_SPLIT, "; --keep-best chooses among the steps after it" if keep_best else "")
    return True


def run(trainer: Trainer, args, all_trainers: Iterable[Trainer] = ()) -> dict:
    from speculum.backends.torch import TargetParts, read_state_dict, resolve_device
    from speculum.model_source import DEFAULT_MODEL, resolve_model_path

    from speculum.threads import apply_threads
    apply_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    device = resolve_device(args.device)
    if torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 master weights, TF32 matmuls
        torch.backends.cudnn.allow_tf32 = True
    model_path = resolve_model_path(args.model)
    target = TargetParts.from_checkpoint(model_path, torch.float32, device)
    target.name = DEFAULT_MODEL if args.model in (None, DEFAULT_MODEL) else model_name(args.model)
    L = target.num_layers
    out = Path(args.out or f"trained/{trainer.name}-{target.name}")

    # 1. self-distillation data (cached; shared by every method). --states online: the answers
    # only (a cache keyed for recorded layers serves it too), the states made batch by batch
    t0 = time.perf_counter()
    online = getattr(args, "states", "disk") == "online"
    layers = () if online else record_layers(list(all_trainers) or [trainer], args, L)
    spec = distill_spec(args, model_path, layers)
    found = ensure_parts(spec, args.cache_dir, time_limit=args.gen_time_limit, generate=not args.cached_data_only,
                         # (the CLI allows --answers-only with --prepare-only only)
                         states=not (online or getattr(args, "answers_only", False)), **_gen_kwargs(args))
    # every part's shards by full path (the --data rows' cache, then the prompts')
    data_dir, shards = found[-1][0], [str(d / n) for d, names in found for n in names]
    where = ", ".join(str(d) for d, _ in found)
    if not shards:
        from speculum.errors import ConfigError
        raise ConfigError(f"no finished self-distillation shards in {where}; run without --cached-data-only "
                          "(or with a longer --gen-time-limit) first")
    mix = parts_summary(found, spec)
    eval_dir = eval_shards = None
    if getattr(args, "eval_prompts", None):  # another prompt set, answered the same way, never trained on
        espec = attrs.evolve(spec, prompts=str(args.eval_prompts), num_prompts=args.eval_num_prompts,
                             max_prompt_tokens=max(args.max_prompt_tokens, 1024), extra_answers=0, long_form=0,
                             template_long_form=0, second_turns=0.0, data=(), exclude=(), max_turns=args.max_turns)
        eval_dir, eval_shards = ensure_distill(espec, args.cache_dir, generate=not args.cached_data_only,
                                               **_gen_kwargs(args))
        if not eval_shards:
            eval_dir = None
    release_engines()
    gen_s = time.perf_counter() - t0
    print(f"data: {where} ({len(shards)} shards): {json.dumps(mix)}")
    if getattr(args, "prepare_only", False):
        return {"data_dir": str(data_dir), "data_dirs": [str(d) for d, _ in found], "data": mix}
    out.mkdir(parents=True, exist_ok=True)
    want = trainer.data_layers(args, L)
    data = load_data(data_dir, () if online else want, shards, device)
    source = online_states(spec, want, device, args.gen_device, args.gen_dtype, max(args.batch_size, getattr(
        args, "eval_batch_size", 0) or 0), args.gen_max_model_len) if online else None
    data = attrs.evolve(data, states=source)
    train_ids, val_ids = data.split(args.val_fraction, args.data_seed)
    # a fixed sample of the validation answers, drawn across the whole mix
    val_ids = sorted(random.Random(args.data_seed).sample(val_ids, min(len(val_ids), args.val_max_seqs)))
    eval_data = attrs.evolve(load_data(eval_dir, () if online else want, eval_shards, device), states=source) \
        if eval_dir is not None else None
    log.info("data %s: %d sequences (%d train, %d validation), %d tokens", where, len(data), len(train_ids),
             len(val_ids), data.num_tokens(range(len(data))))

    # 2. the module
    module = trainer.build(args, target, read_state_dict(model_path), data, train_ids).to(device)
    flattered = False  # the start was trained on this run's validation prompts (another split)
    if getattr(args, "init_from", None):
        start_from(module, trainer.load(Path(args.init_from), target, args), args.init_from)
        flattered = warn_if_other_split(Path(args.init_from), getattr(args, "keep_best", False))
    if getattr(args, "loss_vocab", 0):  # not a parameter: rebuilt identically on --resume
        module.loss_vocab = frequent_tokens(data, train_ids, args.loss_vocab, target.vocab_size).to(device)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    rng = random.Random(args.seed)
    ckpt = out / "checkpoint.pt"
    start, history, train_s, queue, resumed_best = 0, [], 0.0, [], None
    if args.resume and ckpt.exists():
        state = torch.load(ckpt, map_location=device, weights_only=False)
        module.load_state_dict(state["module"])
        opt.load_state_dict(state["optimizer"])
        rng.setstate(state["rng"])
        start, history, train_s = state["step"], state["history"], state.get("train_seconds", 0.0)
        queue = state.get("queue", [])
        resumed_best = state.get("best")
        log.info("resumed from %s at step %d", ckpt, start)

    # 3. train
    from tqdm.auto import tqdm
    amp = AMP[getattr(args, "amp", "off")]
    autocast = (lambda: torch.autocast(torch.device(device).type, dtype=amp)) if amp else contextlib.nullcontext
    bar = tqdm(total=None if args.time_limit else args.steps, initial=start, desc=f"train {trainer.name}",
               unit="step")
    ema_loss, ema_acc = None, None
    step = start
    t1 = time.perf_counter()
    base_s = train_s  # training seconds before this run (resume)
    eval_s = 0.0      # seconds spent validating in this run (not training time)
    next_eval_at = (math.floor(base_s / args.eval_seconds) + 1) * args.eval_seconds if args.eval_seconds else None

    def trained_seconds() -> float:
        return base_s + time.perf_counter() - t1 - eval_s

    def validate(at_step: int) -> None:
        nonlocal eval_s
        te = time.perf_counter()
        entry = {"step": at_step, "seconds": round(trained_seconds(), 1),
                 "train_loss": round(ema_loss, 4) if ema_loss is not None else None}
        if val_ids:
            v = evaluate(trainer, module, data, val_ids, target, args, device)
            entry.update(val_accuracy=v.accuracy(), val_acceptance_length=v.acceptance_length())
            bar.write(f"step {at_step} ({entry['seconds']:.0f} s): validation top-1 per position {v.accuracy()}, "
                      f"expected acceptance length {v.acceptance_length()}")
            best.offer(at_step, v.acceptance_length(), module)
        if eval_data is not None:
            e = evaluate(trainer, module, eval_data, list(range(len(eval_data))), target, args, device)
            entry.update(eval_accuracy=e.accuracy(), eval_acceptance_length=e.acceptance_length())
            bar.write(f"step {at_step}: --eval-prompts top-1 per position {e.accuracy()}, expected acceptance "
                      f"length {e.acceptance_length()}")
        history.append(entry)
        eval_s += time.perf_counter() - te

    best = BestWeights(getattr(args, "keep_best", False), start_competes=not flattered)
    if best.on and resumed_best is not None and resumed_best[2] is not None:
        best.step, best.score, best.state = resumed_best
    if best.on and start == 0:  # where training starts (a --init-from checkpoint) competes too
        validate(0)
    phases = StepPhases(getattr(args, "profile_steps", 0), device)
    for step in range(start, args.steps):
        if not queue:
            queue = length_buckets(data, train_ids, args.batch_size, rng)
        with phases.phase("batch"):
            batch = data.batch(queue.pop(), args.max_len, device, args.prompt_context)
        # over the wall-clock budget (validation included): the decay ends when time does
        factor = lr_factor(step, args.warmup, args.steps, base_s + time.perf_counter() - t1, args.time_limit)
        for g in opt.param_groups:
            g["lr"] = args.lr * factor
        with phases.phase("forward"), autocast():
            res = trainer.loss(module, batch, target, args)
        loss, score = res[0], score_of(res)
        opt.zero_grad(set_to_none=True)
        with phases.phase("backward"):
            loss.backward()
        with phases.phase("optimizer"):
            torch.nn.utils.clip_grad_norm_(params, args.clip)
            opt.step()
        acc = float(score.correct[0] / score.count[0]) if score.count[0] else 0.0
        lv = loss.item()
        ema_loss = lv if ema_loss is None else 0.95 * ema_loss + 0.05 * lv
        ema_acc = acc if ema_acc is None else 0.95 * ema_acc + 0.05 * acc
        bar.set_postfix(loss=f"{ema_loss:.3f}", acc1=f"{ema_acc:.3f}", lr=f"{args.lr * factor:.1e}")
        bar.update(1)
        out_of_time = bool(args.time_limit) and time.perf_counter() - t1 + base_s > args.time_limit
        if out_of_time:
            bar.write(f"--time-limit {args.time_limit:g}s reached at step {step + 1} of {args.steps}: "
                      "validating and exporting")
        last = step + 1 == args.steps or out_of_time
        due = bool(args.eval_every) and (step + 1) % args.eval_every == 0
        if next_eval_at is not None and trained_seconds() >= next_eval_at:
            due = True
            next_eval_at = (math.floor(trained_seconds() / args.eval_seconds) + 1) * args.eval_seconds
        if (due or (last and (args.eval_every or args.eval_seconds or best.on))) and not (last and history and
                                                                              history[-1]["step"] == step + 1):
            validate(step + 1)
        if (step + 1) % args.save_every == 0 or last:
            torch.save({"module": module.state_dict(), "optimizer": opt.state_dict(), "rng": rng.getstate(),
                        "step": step + 1, "history": history, "train_seconds": trained_seconds(), "queue": queue,
                        "best": (best.step, best.score, best.state)},
                       ckpt)
        phases.end_step()
        if out_of_time:
            break
    bar.close()
    phases.finish()
    steps_done = step + 1 if args.steps > start else start
    train_s = trained_seconds()

    # 4. validate and export (--keep-best: the best validated weights, if not the last; the last
    # step's weights then go beside them, in last-step/, so that a run whose validation misleads
    # loses nothing: the thirty-eighth session lost an MTP module whose MT-bench replay had risen)
    if best.would_restore(steps_done):
        save_last_step(trainer, module, out, target, args, steps_done, trained_seconds(), history)
    kept = best.restore(module, steps_done)
    if kept is not None:
        log.info("--keep-best: exporting the weights of step %d (expected acceptance length %s on validation)",
                 kept["step"], kept["val_acceptance_length"])
    val = evaluate(trainer, module, data, val_ids, target, args, device) if val_ids else Score.zeros(
        trainer.positions(args))
    by_kind = {}
    kinds = data.kind[val_ids].tolist() if data.kind is not None else []
    for k in sorted(set(kinds)):
        ids = [i for i, kk in zip(val_ids, kinds) if kk == k]
        s = evaluate(trainer, module, data, ids, target, args, device)
        by_kind[KINDS[k]] = {"sequences": len(ids), "accuracy_per_position": s.accuracy(),
                             "expected_acceptance_length": s.acceptance_length()}
    ev = evaluate(trainer, module, eval_data, list(range(len(eval_data))), target, args, device) \
        if eval_data is not None else None
    # what `bench offline` measures on the same prompts: first-turn greedy answers, their
    # first --eval-answer-tokens tokens (the openings are the hardest text; the answers'
    # later tokens and second turns, which the figure above includes, are easier)
    first = [] if ev is None or eval_data.kind is None else \
        [i for i, k in enumerate(eval_data.kind.tolist()) if k == ANSWER]
    ev_bench = evaluate(trainer, module, eval_data, first, target, args, device,
                        answer_tokens=args.eval_answer_tokens) if first else None
    vocab = getattr(module, "loss_vocab", None)
    if vocab is None and hasattr(module, "draft_to_target"):
        vocab = module.draft_to_target
    coverage = None
    if vocab is not None and val_ids:  # share of the validation answers' tokens the loss vocabulary has
        toks = data.answer_tokens(val_ids)
        coverage = round(float(torch.isin(toks, vocab.to(toks.device)).float().mean()), 4) if toks.numel() else None
    report = {
        "method": trainer.name, "target": target.fingerprint(),
        "command": command_of(args),
        "device": torch.cuda.get_device_name(torch.device(device)) if torch.device(device).type == "cuda" else "cpu",
        "data": {**{k: v for k, v in attrs.asdict(spec).items() if k != "model"}, "model": target.name,
                 "sequences": len(data), "train_sequences": len(train_ids), "validation_sequences": len(val_ids),
                 "val_split": VAL_SPLIT,
                 "tokens": data.num_tokens(range(len(data))), "seconds": round(gen_s, 1), **mix},
        "steps": steps_done, "batch_size": args.batch_size, "lr": args.lr, "amp": getattr(args, "amp", "off"),
        "train_seconds": round(train_s, 1), "loss_vocab_coverage": coverage,
        "val_accuracy_per_position": val.accuracy(), "val_acceptance_per_position": val.acceptance(),
        "expected_acceptance_length": val.acceptance_length(), "val_by_kind": by_kind,
        "positions": trainer.positions(args), "history": history,
    }
    if phases.result is not None:
        report["step_phases_ms"] = phases.result
    if best.on:
        report["kept"] = {**(kept or {"step": steps_done, "val_acceptance_length": best.score}),
                          "start_competed": best.start_competes}
    if ev is not None:
        report.update({"eval_prompts": str(args.eval_prompts), "eval_sequences": len(eval_data),
                       "eval_accuracy_per_position": ev.accuracy(), "eval_acceptance_per_position": ev.acceptance(),
                       "eval_expected_acceptance_length": ev.acceptance_length()})
    if ev_bench is not None:
        report["eval_first_turns"] = {"sequences": len(first), "answer_tokens": args.eval_answer_tokens,
                                      "accuracy_per_position": ev_bench.accuracy(),
                                      "expected_acceptance_length": ev_bench.acceptance_length()}
    keep = ("command", "device", "steps", "kept", "train_seconds", "loss_vocab_coverage", "val_accuracy_per_position",
            "val_acceptance_per_position", "expected_acceptance_length", "eval_prompts", "eval_accuracy_per_position",
            "eval_acceptance_per_position", "eval_expected_acceptance_length", "eval_first_turns")
    meta = {"method": trainer.name, "target": target.fingerprint(),
            "training": {**{k: report[k] for k in keep if k in report},
                         "data": {k: report["data"][k] for k in ("prompts", "num_prompts", "data", "max_tokens",
                                                                 "temperature", "extra_answers", "extra_temperature",
                                                                 "long_form", "template_long_form", "second_turns",
                                                                 "max_turns",
                                                                 "sequences", "tokens", "sequences_per_kind",
                                                                 "answer_tokens_per_kind", "dropped_overlaps", "val_split")
                                  if k in report["data"]}}}
    if grown := lineage(getattr(args, "init_from", None)):
        meta["training"]["grown_from"] = grown
    trainer.export(module, out, target, args, meta)
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    normalize_modes(out)
    print(f"{trainer.name}: validation top-1 agreement per position {val.accuracy()}, expected acceptance length "
          f"{val.acceptance_length()}; wrote {out}")
    if ev is not None:
        print(f"{trainer.name}: on {args.eval_prompts}: top-1 agreement per position {ev.accuracy()} (expected "
              f"acceptance length {ev.acceptance_length()})")
    if ev_bench is not None:
        print(f"{trainer.name}: on {args.eval_prompts}, first turns' first {args.eval_answer_tokens} answer tokens "
              f"(what `bench offline` measures): top-1 agreement per position {ev_bench.accuracy()} (expected "
              f"acceptance length {ev_bench.acceptance_length()})")
    return report
