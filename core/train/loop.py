"""The generic training loop: distillation data, optimiser, checkpoints, validation, export.

``run(trainer, args)`` makes (or reuses) the self-distillation data, builds the method's
module, trains it with AdamW (linear warm-up, cosine decay, gradient clipping) under a
tqdm progress bar, checkpoints every ``--save-every`` steps to ``<out>/checkpoint.pt``
(``--resume`` continues from there: module, optimiser, schedule, sampler state), reports
validation top-1 agreement with the target per draft position, and writes the public
checkpoint format plus ``<out>/training.json``.
"""

from __future__ import annotations

import json
import os
import logging
import math
import random
import re
import sys
import time
from pathlib import Path
from typing import Iterable

import attrs
import torch

from speculum.proposers.hidden_head import TargetParts
from speculum.train.base import Trainer, frequent_tokens
from speculum.train.data import DistillData
from speculum.train.distill import DistillSpec, ensure_distill

log = logging.getLogger(__name__)


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


def on_device(data: DistillData | None, device) -> DistillData | None:
    """Data moved to a GPU when it takes at most a third of the free memory (batches are
    then gathered there); left on the host otherwise."""
    if data is None or torch.device(device).type != "cuda":
        return data
    size = data.tokens.numel() * 8 + sum(h.numel() * h.element_size() for h in data.hidden.values())
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    if size > free // 3:
        log.info("distillation data (%.1f GiB) stays on the host", size / 2**30)
        return data
    return data.to(device)


def _schedule(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
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
             device) -> list[float]:
    """Validation top-1 agreement with the target per draft position, on answer tokens
    (what drafting is about, whatever ``--loss-on`` trains on)."""
    import copy
    K = trainer.positions(args)
    correct, total = torch.zeros(K), torch.zeros(K)
    eval_args = copy.copy(args)
    eval_args.loss_on = "answer"
    lens = (data.offsets[1:] - data.offsets[:-1]).tolist()
    ids = sorted(ids, key=lambda j: lens[j])  # batches of similar lengths: little padding
    module.eval()
    with torch.no_grad():
        for i in range(0, len(ids), args.batch_size):
            batch = data.batch(ids[i: i + args.batch_size], args.max_len, device, args.prompt_context)
            _, c, n = trainer.loss(module, batch, target, eval_args)
            correct += c
            total += n
    module.train()
    return [round(float(c / n), 4) if n else 0.0 for c, n in zip(correct, total)]


def expected_length(acc: list[float]) -> float:
    """1 + sum_j prod_{i<=j} acc_i: the mean acceptance length if positions were independent."""
    out, run = 1.0, 1.0
    for a in acc:
        run *= a
        out += run
    return round(out, 3)


def normalize_modes(folder: Path) -> None:
    """Give every file in ``folder`` the mode a new file gets (0644 under umask 022):
    safetensors writes its files 0600, everything else is written 0644."""
    umask = os.umask(0)
    os.umask(umask)
    for f in Path(folder).rglob("*"):
        if f.is_file():
            f.chmod(0o666 & ~umask)


def run(trainer: Trainer, args, all_trainers: Iterable[Trainer] = ()) -> dict:
    from speculum.backends.torch import read_state_dict, resolve_device
    from speculum.model_source import DEFAULT_MODEL, resolve_model_path

    from speculum.threads import apply_threads
    apply_threads(args.threads)
    torch.manual_seed(args.seed)
    device = resolve_device(args.device)
    if torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 master weights, TF32 matmuls
        torch.backends.cudnn.allow_tf32 = True
    model_path = resolve_model_path(args.model)
    target = TargetParts.from_checkpoint(model_path, torch.float32, device)
    target.name = DEFAULT_MODEL if args.model in (None, DEFAULT_MODEL) else model_name(args.model)
    L = target.num_layers
    out = Path(args.out or f"trained/{trainer.name}-{target.name}")
    out.mkdir(parents=True, exist_ok=True)

    # 1. self-distillation data (cached; shared by every method)
    t0 = time.perf_counter()
    layers = record_layers(list(all_trainers) or [trainer], args, L)
    spec = DistillSpec(model=str(model_path), prompts=str(args.prompts), num_prompts=args.num_prompts,
                       max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens,
                       temperature=args.temperature, seed=args.data_seed, layers=layers,
                       extra_answers=args.extra_answers, extra_temperature=args.extra_temperature)
    data_dir, shards = ensure_distill(spec, args.cache_dir, max_num_seqs=args.gen_batch,
                                      device=args.gen_device or args.device, dtype=args.gen_dtype,
                                      shard_size=getattr(args, "gen_shard_size", 64))
    data = DistillData.load(data_dir, layers=trainer.data_layers(args, L), shards=shards)
    gen_s = time.perf_counter() - t0
    train_ids, val_ids = data.split(args.val_fraction, args.data_seed)
    eval_data = None
    if getattr(args, "eval_prompts", None):  # another prompt set, answered the same way, never trained on
        espec = attrs.evolve(spec, prompts=str(args.eval_prompts), num_prompts=args.eval_num_prompts,
                             max_prompt_tokens=max(args.max_prompt_tokens, 1024), extra_answers=0)
        edir, eshards = ensure_distill(espec, args.cache_dir, max_num_seqs=args.gen_batch,
                                       device=args.gen_device or args.device, dtype=args.gen_dtype,
                                       shard_size=getattr(args, "gen_shard_size", 64))
        eval_data = DistillData.load(edir, layers=trainer.data_layers(args, L), shards=eshards)
    data, eval_data = on_device(data, device), on_device(eval_data, device)
    log.info("data %s: %d sequences (%d train, %d validation), %d tokens", data_dir, len(data), len(train_ids),
             len(val_ids), data.num_tokens(range(len(data))))

    # 2. the module
    module = trainer.build(args, target, read_state_dict(model_path), data, train_ids).to(device)
    if getattr(args, "loss_vocab", 0):  # not a parameter: rebuilt identically on --resume
        module.loss_vocab = frequent_tokens(data, train_ids, args.loss_vocab, target.vocab_size).to(device)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _schedule(s, args.warmup, args.steps))
    rng = random.Random(args.seed)
    ckpt = out / "checkpoint.pt"
    start, history, train_s, queue = 0, [], 0.0, []
    if args.resume and ckpt.exists():
        state = torch.load(ckpt, map_location=device, weights_only=False)
        module.load_state_dict(state["module"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        rng.setstate(state["rng"])
        start, history, train_s = state["step"], state["history"], state.get("train_seconds", 0.0)
        queue = state.get("queue", [])
        log.info("resumed from %s at step %d", ckpt, start)

    # 3. train
    from tqdm.auto import tqdm
    K = trainer.positions(args)
    bar = tqdm(total=args.steps, initial=start, desc=f"train {trainer.name}", unit="step")
    ema_loss, ema_acc = None, None
    t1 = time.perf_counter()
    for step in range(start, args.steps):
        if not queue:
            queue = length_buckets(data, train_ids, args.batch_size, rng)
        batch = data.batch(queue.pop(), args.max_len, device, args.prompt_context)
        loss, correct, total = trainer.loss(module, batch, target, args)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, args.clip)
        opt.step()
        sched.step()
        acc = float(correct[0] / total[0]) if total[0] else 0.0
        lv = loss.item()
        ema_loss = lv if ema_loss is None else 0.95 * ema_loss + 0.05 * lv
        ema_acc = acc if ema_acc is None else 0.95 * ema_acc + 0.05 * acc
        bar.set_postfix(loss=f"{ema_loss:.3f}", acc1=f"{ema_acc:.3f}", lr=f"{sched.get_last_lr()[0]:.1e}")
        bar.update(1)
        out_of_time = bool(args.time_limit) and train_s + time.perf_counter() - t1 > args.time_limit
        if out_of_time:
            bar.write(f"--time-limit {args.time_limit:g}s reached at step {step + 1} of {args.steps}: "
                      "validating and exporting")
        last = step + 1 == args.steps or out_of_time
        if args.eval_every and ((step + 1) % args.eval_every == 0 or last) and val_ids:
            val = evaluate(trainer, module, data, val_ids[: args.val_max_seqs], target, args, device)
            history.append({"step": step + 1, "val_accuracy": val, "train_loss": round(ema_loss, 4)})
            bar.write(f"step {step + 1}: validation top-1 per position {val} (expected length "
                      f"{expected_length(val)})")
            if eval_data is not None:
                ev = evaluate(trainer, module, eval_data, list(range(len(eval_data))), target, args, device)
                history[-1]["eval_accuracy"] = ev
                bar.write(f"step {step + 1}: --eval-prompts top-1 per position {ev} (expected length "
                          f"{expected_length(ev)})")
        if (step + 1) % args.save_every == 0 or last:
            elapsed = train_s + time.perf_counter() - t1
            torch.save({"module": module.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                        "rng": rng.getstate(), "step": step + 1, "history": history, "train_seconds": elapsed,
                        "queue": queue}, ckpt)
        if out_of_time:
            break
    bar.close()
    train_s += time.perf_counter() - t1

    # 4. validate and export
    val = evaluate(trainer, module, data, val_ids[: args.val_max_seqs], target, args, device) if val_ids else []
    ev = evaluate(trainer, module, eval_data, list(range(len(eval_data))), target, args, device) \
        if eval_data is not None else None
    report = {
        "method": trainer.name, "target": target.fingerprint(),
        "command": "speculum " + " ".join(args.argv) if getattr(args, "argv", None) else " ".join(sys.argv),
        "data": {**attrs.asdict(spec), "model": target.name, "sequences": len(data), "train_sequences": len(train_ids),
                 "validation_sequences": len(val_ids), "tokens": data.num_tokens(range(len(data))),
                 "seconds": round(gen_s, 1)},
        "steps": step + 1 if args.steps > start else start, "batch_size": args.batch_size, "lr": args.lr,
        "train_seconds": round(train_s, 1),
        "val_accuracy_per_position": val, "expected_acceptance_length": expected_length(val),
        "positions": K, "history": history,
    }
    if ev is not None:
        report.update({"eval_prompts": str(args.eval_prompts), "eval_sequences": len(eval_data),
                       "eval_accuracy_per_position": ev, "eval_expected_acceptance_length": expected_length(ev)})
    meta = {"method": trainer.name, "target": target.fingerprint(),
            "training": {k: report[k] for k in ("command", "steps", "val_accuracy_per_position", "train_seconds",
                                                "eval_prompts", "eval_accuracy_per_position") if k in report}}
    trainer.export(module, out, target, args, meta)
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    normalize_modes(out)
    print(f"{trainer.name}: validation top-1 agreement per position {val}; wrote {out}")
    if ev is not None:
        print(f"{trainer.name}: on {args.eval_prompts}: top-1 agreement per position {ev} (expected acceptance "
              f"length {expected_length(ev)})")
    return report
