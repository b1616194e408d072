"""``LLM.get_metrics()``: the engine's counters as vLLM's metric snapshot objects.

vLLM's ``LLM.get_metrics()`` returns ``Counter``, ``Gauge`` and ``Vector`` objects with a
``name``, ``labels`` and a value; code written against it reads ours the same way. Names
are the server's Prometheus names (``speculum:`` prefix; docs/serving.md).
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Metric:
    name: str
    labels: dict[str, str] = attrs.field(factory=dict)


@attrs.frozen
class Counter(Metric):
    value: int = 0


@attrs.frozen
class Gauge(Metric):
    value: float = 0.0


@attrs.frozen
class Vector(Metric):
    """A counter per position (``values[i]`` for position ``i``)."""

    values: list[int] = attrs.field(factory=list)


def engine_metrics(llm) -> list[Metric]:
    """Snapshot of an engine's totals (finished requests) and scheduler state."""
    m = llm.metrics
    labels = {"model_name": llm.model_path.name}
    p = "speculum:"
    out: list[Metric] = [
        Counter(p + "generation_tokens", labels, llm.num_generated_tokens),
        Counter(p + "num_preemptions", labels, llm.num_preemptions),
        Gauge(p + "num_requests_running", labels, llm.num_running),
        Gauge(p + "num_requests_waiting", labels, llm.num_waiting),
        Counter(p + "spec_decode_num_drafts", labels, m.num_drafts),
        Counter(p + "spec_decode_num_draft_tokens", labels, m.num_draft_tokens),
        Counter(p + "spec_decode_num_accepted_tokens", labels, m.num_accepted_tokens),
        Counter(p + "spec_decode_num_emitted_tokens", labels, m.num_emitted_tokens),
        Vector(p + "spec_decode_num_accepted_tokens_per_pos", labels, list(m.accepted_per_position)),
        Vector(p + "spec_decode_num_drafts_per_pos", labels, list(m.drafts_per_position)),
        # steps run at each speculation length k (values[k]): fixed, by batch size or "auto"
        Vector(p + "spec_decode_speculation_length_steps", labels, list(llm.loop.k_counts)),
    ]
    if m.draft_acceptance_rate is not None:  # absent, like the server's gauge, until something is drafted
        out.append(Gauge(p + "spec_decode_draft_acceptance_rate", labels, m.draft_acceptance_rate))
    return out
