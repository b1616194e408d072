"""MT-bench-style prompt files with long prompts, for measuring how a method's speed holds
as the context grows (issue 16): each category's first question, preceded by "notes" made
of the other MT-bench questions until the prompt is about N tokens (4 characters per token),
retrieval-augmented-answer style.

    python scripts/long_prompts.py --tokens 100,500,2000 --out /tmp/long
    speculum bench offline --mt-bench /tmp/long/long_2000.jsonl --prompts-per-category 1 ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from speculum.datasets import first_turn, mt_bench, per_category


def build(tokens: int) -> list[dict]:
    rows = mt_bench()
    pool = [t for r in rows for t in r["turns"]]
    out = []
    for i, (cat, group) in enumerate(per_category(rows, 1, None).items()):
        q = first_turn(group[0])
        notes, n, j = [], 0, 7 * i  # each category starts the notes elsewhere
        while n < 4 * tokens - len(q) - 80:
            t = pool[j % len(pool)]
            j += 1
            if t == q:
                continue
            notes.append(f"- {t}")
            n += len(t) + 3
        text = "Here are some notes:\n" + "\n".join(notes) + f"\n\nWith these notes in mind, answer this: {q}"
        out.append({"question_id": group[0]["question_id"], "category": cat, "turns": [text]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="100,500,2000", help="comma separated prompt lengths (about)")
    ap.add_argument("--out", default="results/long_prompts", help="folder for long_<N>.jsonl")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for n in (int(x) for x in args.tokens.split(",")):
        path = out / f"long_{n}.jsonl"
        rows = build(n)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{path}: {len(rows)} prompts of about {n} tokens")


if __name__ == "__main__":
    main()
