"""Tables for ``speculum bench serve``: one run, a sweep, and baseline vs speculation."""

from __future__ import annotations


def _f(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def run_table(r: dict, title: str = "Serving Benchmark Result") -> str:
    """vllm-bench-style block for one run."""
    sd = r.get("spec_decode") or {}
    rows = [
        ("Request rate (req/s)", str(r["request_rate"])),
        ("Max concurrency", str(r.get("max_concurrency") or "-")),
        ("Successful requests", str(r["completed"])),
        ("Failed requests", str(r["failed"])),
        ("Benchmark duration (s)", _f(r["duration"])),
        ("Total input tokens", str(r["total_input_tokens"])),
        ("Total generated tokens", str(r["total_output_tokens"])),
        ("Request throughput (req/s)", _f(r["request_throughput"])),
        ("Output token throughput (tok/s)", _f(r["output_throughput"])),
    ]
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency")):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {label} (ms)", _f(r[f"{stat}_{name}_ms"])))
    if sd and sd.get("num_draft_tokens"):
        rows += [("Draft acceptance rate", _f(sd["acceptance_rate"], ".3f")),
                 ("Mean acceptance length", _f(sd["mean_acceptance_length"], ".3f")),
                 ("Drafted / accepted tokens", f"{sd['num_draft_tokens']} / {sd['num_accepted_tokens']}")]
    width = max(len(k) for k, _ in rows) + 4
    line = "=" * (width + 12)
    out = [line, f"{title:^{len(line)}}", line]
    out += [f"{k:<{width}}{v:>12}" for k, v in rows]
    out.append(line)
    return "\n".join(out)


def sweep_table(runs: list[dict]) -> str:
    """One row per request rate."""
    head = ("rate", "done", "fail", "req/s", "out tok/s", "TTFT mean", "TTFT p99", "TPOT mean", "TPOT p99",
            "ITL mean", "E2E mean", "accept", "mean k")
    rows = [head]
    for r in runs:
        sd = r.get("spec_decode") or {}
        rows.append((str(r["request_rate"]), str(r["completed"]), str(r["failed"]), _f(r["request_throughput"]),
                     _f(r["output_throughput"], ".1f"), _f(r["mean_ttft_ms"], ".1f"), _f(r["p99_ttft_ms"], ".1f"),
                     _f(r["mean_tpot_ms"], ".1f"), _f(r["p99_tpot_ms"], ".1f"), _f(r["mean_itl_ms"], ".1f"),
                     _f(r["mean_e2el_ms"], ".0f"), _f(sd.get("acceptance_rate") if sd else None, ".3f"),
                     _f(mean_k(r), ".2f")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("(latencies in ms)")
    return "\n".join(lines)


def compare_rows(base: list[dict], spec: list[dict]) -> list[dict]:
    """The "what to look for" rows: low load = the first (lowest) rate, high load = the last."""
    lo_b, hi_b, lo_s, hi_s = base[0], base[-1], spec[0], spec[-1]

    def row(metric, b, s, unit, better_low: bool):
        if b is None or s is None or not b or not s:
            ratio, verdict = None, "-"
        elif better_low:
            ratio = b / s
            verdict = _verdict(ratio, f"{ratio:.2f}x faster", f"{1 / ratio:.2f}x slower")
        else:
            ratio = s / b
            verdict = _verdict(ratio, f"{ratio:.2f}x more", f"{1 / ratio:.2f}x less")
        return {"metric": metric, "baseline": b, "speculative": s, "unit": unit, "ratio": ratio, "verdict": verdict}

    rows = [
        row(f"TPOT (low load, rate {lo_b['request_rate']})", lo_b["mean_tpot_ms"], lo_s["mean_tpot_ms"], "ms", True),
        row(f"TPOT (high load, rate {hi_b['request_rate']})", hi_b["mean_tpot_ms"], hi_s["mean_tpot_ms"], "ms", True),
        row("TTFT (low load)", lo_b["mean_ttft_ms"], lo_s["mean_ttft_ms"], "ms", True),
        row("TTFT (high load)", hi_b["mean_ttft_ms"], hi_s["mean_ttft_ms"], "ms", True),
        row("Throughput (low load)", lo_b["output_throughput"], lo_s["output_throughput"], "tok/s", False),
        row("Throughput (high load)", hi_b["output_throughput"], hi_s["output_throughput"], "tok/s", False),
    ]
    accs = [r["spec_decode"]["acceptance_rate"] for r in spec
            if r.get("spec_decode") and r["spec_decode"].get("acceptance_rate") is not None]
    mals = [r["spec_decode"]["mean_acceptance_length"] for r in spec
            if r.get("spec_decode") and r["spec_decode"].get("mean_acceptance_length") is not None]
    acc = sum(accs) / len(accs) if accs else None
    rows.append({"metric": "Acceptance rate", "baseline": None, "speculative": acc, "unit": "", "ratio": None,
                 "verdict": "-" if acc is None else ("good (> 0.7)" if acc > 0.7 else "low (< 0.7): try another "
                                                      "draft or fewer speculative tokens")})
    rows.append({"metric": "Mean acceptance length", "baseline": None,
                 "speculative": sum(mals) / len(mals) if mals else None, "unit": "tok/step", "ratio": None,
                 "verdict": "-"})
    return rows


def _verdict(ratio: float, better: str, worse: str) -> str:
    if ratio >= 1.1:
        return f"better: {better}"
    if ratio <= 0.9:
        return f"worse: {worse}"
    return "about the same"


def compare_table(rows: list[dict]) -> str:
    out = [("Metric", "Baseline", "With speculation", "Ratio", "What it means")]
    for r in rows:
        fmt = ".3f" if r["unit"] in ("", "tok/step") else ".1f"
        unit = f" {r['unit']}" if r["unit"] not in ("",) else ""
        b = "-" if r["baseline"] is None else f"{r['baseline']:{fmt}}{unit}"
        s = "-" if r["speculative"] is None else f"{r['speculative']:{fmt}}{unit}"
        out.append((r["metric"], b, s, _f(r["ratio"]) + ("x" if r["ratio"] is not None else ""), r["verdict"]))
    widths = [max(len(row[i]) for row in out) for i in range(5)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in out]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def throughput_ratios(base: list[dict], spec: list[dict]) -> list[float | None]:
    """Output throughput with speculation over without, per request rate (same order)."""
    return [(s["output_throughput"] / b["output_throughput"]) if b["output_throughput"] else None
            for b, s in zip(base, spec)]


def mean_k(run: dict) -> float | None:
    """Mean speculation length per engine step during a run (from steps_per_k)."""
    per_k = (run.get("spec_decode") or {}).get("steps_per_k") or []
    n = sum(per_k)
    return sum(k * c for k, c in enumerate(per_k)) / n if n else None


def ratio_table(base: list[dict], specs: dict[str, list[dict]]) -> str:
    """Per rate: baseline tok/s, then each config's tok/s, ratio and mean k per step."""
    head = ["rate", "none tok/s"]
    for label in specs:
        head += [f"{label} tok/s", "x", "mean k"]
    rows = [head]
    for i, b in enumerate(base):
        row = [str(b["request_rate"]), _f(b["output_throughput"], ".1f")]
        for runs in specs.values():
            s = runs[i]
            ratio = s["output_throughput"] / b["output_throughput"] if b["output_throughput"] else None
            row += [_f(s["output_throughput"], ".1f"), _f(ratio, ".3f"), _f(mean_k(s), ".2f")]
        rows.append(row)
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
