"""Prompts written by the target itself: what users ask a chat model, as the model knows it.

An instruct model given its chat template up to the start of a user turn (the default
system prompt included) and nothing else continues with a user's request; sampled, the
requests are as varied as the chat data it was tuned on (the idea of Magpie, Xu et al.
2024). For a draft head this is training data that looks like use: the target's answers to
the requests it expects, not to one benchmark's questions. The file it writes is a prompt
file like any other (``{"source", "prompt"}`` per line) for ``speculum train --data``:

    python -m speculum.train.self_prompts --num 2000 --out self_prompts.jsonl
    speculum train eagle3 --data self_prompts.jsonl ...

Kept are requests the target ended itself (its end-of-turn token, not the length limit), of
at least ``--min-chars`` characters, each once (compared after
:func:`speculum.train.mix.normalise`), none matching an evaluation set (MT-bench by
default: the same check as the training data's). A JSON report beside the file counts
what each filter dropped and records the command.

``--after FILE`` (repeatable) continues earlier files instead of repeating them: their
requests count as duplicates, and sampling starts past the seeds their reports used (request
``i`` is sampled with seed ``SEED + i``, so a second run with the same seed writes the same
requests: on the H200, 2026-12-04, 3,000 "new" requests were the last run's, byte for byte).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

import attrs

from speculum.train.mix import Row, eval_texts, normalise, overlaps


@attrs.define
class Kept:
    """The requests kept so far and what each filter dropped."""

    prompts: list[str] = attrs.field(factory=list)
    generated: int = 0
    unfinished: int = 0
    too_short: int = 0
    duplicates: int = 0
    eval_overlaps: int = 0
    #: kept past the number asked for (the last batch's), left out of the file
    surplus: int = 0
    _seen: set[str] = attrs.field(factory=set)

    def add(self, texts: Iterable[tuple[str, bool]], min_chars: int, exclude: set[str]) -> None:
        """``texts``: (request, ended by the target itself) pairs, in order."""
        for text, finished in texts:
            self.generated += 1
            text = text.strip()
            if not finished:
                self.unfinished += 1
                continue
            key = normalise(text)
            if len(text) < min_chars or not key:  # no word in it counts as short too
                self.too_short += 1
                continue
            if key in self._seen:
                self.duplicates += 1
                continue
            if overlaps(Row(0, "self", (text,)), exclude):
                self.eval_overlaps += 1
                continue
            self._seen.add(key)
            self.prompts.append(text)

    def report(self) -> dict:
        counts = {k: v for k, v in attrs.asdict(self).items() if not k.startswith("_") and k != "prompts"}
        return counts | {"kept": len(self.prompts)}


def write_prompts(llm, num: int, out: Path, temperature: float = 1.0, top_p: float = 0.95, max_tokens: int = 128,
                  min_chars: int = 12, seed: int = 0, exclude: Sequence[str] = (), batch: int = 512,
                  max_rounds: int = 50, source: str = "self", progress: bool = True,
                  known: Iterable[str] = ()) -> Kept:
    """Sample requests from ``llm`` until ``num`` are kept (or ``max_rounds`` batches ran);
    write them to ``out`` (JSONL) and the report to ``out`` + ``.json``. ``known``: requests
    written before (an earlier file's): drawn again, they count as duplicates."""
    from speculum.sampling import SamplingParams

    prefix = llm.tokenizer.user_turn_prefix()
    texts = eval_texts(exclude)
    kept = Kept()
    kept._seen.update(normalise(t) for t in known)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=num, desc="self prompts", unit="prompt", file=sys.stderr)
    t0, n = time.perf_counter(), 0
    for _ in range(max_rounds):
        if len(kept.prompts) >= num:
            break
        size = min(batch, max(16, 2 * (num - len(kept.prompts))))
        params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed + n + i)
                  for i in range(size)]
        n += size
        outs = llm.generate([{"prompt_token_ids": prefix}] * size, params)
        before = len(kept.prompts)
        kept.add(((o.text, o.finish_reason == "stop") for o in outs), min_chars, texts)
        if bar is not None:
            bar.update(min(len(kept.prompts), num) - min(before, num))
    if bar is not None:
        bar.close()
    kept.surplus = max(0, len(kept.prompts) - num)
    kept.prompts = kept.prompts[:num]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps({"source": source, "prompt": p}) + "\n" for p in kept.prompts))
    report = kept.report() | {"seconds": round(time.perf_counter() - t0, 1), "temperature": temperature,
                              "top_p": top_p, "max_tokens": max_tokens, "min_chars": min_chars, "seed": seed,
                              "exclude": [Path(e).name for e in exclude], "command": " ".join(sys.argv)}
    Path(str(out) + ".json").write_text(json.dumps(report, indent=1) + "\n")
    return kept


def after(files: Sequence[str]) -> tuple[list[str], int]:
    """The requests of ``files`` (any prompt file: their first user turns) and the first seed
    past those their reports used (0 when none has a report)."""
    from speculum.train.mix import read_rows
    known, seed = [], 0
    for f in files:
        known += [r.turns[0] for r in read_rows(f) if r.turns]
        rep = Path(str(f) + ".json")
        if rep.exists():
            r = json.loads(rep.read_text())
            seed = max(seed, int(r.get("seed", 0)) + int(r.get("generated", 0)))
    return known, seed


def main(argv: Sequence[str] | None = None) -> int:

    ap = argparse.ArgumentParser(prog="python -m speculum.train.self_prompts",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="the target (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--num", type=int, default=2000, help="requests to keep")
    ap.add_argument("--out", required=True, help="JSONL to write (a report goes to OUT.json)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--max-tokens", type=int, default=128, help="a request longer than this is dropped")
    ap.add_argument("--min-chars", type=int, default=12, help="shorter requests are dropped")
    ap.add_argument("--seed", type=int, default=None,
                    help="request i is sampled with seed SEED + i (default 0, or past the seeds of the --after files)")
    ap.add_argument("--after", action="append", default=[], metavar="JSONL",
                    help="a file of requests written before (repeatable): none of its requests again, and the "
                         "seeds continue past those its report (JSONL.json) used")
    ap.add_argument("--eval-prompts", action="append", default=None, metavar="NAME_OR_JSONL",
                    help="evaluation sets no request may match (repeatable; default: mt_bench and other_tasks)")
    ap.add_argument("--batch", type=int, default=512, help="requests sampled per generate call")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--source", default=None, help="the rows' 'source' (default: self/<model name>)")
    args = ap.parse_args(argv)
    from speculum.datasets import EVAL_SETS, eval_set_path
    from speculum.engine import LLM

    known, seed = after(args.after)
    seed = seed if args.seed is None else args.seed
    llm = LLM(args.model, device=args.device, dtype=args.dtype, threads=args.threads, max_num_seqs=args.batch)
    exclude = [eval_set_path(e) for e in (args.eval_prompts or EVAL_SETS)]
    source = args.source or f"self/{llm.model_path.stem}"
    kept = write_prompts(llm, args.num, Path(args.out), args.temperature, args.top_p, args.max_tokens,
                         args.min_chars, seed, exclude, args.batch, source=source, known=known)
    r = kept.report()
    print(f"kept {r['kept']} of {r['generated']} requests (unfinished {r['unfinished']}, too short "
          f"{r['too_short']}, duplicates {r['duplicates']}, matching an evaluation prompt {r['eval_overlaps']}); "
          f"wrote {args.out}")
    return 0 if kept.prompts else 1


if __name__ == "__main__":
    raise SystemExit(main())
