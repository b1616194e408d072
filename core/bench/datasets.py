"""Prompts for the benchmark: MT-bench by default, or a JSONL of ``{"prompt": ...}``."""

from __future__ import annotations

import json
from pathlib import Path

from speculum.errors import RequestError


def load_prompts(dataset: str | None = None, num_prompts: int | None = None) -> list[str | list[int]]:
    """Prompts as strings (or token-id lists), repeated in order to reach ``num_prompts``.

    ``dataset``: a JSONL file whose lines hold ``prompt`` (a string or a list of token
    ids) or ``prompt_token_ids``; MT-bench style lines (``turns``) work too. None: the MT-bench questions.
    """
    if dataset is None:
        from speculum.datasets import first_turn, mt_bench
        prompts: list = [first_turn(r) for r in mt_bench()]
    else:
        path = Path(dataset)
        if not path.exists():
            raise RequestError(f"dataset {path} not found; give a JSONL file with one {{\"prompt\": ...}} per line")
        prompts = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RequestError(f"{path}:{n}: not JSON ({exc})") from exc
            p = (row.get("prompt") or row.get("prompt_token_ids")) if isinstance(row, dict) else None
            if p is None and isinstance(row, dict) and row.get("turns"):
                p = row["turns"][0]
            if not (isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p))):
                raise RequestError(f"{path}:{n}: expected {{\"prompt\": \"text\"}} or {{\"prompt\": [token ids]}}")
            prompts.append(p)
    if not prompts:
        raise RequestError("the dataset has no prompts")
    if num_prompts is None:
        return prompts
    return [prompts[i % len(prompts)] for i in range(num_prompts)]
