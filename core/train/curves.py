"""Training curves: validation figures against training time, collected and plotted.

``python -m speculum.train.curves RUN_DIR... --json curves.json [--plot curves.png]``
reads each run's ``training.json`` (``speculum train`` writes one per output folder, its
``history`` holding a validation entry every ``--eval-every`` steps / ``--eval-seconds``
seconds), writes them as one JSON ``{method: {"seconds": [...], "val_accuracy_1": [...],
"val_acceptance_length": [...], "eval_acceptance_length": [...], ...}}`` and, with
``--plot``, a figure (matplotlib): top-1 agreement at draft position 1 and expected
acceptance length against training seconds, on the validation split and on the
``--eval-prompts`` set. ``--from-json`` plots a curves JSON written earlier.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence


def collect(run_dirs: Sequence[str | Path]) -> dict[str, dict]:
    """{run name: curve} from each run's ``training.json`` (runs without one are skipped)."""
    out = {}
    for d in run_dirs:
        f = Path(d) / "training.json"
        if not f.exists():
            continue
        rep = json.loads(f.read_text())
        hist = rep.get("history") or []
        curve = {"method": rep.get("method"), "steps": [h["step"] for h in hist],
                 "seconds": [h.get("seconds") for h in hist]}
        for split in ("val", "eval"):
            acc = [h.get(f"{split}_accuracy") for h in hist]
            if any(a is not None for a in acc):
                curve[f"{split}_accuracy_1"] = [a[0] if a else None for a in acc]
                curve[f"{split}_acceptance_length"] = [h.get(f"{split}_acceptance_length") for h in hist]
        curve["final"] = {k: rep.get(k) for k in ("val_accuracy_per_position", "expected_acceptance_length",
                                                   "eval_accuracy_per_position", "eval_expected_acceptance_length",
                                                   "train_seconds", "steps")}
        out[Path(d).name] = curve
    return out


def plot(curves: dict[str, dict], path: str | Path, title: str = "") -> Path:
    """A 2 x 2 figure: position-1 agreement and acceptance length vs seconds, validation
    split (left) and --eval-prompts set (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    panels = [("val_accuracy_1", "validation: top-1 agreement, position 1"),
              ("eval_accuracy_1", "eval prompts: top-1 agreement, position 1"),
              ("val_acceptance_length", "validation: expected acceptance length"),
              ("eval_acceptance_length", "eval prompts: expected acceptance length")]
    for ax, (key, label) in zip(axes.flat, panels):
        for name, c in sorted(curves.items()):
            ys = c.get(key)
            if not ys:
                continue
            pts = [(s, y) for s, y in zip(c["seconds"], ys) if s is not None and y is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=name)
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("training seconds")
    axes[0][0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m speculum.train.curves", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", help="output folders of `speculum train` runs")
    p.add_argument("--json", default=None, help="write the curves here")
    p.add_argument("--from-json", default=None, help="plot curves written earlier by --json")
    p.add_argument("--plot", default=None, help="write the figure here (.png, .svg ...)")
    p.add_argument("--title", default="")
    a = p.parse_args(argv)
    curves = json.loads(Path(a.from_json).read_text()) if a.from_json else collect(a.runs)
    if not curves:
        raise SystemExit("no training.json found in the given folders")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(curves, indent=2) + "\n")
        print(f"wrote {a.json}")
    if a.plot:
        print(f"wrote {plot(curves, a.plot, a.title)}")
    for name, c in sorted(curves.items()):
        f = c["final"]
        print(f"{name:<10} {f.get('train_seconds')} s, {f.get('steps')} steps: validation {f.get('val_accuracy_per_position')}"
              f" (MAL {f.get('expected_acceptance_length')}), eval MAL {f.get('eval_expected_acceptance_length')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
