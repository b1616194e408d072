"""Issue 13's must-show, read from two ``bench serve --compare`` result files.

- ``sweep``: rates from 1 request/s to all at once (64 concurrent) with an ``"auto"``
  config and a fixed k beside no speculation: auto's output throughput must be at
  least ``floor`` (0.97) times no speculation's at every rate;
- ``c1``: concurrency 1 with ``"auto"`` and fixed k = 1..K: auto's speedup over no
  speculation must be at least ``share`` (0.90) of the best fixed k's speedup.

``python -m speculum.bench.load_check SWEEP.json C1.json`` prints both tables and the
verdicts and writes them as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _configs(result: dict) -> dict[str, dict]:
    return {c["label"]: c for c in result.get("configs", [])}


def _auto_label(result: dict) -> str:
    for c in result.get("configs", []):
        if c["speculative_config"].get("num_speculative_tokens_per_batch_size") == "auto":
            return c["label"]
    raise ValueError("no config with num_speculative_tokens_per_batch_size 'auto' in this result")


def check(sweep: dict, c1: dict, floor: float = 0.97, share: float = 0.90) -> dict:
    """The verdicts and the figures behind them."""
    auto = _auto_label(sweep)
    base = sweep["baseline"]["runs"]
    rows = []
    for i, b in enumerate(base):
        row = {"rate": b["request_rate"], "none_tok_s": b["output_throughput"]}
        for label, c in _configs(sweep).items():
            r = c["runs"][i]
            row[label] = {"tok_s": r["output_throughput"], "ratio": c["throughput_ratio"][i],
                          "steps_per_k": (r.get("spec_decode") or {}).get("steps_per_k")}
        rows.append(row)
    worst = min(c for c in _configs(sweep)[auto]["throughput_ratio"] if c is not None)
    c1_auto = _auto_label(c1)
    c1_base = c1["baseline"]["runs"][0]["output_throughput"]
    speedups = {label: c["runs"][0]["output_throughput"] / c1_base for label, c in _configs(c1).items()}
    fixed = {label: v for label, v in speedups.items() if label != c1_auto}
    best = max(fixed, key=lambda label: fixed[label]) if fixed else None
    got = speedups[c1_auto] / fixed[best] if best else None
    return {"sweep": {"auto": auto, "rows": rows, "worst_ratio": worst, "floor": floor, "ok": worst >= floor},
            "concurrency_1": {"auto": c1_auto, "baseline_tok_s": c1_base, "speedups": speedups, "best_fixed": best,
                              "auto_share_of_best": got, "share": share, "ok": got is not None and got >= share},
            "ok": worst >= floor and got is not None and got >= share}


def format_check(v: dict) -> str:
    s = v["sweep"]
    labels = [k for k in s["rows"][0] if k not in ("rate", "none_tok_s")]
    out = ["== output throughput against no speculation, 64 concurrent",
           f"{'rate':>6} {'none tok/s':>11} " + " ".join(f"{lab[:22]:>22} {'x':>6}" for lab in labels)]
    for r in s["rows"]:
        out.append(f"{str(r['rate']):>6} {r['none_tok_s']:>11.1f} "
                   + " ".join(f"{r[lab]['tok_s']:>22.1f} {r[lab]['ratio']:>6.3f}" for lab in labels))
    out.append(f"auto ({s['auto']}): worst ratio {s['worst_ratio']:.3f} (must be >= {s['floor']}): "
               f"{'ok' if s['ok'] else 'FAIL'}")
    c = v["concurrency_1"]
    out += ["", f"== concurrency 1: speedup over no speculation ({c['baseline_tok_s']:.1f} tok/s)"]
    out += [f"{lab:>24} {x:.3f}" for lab, x in c["speedups"].items()]
    share = c["auto_share_of_best"]
    out.append(f"auto / best fixed ({c['best_fixed']}): {'-' if share is None else f'{share:.3f}'} "
               f"(must be >= {c['share']}): {'ok' if c['ok'] else 'FAIL'}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m speculum.bench.load_check", description=__doc__.split("\n\n")[0])
    p.add_argument("sweep", help="bench serve --compare JSON of the rate sweep (auto and a fixed k)")
    p.add_argument("c1", help="bench serve --compare JSON at concurrency 1 (auto and fixed k = 1..K)")
    p.add_argument("--json", default=None, help="write the verdicts here")
    args = p.parse_args(argv)
    v = check(json.loads(Path(args.sweep).read_text()), json.loads(Path(args.c1).read_text()))
    print(format_check(v))
    if args.json:
        Path(args.json).write_text(json.dumps(v, indent=2))
    return 0 if v["ok"] else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
