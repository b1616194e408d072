"""``metrics.speculative_decoding`` of a response (``--per-request-spec-decode-metrics``).

``summary``: the request's acceptance figures. ``detailed``: the same plus ordered
per-verify-step arrays. ``none``: nothing is added (and no step records are kept).
"""

from __future__ import annotations

from speculum.metrics import SpecDecodeMetrics

LEVELS = ("none", "summary", "detailed")


def speculative_decoding_report(m: SpecDecodeMetrics | None, steps: list[tuple[int, int]] | None,
                                level: str) -> dict | None:
    """The ``speculative_decoding`` object for one request, or None when ``level`` is none."""
    if level == "none":
        return None
    m = m or SpecDecodeMetrics()
    out = {
        "draft_acceptance_rate": m.draft_acceptance_rate,
        "mean_acceptance_length": m.mean_acceptance_length,
        "tokens_per_step": m.tokens_per_step,
        "acceptance_rate_per_position": m.acceptance_rate_per_position(),
        "acceptance_histogram": list(m.acceptance_histogram),
        "num_draft_tokens": m.num_draft_tokens,
        "num_accepted_tokens": m.num_accepted_tokens,
        "num_steps": m.num_steps,
        "num_drafts": m.num_drafts,
        "num_emitted_tokens": m.num_emitted_tokens,
        "accepted_per_position": list(m.accepted_per_position),
        "drafts_per_position": list(m.drafts_per_position),
    }
    if level == "detailed":
        steps = steps or []
        out["num_draft_tokens_per_step"] = [d for d, _ in steps]
        out["num_accepted_tokens_per_step"] = [a for _, a in steps]
    return out
