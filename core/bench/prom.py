"""Reading speculation counters from a server's Prometheus ``/metrics`` (speculum's or vLLM's)."""

from __future__ import annotations

import re

import httpx

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_POS = re.compile(r'position="(\d+)"')
PREFIXES = ("speculum:", "vllm:")
COUNTERS = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
            "spec_decode_num_accepted_tokens_total", "spec_decode_num_emitted_tokens_total",
            "request_success_total", "prompt_tokens_total", "generation_tokens_total")
PER_POS = "spec_decode_num_accepted_tokens_per_pos_total"


def parse_metrics(text: str) -> dict:
    """Counter totals (summed over labels, prefix removed) and accepted tokens per position."""
    out: dict = {name: 0.0 for name in COUNTERS}
    per_pos: dict[int, float] = {}
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
        elif name == PER_POS:
            pm = _POS.search(labels)
            if pm:
                per_pos[int(pm.group(1))] = per_pos.get(int(pm.group(1)), 0.0) + v
    out["accepted_per_pos"] = [per_pos[i] for i in sorted(per_pos)]
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

    ``mean_acceptance_length`` = emitted / verify steps, the steps being emitted - accepted
    (every step emits its accepted drafts plus one token); without the emitted counter,
    1 + accepted / drafts.
    """
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in COUNTERS}
    drafted = d["spec_decode_num_draft_tokens_total"]
    accepted = d["spec_decode_num_accepted_tokens_total"]
    emitted = d["spec_decode_num_emitted_tokens_total"]
    steps = emitted - accepted
    drafts = d["spec_decode_num_drafts_total"]
    if steps > 0:
        mal = emitted / steps
    elif drafts:  # a server without the emitted counter: per drafting step, as vLLM reports it
        mal = 1 + accepted / drafts
    else:
        mal = None
    pos_b, pos_a = before["accepted_per_pos"], after["accepted_per_pos"]
    per_pos = [a - (pos_b[i] if i < len(pos_b) else 0.0) for i, a in enumerate(pos_a)]
    return {
        "num_drafts": int(d["spec_decode_num_drafts_total"]),
        "num_draft_tokens": int(drafted),
        "num_accepted_tokens": int(accepted),
        "num_emitted_tokens": int(emitted),
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": mal,
        "accepted_per_position": [int(x) for x in per_pos],
        "requests": int(d["request_success_total"]),
        "generation_tokens": int(d["generation_tokens_total"]),
    }
