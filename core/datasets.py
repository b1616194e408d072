"""Prompt sets shipped with speculum, and reading prompt files.

The package carries its own data (``speculum/data/``, see the README there): the 80
MT-bench questions for evaluation and 4,728 self-instruct / P3 prompts for training
heads. They are found through :mod:`importlib.resources`, so a plain install or a clone
of the repository has everything the main commands need.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from speculum.errors import RequestError

MT_BENCH = "mt_bench.jsonl"
#: 40 prompts of five task types MT-bench lacks (translation, summarization, qa,
#: math_reasoning, rag), written for speculum: a check that heads carry over; never trained on
OTHER_TASKS = "other_tasks.jsonl"
#: evaluation sets by name (``--eval-prompts``, ``bench offline --mt-bench``)
EVAL_SETS = {"mt_bench": MT_BENCH, "other_tasks": OTHER_TASKS}
TRAIN_PROMPTS = "train_prompts.jsonl"


def data_path(name: str) -> Path:
    """Path of a file shipped in ``speculum/data`` (``mt_bench.jsonl``, ``other_tasks.jsonl``,
    ``train_prompts.jsonl``)."""
    path = Path(str(resources.files("speculum").joinpath("data", name)))
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the speculum package; reinstall speculum")
    return path


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSONL file; a bad line is a RequestError naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise RequestError(f"prompt file {path} not found; give an existing JSONL file")
    rows = []
    # lines end at "\n" only: str.splitlines() also splits at U+0085, U+2028 and other
    # separators that JSON strings may hold raw (the shipped training prompts have one)
    for n, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise RequestError(f"{path}:{n}: not JSON ({exc})") from exc
    return rows


def mt_bench(n: int | None = None, path: str | Path | None = None) -> list[dict]:
    """MT-bench questions ``{question_id, category, turns}``: the shipped 80, or ``path`` (a
    JSONL file in that layout, or a shipped set by name: :data:`EVAL_SETS`)."""
    rows = read_jsonl(eval_set_path(str(path)) if path else data_path(MT_BENCH))
    return rows[:n] if n else rows


def first_turn(row: dict) -> str:
    """The prompt text of an MT-bench style or ``{"prompt": ...}`` row."""
    if row.get("turns"):
        return row["turns"][0]
    text = row.get("prompt") or row.get("text")
    if not isinstance(text, str):
        raise RequestError(f"a prompt row needs 'turns' or a text 'prompt', got keys {sorted(row)}")
    return text


def per_category(rows: list[dict], per_category: int | None = None,
                 categories: set[str] | None = None) -> dict[str, list[dict]]:
    """Rows grouped by ``category`` in file order, at most ``per_category`` each."""
    out: dict[str, list[dict]] = {}
    for r in rows:
        c = r.get("category", "-")
        if categories and c not in categories:
            continue
        group = out.setdefault(c, [])
        if per_category is None or len(group) < per_category:
            group.append(r)
    return out


def eval_set_path(name: str) -> str:
    """A shipped evaluation set by name (:data:`EVAL_SETS`: ``mt_bench``, ``other_tasks``)
    or a JSONL path, as a path."""
    return str(data_path(EVAL_SETS[name])) if name in EVAL_SETS else name


def is_eval_set(path: str | Path) -> bool:
    """Whether a prompt file is one of the shipped evaluation sets (by name): never trained on,
    and never a source of drafts."""
    return any(name in Path(path).name for name in EVAL_SETS)


def train_prompts_path() -> Path:
    """The shipped training prompts (never MT-bench)."""
    return data_path(TRAIN_PROMPTS)
