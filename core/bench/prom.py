"""Reading speculation counters from a server's Prometheus ``/metrics`` (speculum's or vLLM's)."""

from __future__ import annotations

import re

import httpx

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_POS = re.compile(r'position="(\d+)"')
_K = re.compile(r'k="(\d+)"')
PREFIXES = ("speculum:", "vllm:")
COUNTERS = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
            "spec_decode_num_accepted_tokens_total", "spec_decode_num_emitted_tokens_total",
            "request_success_total", "prompt_tokens_total", "generation_tokens_total")
PER_POS = {"spec_decode_num_accepted_tokens_per_pos_total": "accepted_per_pos",
           "spec_decode_num_drafts_per_pos_total": "drafts_per_pos"}
#: steps per speculation length k (speculum's own counter; label k)
PER_K = "spec_decode_speculation_length_steps_total"


def parse_metrics(text: str) -> dict:
    """Counter totals (summed over labels, prefix removed), and per position the accepted
    tokens and the drafts that reached it (the latter is speculum's own counter)."""
    out: dict = {name: 0.0 for name in COUNTERS}
    per_pos: dict[str, dict[int, float]] = {key: {} for key in PER_POS.values()}
    per_k: dict[int, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _LINE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        for prefix in PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        else:
            continue
        try:
            v = float(value)
        except ValueError:
            continue
        if name in out:
            out[name] += v
        elif name == PER_K:
            km = _K.search(labels)
            if km:
                per_k[int(km.group(1))] = per_k.get(int(km.group(1)), 0.0) + v
        elif name in PER_POS:
            pm = _POS.search(labels)
            if pm:
                d = per_pos[PER_POS[name]]
                d[int(pm.group(1))] = d.get(int(pm.group(1)), 0.0) + v
    for key, d in per_pos.items():
        out[key] = [d[i] for i in sorted(d)]
    out["steps_per_k"] = [per_k.get(k, 0.0) for k in range(max(per_k) + 1)] if per_k else []
    return out


async def scrape(client: httpx.AsyncClient, base_url: str, headers: dict | None = None) -> dict | None:
    """The parsed /metrics of ``base_url``, or None if it has none."""
    try:
        r = await client.get(base_url.rstrip("/") + "/metrics", headers=headers)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    return parse_metrics(r.text)


def spec_decode_delta(before: dict | None, after: dict | None) -> dict | None:
    """Acceptance over a run: the counters' differences between two scrapes.

    Defined as in :mod:`speculum.metrics`: ``mean_acceptance_length`` = 1 + accepted /
    drafts (vLLM's); ``tokens_per_step`` = emitted / verify steps, the steps being emitted -
    accepted (every step emits its accepted drafts plus one token; None for a server
    without the emitted counter); per position, accepted / drafts that reached it (vLLM's
    servers have no such counter: accepted / drafts).
    """
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in COUNTERS}
    drafted = d["spec_decode_num_draft_tokens_total"]
    accepted = d["spec_decode_num_accepted_tokens_total"]
    emitted = d["spec_decode_num_emitted_tokens_total"]
    steps = emitted - accepted
    drafts = d["spec_decode_num_drafts_total"]

    def delta(key):
        b, a = before[key], after[key]
        return [x - (b[i] if i < len(b) else 0.0) for i, x in enumerate(a)]
    per_pos, reached = delta("accepted_per_pos"), delta("drafts_per_pos")
    per_k = delta("steps_per_k") if "steps_per_k" in after else []
    if not reached and drafts:  # vLLM: every draft reaches every position
        reached = [drafts] * len(per_pos)
    return {
        "num_drafts": int(d["spec_decode_num_drafts_total"]),
        "num_draft_tokens": int(drafted),
        "num_accepted_tokens": int(accepted),
        "num_emitted_tokens": int(emitted),
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "tokens_per_step": emitted / steps if steps > 0 else None,
        "acceptance_rate_per_position": [a / r for a, r in zip(per_pos, reached) if r],
        "accepted_per_position": [int(x) for x in per_pos],
        "drafts_per_position": [int(x) for x in reached],
        "requests": int(d["request_success_total"]),
        # engine steps per speculation length k during the run (k chosen per step)
        "steps_per_k": [int(x) for x in per_k],
        "generation_tokens": int(d["generation_tokens_total"]),
    }
