"""Repeats of a ``bench serve --compare`` sweep, pooled into one run per rate.

At high load a served engine is host-bound and its throughput moves from one server
process to the next by more than the effects measured (on the H200, no speculation all at
once ran 2,915, 3,411 and 4,075 tok/s in three servers of the same afternoon). ``--repeats
N`` starts every server N times, in turns (baseline, each config, baseline, ...), so that
a slow spell or a slow process falls on every config alike; each rate's N runs are then
pooled as one longer run: counts and durations summed, throughputs recomputed from them,
means weighted by completed requests, the median of the medians and the largest p99;
the acceptance counters summed and their rates recomputed (:func:`pool_spec_decode`).
The runs themselves are kept beside the pooled ones.
"""

from __future__ import annotations

import statistics

_SUMS = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens")


def pool_runs(repeats: list[list[dict]]) -> list[dict]:
    """One run per rate from ``repeats`` (each a sweep: a run per rate, the same rates)."""
    if len(repeats) == 1:
        return repeats[0]
    return [pool_rate([sweep[i] for sweep in repeats]) for i in range(len(repeats[0]))]


def pool_rate(runs: list[dict]) -> dict:
    out = dict(runs[0])
    for k in _SUMS:
        out[k] = sum(r.get(k) or 0 for r in runs)
    out["errors"] = [e for r in runs for e in (r.get("errors") or [])][:20]
    dt = out["duration"] or float("inf")
    out["request_throughput"] = out["completed"] / dt
    out["output_throughput"] = out["total_output_tokens"] / dt
    out["total_token_throughput"] = (out["total_input_tokens"] + out["total_output_tokens"]) / dt
    for key in runs[0]:
        vals = [(r.get(key), r.get("completed") or 0) for r in runs if r.get(key) is not None]
        if key.startswith("mean_") and vals:
            w = sum(n for _, n in vals)
            out[key] = sum(v * n for v, n in vals) / w if w else None
        elif key.startswith("median_") and vals:
            out[key] = statistics.median(v for v, _ in vals)
        elif key.startswith("p99_") and vals:
            out[key] = max(v for v, _ in vals)
    if any(r.get("spec_decode") for r in runs):
        out["spec_decode"] = pool_spec_decode([r.get("spec_decode") or {} for r in runs])
    out["repeats"] = len(runs)
    out["output_throughput_per_repeat"] = [r.get("output_throughput") for r in runs]
    return out


def pool_spec_decode(parts: list[dict]) -> dict:
    """Acceptance counters summed over runs, the rates recomputed as
    :func:`speculum.bench.prom.spec_decode_delta` defines them."""
    def total(k):
        return sum(p.get(k) or 0 for p in parts)

    def elementwise(k):
        n = max((len(p.get(k) or []) for p in parts), default=0)
        return [sum((p.get(k) or [])[i] if i < len(p.get(k) or []) else 0 for p in parts) for i in range(n)]
    drafted, accepted, emitted, drafts = (total("num_draft_tokens"), total("num_accepted_tokens"),
                                          total("num_emitted_tokens"), total("num_drafts"))
    per_pos, reached = elementwise("accepted_per_position"), elementwise("drafts_per_position")
    return {"num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "num_emitted_tokens": emitted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "tokens_per_step": emitted / (emitted - accepted) if emitted > accepted else None,
            "acceptance_rate_per_position": [a / r for a, r in zip(per_pos, reached) if r],
            "accepted_per_position": per_pos, "drafts_per_position": reached,
            "requests": total("requests"), "steps_per_k": elementwise("steps_per_k"),
            "generation_tokens": total("generation_tokens")}
