"""The A/B of ``scripts/device/fold_ab.sh``: per configuration, tokens/s and step profile
without the host cuts ("[unfolded]" engines; the repeated autoregressive baseline) and with
them, from ``bench offline --interleave`` JSON files, each variant's speedup against its own
autoregressive baseline, and after/before (the mean's ratio, and the median over the files'
categories of each category's ratio).

    python3 scripts/device/fold_report.py fold_1.json [fold_2.json ...]
"""

from __future__ import annotations

import json
import statistics
import sys


def rows(paths: list[str]) -> dict[str, dict[str, list[dict]]]:
    """{config: {"before"|"after": [result, ...]}} over the files."""
    out: dict[str, dict[str, list[dict]]] = {}
    for path in paths:
        for r in json.load(open(path))["results"]:
            name = r["method"]
            before = name.endswith("[unfolded]") or "(again)" in name
            key = "autoregressive" if not r["config"] else json.dumps(r["config"], separators=(",", ":"))
            out.setdefault(key, {}).setdefault("before" if before else "after", []).append(r)
    return out


def main(paths: list[str]) -> None:
    table = rows(paths)
    ar = {v: sum(r["total"]["tokens_per_s"] for r in rs) / len(rs) for v, rs in table["autoregressive"].items()}
    print(f"{'config':<62}{'before tok/s':>13}{'after tok/s':>12}{'after/before':>13}{'median':>7}{'x before':>9}"
          f"{'x after':>8}{'host ms b/a':>14}")
    for key, by in table.items():
        if set(by) != {"before", "after"}:
            continue
        tps = {v: sum(r["total"]["tokens_per_s"] for r in rs) / len(rs) for v, rs in by.items()}
        # the step profile's host time (bench offline --profile; "-" for runs without it)
        host = {v: [r["profile"]["host_ms"] for r in rs if (r.get("profile") or {}).get("host_ms") is not None]
                for v, rs in by.items()}
        host = {v: f"{statistics.mean(h):.3f}" if h else "-" for v, h in host.items()}
        # the median over (file, category) pairs of after/before: one category's hiccup (a 40% dip
        # of one engine on one category, 2026-12-03) moves the mean, not this
        mid = statistics.median(a["categories"][c]["tokens_per_s"] / b["categories"][c]["tokens_per_s"]
                                for b, a in zip(by["before"], by["after"]) for c in a["categories"])
        print(f"{key[:61]:<62}{tps['before']:>13.1f}{tps['after']:>12.1f}{tps['after'] / tps['before']:>13.3f}{mid:>7.3f}"
              f"{tps['before'] / ar['before']:>9.3f}{tps['after'] / ar['after']:>8.3f}"
              f"{host['before']:>7}/{host['after']}")


if __name__ == "__main__":
    main(sys.argv[1:])
