"""Tables and the docs figure for token trees, from ``speculum bench offline`` JSON files.

    python scripts/trees_report.py --sweep trees_sweep_b1.json --b1 trees_b1a.json trees_b1b.json \
        --b16 trees_b16.json --figure docs/results/h200/plots/trees_budget.png

(the files ``scripts/device/bench_trees.sh`` writes; a sweep in parts: ``--sweep a.json b.json``).
Prints markdown: the node-budget
sweep, MAL and tokens/s per MT-bench category at batch 1 (parts merged; they share the
autoregressive baseline, which is checked), chain against best tree per method with the
issue's targets (MAL +0.5, faster than the chain), batch 16, and the step profile of
the fastest config. The figure shows MAL and tokens/s against tokens verified per step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(path: str) -> dict:
    return json.loads(Path(path).read_text())


def method_of(row: dict) -> str:
    return (row.get("config") or {}).get("method", "autoregressive")


def is_tree(row: dict) -> bool:
    c = row.get("config") or {}
    return "tree_topk" in c or "speculative_token_tree" in c


def scheduled(row: dict) -> bool:
    """A config whose k follows a schedule or "auto" (the batch-16 part runs each tree that way too)."""
    return "num_speculative_tokens_per_batch_size" in (row.get("config") or {})


def budget(row: dict) -> int:
    """Tokens the target verifies per step (SGLang's num_draft_tokens; chain: k + 1)."""
    c = row.get("config") or {}
    if "num_draft_tokens" in c:
        return int(c["num_draft_tokens"])
    if "speculative_token_tree" in c:
        return len(c["speculative_token_tree"]) + 1
    return int(c.get("num_speculative_tokens", 0)) + 1


def merge(parts: list[dict]) -> dict:
    """One report from several runs that each start with the same autoregressive baseline."""
    base = parts[0]["results"][0]
    rows = list(parts[0]["results"])
    for p in parts[1:]:
        b = p["results"][0]
        ratio = b["total"]["tokens_per_s"] / base["total"]["tokens_per_s"]
        if abs(ratio - 1) > 0.05:
            print(f"warning: the autoregressive baselines of the parts differ by {100 * (ratio - 1):+.1f}%")
        rows += p["results"][1:]
    return {**parts[0], "results": rows}


def f(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def sweep_table(rep: dict) -> str:
    rows = rep["results"]
    ar = rows[0]["total"]["tokens_per_s"]
    out = [f"Node-budget sweep (batch {rep['batch_size']}, {rep['prompts_per_category']} questions per category, "
           f"{rep['max_tokens']} tokens): total MAL / tok/s (speedup)", "",
           "| method | config | tokens verified per step | MAL | tok/s | speedup |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        t = r["total"]
        out.append(f"| {method_of(r)} | {r['method']} | {budget(r) if r.get('config') else 1} | "
                   f"{f(t.get('mean_acceptance_length'))} | {t['tokens_per_s']:.0f} | {t['tokens_per_s'] / ar:.2f} |")
    return "\n".join(out)


def category_table(rep: dict) -> str:
    rows = rep["results"]
    cats = list(rows[0]["categories"])
    head = "| category | " + " | ".join(f"{r['method']} MAL | tok/s" for r in rows) + " |"
    how = "all at once (per category: MAL only)" if rep.get("pooled") else (
        "each category its own batch" if rep["batch_size"] > 1 else "one at a time")
    out = [f"MT-bench, batch {rep['batch_size']}, {rep['max_tokens']} new tokens, greedy, "
           f"{rep['prompts_per_category']} questions per category, {how}", "", head,
           "| --- |" + " --- | --- |" * len(rows)]
    for c in cats + ["total"]:
        cells = []
        for r in rows:
            e = r["total"] if c == "total" else r["categories"][c]
            cells.append(f"{f(e.get('mean_acceptance_length'))} | {f(e['tokens_per_s'], '.0f')}")  # None: pooled
        name = f"**{c}**" if c == "total" else c
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def verdicts(rep: dict) -> str:
    """Per method: best tree vs chain, against the targets."""
    rows = rep["results"]
    ar = rows[0]["total"]["tokens_per_s"]
    autos = any(scheduled(r) for r in rows)
    out = ["| method | chain MAL | tree | tree MAL | MAL gain | chain tok/s | tree tok/s | tree/chain | targets |"
           + (" tree, auto: tok/s (x AR) |" if autos else ""),
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if autos else "")]
    for m in dict.fromkeys(method_of(r) for r in rows[1:]):
        chains = [r for r in rows if method_of(r) == m and not is_tree(r) and not scheduled(r)]
        trees = [r for r in rows if method_of(r) == m and is_tree(r) and not scheduled(r)]
        auto = [r for r in rows if method_of(r) == m and scheduled(r)]
        if not chains or not trees:
            continue
        c = chains[0]["total"]
        best = max(trees, key=lambda r: r["total"]["tokens_per_s"])
        t = best["total"]
        gain = (t["mean_acceptance_length"] or 1) - (c["mean_acceptance_length"] or 1)
        speed = t["tokens_per_s"] / c["tokens_per_s"]
        ok = "met" if gain >= 0.5 and speed > 1 else "NOT met"
        out.append(f"| {m} | {f(c['mean_acceptance_length'])} | {best['method']} | {f(t['mean_acceptance_length'])} | "
                   f"{gain:+.2f} | {c['tokens_per_s']:.0f} | {t['tokens_per_s']:.0f} | {speed:.2f} | {ok} |"
                   + (f" {auto[0]['total']['tokens_per_s']:.0f} ({auto[0]['total']['tokens_per_s'] / ar:.2f}x) |"
                      if auto else " - |" if autos else ""))
    return "\n".join(out)


def profile_of_fastest(rep: dict) -> str:
    rows = [r for r in rep["results"] if r.get("profile")]
    if not rows:
        return "(no step profile in this run: pass --profile)"
    r = max(rows, key=lambda r: r["total"]["tokens_per_s"])
    p = r["profile"]
    return (f"step profile of the fastest config, {r['method']} (batch {rep['batch_size']}): "
            f"{p['step_ms']:.3f} ms per step = draft {p['draft_ms']:.3f} + verify {p['verify_ms']:.3f} + host "
            f"{p['host_ms']:.3f} ms; {p['tokens_per_loop_step']:.2f} tokens per step")


def figure(rep: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = rep["results"]
    ar = rows[0]["total"]["tokens_per_s"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, m in enumerate(dict.fromkeys(method_of(r) for r in rows[1:])):
        trees = sorted((r for r in rows if method_of(r) == m and is_tree(r) and not scheduled(r)), key=budget)
        chains = [r for r in rows if method_of(r) == m and not is_tree(r) and not scheduled(r)]
        color = f"C{i}"
        if trees:
            xs = [budget(r) for r in trees]
            a1.plot(xs, [r["total"]["mean_acceptance_length"] for r in trees], "o-", color=color, label=f"{m} tree")
            a2.plot(xs, [r["total"]["tokens_per_s"] for r in trees], "o-", color=color, label=f"{m} tree")
        for r in chains:
            a1.plot([budget(r)], [r["total"]["mean_acceptance_length"]], "s", color=color, mfc="none",
                    label=f"{m} chain k={budget(r) - 1}")
            a2.plot([budget(r)], [r["total"]["tokens_per_s"]], "s", color=color, mfc="none",
                    label=f"{m} chain k={budget(r) - 1}")
    a2.axhline(ar, color="gray", ls="--", label="autoregressive")
    a1.set_xlabel("tokens verified per step (num_draft_tokens)")
    a2.set_xlabel("tokens verified per step (num_draft_tokens)")
    a1.set_ylabel("mean acceptance length")
    a2.set_ylabel("tokens/s")
    a1.grid(alpha=0.3)
    a2.grid(alpha=0.3)
    a2.legend(fontsize=7, ncol=2)
    fig.suptitle(f"Token trees vs chains: MT-bench, batch {rep['batch_size']}, {rep.get('gpu', '')}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", nargs="*", default=[], help="the node-budget sweep (bench offline JSON; parts merged)")
    ap.add_argument("--b1", nargs="*", default=[], help="batch-1 runs to merge (same baseline first)")
    ap.add_argument("--b16", help="the batch-16 run")
    ap.add_argument("--figure", help="write the MAL / tokens-per-second figure of the sweep here")
    a = ap.parse_args(argv)
    if a.sweep:
        rep = merge([load(p) for p in a.sweep])
        print(sweep_table(rep), "\n")
        print(verdicts(rep), "\n")
        if a.figure:
            figure(rep, a.figure)
    if a.b1:
        rep = merge([load(p) for p in a.b1])
        print(category_table(rep), "\n")
        print(verdicts(rep), "\n")
        print(profile_of_fastest(rep), "\n")
    if a.b16:
        rep = load(a.b16)
        print(category_table(rep), "\n")
        print(verdicts(rep), "\n")
        print(profile_of_fastest(rep), "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
