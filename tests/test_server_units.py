"""Pieces of the server and of bench serve that need no model: streaming text, errors,
metrics bookkeeping, Prometheus parsing, statistics and the comparison table."""

from __future__ import annotations

import json

import pytest

from speculum.bench.prom import parse_metrics, spec_decode_delta
from speculum.bench.report import compare_rows, compare_table, sweep_table
from speculum.bench.runner import percentile, summarize
from speculum.bench.client import RequestResult
from speculum.metrics import SpecDecodeMetrics
from speculum.server.detokenize import IncrementalDetokenizer, settled_text, stop_holdback
from speculum.server.errors import validation_error
from speculum.server.metrics import ServerMetrics, StatsLogger
from speculum.server.protocol import ChatCompletionRequest, CompletionRequest
from speculum.server.spec_report import speculative_decoding_report


def _decode_bytes(pieces):
    """A toy byte-level tokenizer: token i is the byte string pieces[i]."""
    return lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")


def test_stop_holdback_is_the_longest_tail_that_starts_a_stop_string():
    assert stop_holdback("hello wor", ["world"]) == 3
    assert stop_holdback("hello w", ["world", "xx"]) == 1
    assert stop_holdback("hello", ["world"]) == 0
    assert stop_holdback("ab", ["abc", "b"]) == 2
    assert settled_text("abc\ufffd") == "abc"
    assert settled_text("say STO", ["STOP"]) == "say "


def test_incremental_detokenizer_holds_partial_utf8_and_stop_prefixes():
    euro = "€".encode()  # three bytes, split over three tokens
    pieces = [b"Price: 5", euro[:1], euro[1:2], euro[2:], b" EN", b"D"]
    d = IncrementalDetokenizer(_decode_bytes(pieces), stop=["END"])
    deltas = [d.add([0]), d.add([1]), d.add([2]), d.add([3]), d.add([4])]
    assert deltas == ["Price: 5", "", "", "€", " "]  # "EN" could start "END": held back
    assert d.finish("Price: 5€ ") == ""  # the engine cut the stop string: "EN" is never sent
    assert "".join(deltas) == "Price: 5€ "


def test_incremental_detokenizer_releases_held_text_when_it_is_not_a_stop():
    d = IncrementalDetokenizer(_decode_bytes([b"a", b" E", b"x"]), stop=["END"])
    assert d.add([0, 1]) == "a "
    assert d.add([2]) == "Ex"
    assert d.finish(None) == ""


def test_validation_errors_name_the_field_and_the_fix():
    from pydantic import ValidationError
    fields = list(CompletionRequest.model_fields)
    for body, param, words in [
        ({"prompt": [1], "bogus": 2}, "bogus", ["Unknown field 'bogus'", "Accepted fields", "max_tokens"]),
        ({"prompt": [1], "max_tokens": -1}, "max_tokens", ["greater than or equal to 1", "got -1"]),
        ({"prompt": [1], "echo": True}, "echo", ["echo is not supported"]),
        ({"prompt": {"a": 1}}, "prompt", ["prompt must be a string"]),
        ({}, "prompt", ["Missing required field 'prompt'"]),
    ]:
        with pytest.raises(ValidationError) as info:
            CompletionRequest.model_validate(body)
        err = validation_error(info.value.errors(), fields)
        assert err.status_code == 400 and err.param == param
        for w in words:
            assert w in err.message, err.message
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": 5}]})
    err = validation_error(info.value.errors())
    assert err.param == "messages.0.content" and "content must be a string" in err.message


def test_chat_request_reads_text_parts_and_max_completion_tokens():
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief"}]}],
        "max_tokens": 5, "max_completion_tokens": 9})
    assert req.messages[0].as_template_message() == {"role": "system", "content": "Be brief"}
    assert req.requested_max_tokens == 9
    assert req.sampling_params(9).max_tokens == 9


def test_completion_request_prompt_forms():
    def prompts(p):
        return CompletionRequest.model_validate({"prompt": p}).prompts()
    assert prompts("hi") == ["hi"]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([1, 2, 3]) == [[1, 2, 3]]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]


def _spec(steps):
    m = SpecDecodeMetrics()
    for d, a in steps:
        m.record_step(d, a)
    return m


def test_server_metrics_counters_are_sums_of_finished_requests():
    sm = ServerMetrics("m", num_speculative_tokens=3)
    reqs = [_spec([(3, 2), (3, 0), (0, 0)]), _spec([(3, 3), (2, 1)])]
    for i, m in enumerate(reqs):
        sm.record_finished(finish_reason="length" if i else "stop", num_prompt_tokens=5, num_output_tokens=m.num_emitted_tokens,
                           spec=m, arrival=0.0, first_token=0.1, finish=0.5)
    parsed = parse_metrics(sm.render().decode())
    assert parsed["spec_decode_num_draft_tokens_total"] == 11
    assert parsed["spec_decode_num_accepted_tokens_total"] == 6
    assert parsed["spec_decode_num_drafts_total"] == 4
    assert parsed["spec_decode_num_emitted_tokens_total"] == sum(m.num_emitted_tokens for m in reqs)
    assert parsed["accepted_per_pos"] == [3, 2, 1]
    assert parsed["request_success_total"] == 2 and parsed["prompt_tokens_total"] == 10
    text = sm.render().decode()
    assert 'speculum:spec_decode_draft_acceptance_rate{model_name="m"} ' + str(6 / 11) in text


def test_stats_logger_line_reports_acceptance_and_throughput():
    sm = ServerMetrics("m", 2)
    logger = StatsLogger(sm, interval_s=10)
    assert logger.line() is None  # idle: no line
    sm.count_step_tokens(40)
    sm.record_finished(finish_reason="stop", num_prompt_tokens=3, num_output_tokens=40, spec=_spec([(2, 2), (2, 0)]),
                       arrival=0, first_token=0.1, finish=1)
    sm.set_scheduler_state(1, 2, 0.25)
    line = logger.line()
    for part in ("generation throughput", "running: 1", "waiting: 2", "KV cache usage: 25.0%",
                 "draft acceptance rate: 0.500", "mean acceptance length: 2.00"):
        assert part in line, line


def test_per_request_report_levels():
    m = _spec([(4, 1), (0, 0), (4, 4)])
    assert speculative_decoding_report(m, None, "none") is None
    s = speculative_decoding_report(m, [(4, 1), (0, 0), (4, 4)], "summary")
    assert s["num_steps"] == 3 and s["acceptance_histogram"] == [1, 1, 0, 0, 1] and "num_draft_tokens_per_step" not in s
    d = speculative_decoding_report(m, [(4, 1), (0, 0), (4, 4)], "detailed")
    assert d["num_draft_tokens_per_step"] == [4, 0, 4] and d["num_accepted_tokens_per_step"] == [1, 0, 4]
    assert json.dumps(d)  # JSON-serialisable


def test_prometheus_parser_reads_vllm_names_too():
    text = "\n".join([
        "# HELP vllm:spec_decode_num_draft_tokens_total x",
        'vllm:spec_decode_num_draft_tokens_total{model_name="a"} 10.0',
        'vllm:spec_decode_num_accepted_tokens_total{model_name="a"} 7.0',
        'vllm:spec_decode_num_drafts_total{model_name="a"} 4.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="a",position="1"} 3.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="a",position="0"} 4.0',
        'other_metric 5'])
    after = parse_metrics(text)
    before = parse_metrics("")
    d = spec_decode_delta(before, after)
    assert d["acceptance_rate"] == 0.7
    assert d["mean_acceptance_length"] == 1 + 7 / 4  # no emitted counter: per drafting step
    assert d["accepted_per_position"] == [4, 3]


def test_percentile_and_summary():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert percentile(list(range(101)), 99) == pytest.approx(99)
    rs = [RequestResult(ok=True, ttft=0.1, itl=[0.01, 0.03], latency=0.2, prompt_tokens=3, output_tokens=5),
          RequestResult(ok=False, error="HTTP 500")]
    s = summarize(rs, duration=2.0)
    assert s["completed"] == 1 and s["failed"] == 1 and s["errors"] == ["HTTP 500"]
    assert s["mean_tpot_ms"] == pytest.approx(25.0) and s["mean_itl_ms"] == pytest.approx(20.0)
    assert s["output_throughput"] == 2.5


def _run(rate, tpot, ttft, thr, acc=None):
    return {"request_rate": rate, "completed": 8, "failed": 0, "request_throughput": 1.0, "output_throughput": thr,
            "mean_ttft_ms": ttft, "p99_ttft_ms": ttft, "mean_tpot_ms": tpot, "p99_tpot_ms": tpot, "mean_itl_ms": tpot,
            "mean_e2el_ms": 100.0,
            "spec_decode": {"acceptance_rate": acc, "mean_acceptance_length": 2.5} if acc else None}


def test_compare_table_states_speedups_like_the_seed_table():
    base = [_run(1.0, 40.0, 500.0, 25.0), _run("inf", 15.0, 800.0, 800.0)]
    spec = [_run(1.0, 18.0, 600.0, 55.0, 0.78), _run("inf", 17.0, 900.0, 780.0, 0.78)]
    rows = {r["metric"].split(" (")[0] + (" hi" if "high" in r["metric"] else ""): r for r in compare_rows(base, spec)}
    assert rows["TPOT"]["ratio"] == pytest.approx(40 / 18) and rows["TPOT"]["verdict"].startswith("better")
    assert rows["TPOT hi"]["verdict"].startswith("worse")
    assert rows["Throughput"]["ratio"] == pytest.approx(2.2)
    assert rows["Acceptance rate"]["speculative"] == 0.78 and "good" in rows["Acceptance rate"]["verdict"]
    table = compare_table(compare_rows(base, spec))
    assert "2.22x" in table and "With speculation" in table
    assert "inf" in sweep_table(base)
