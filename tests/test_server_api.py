"""The OpenAI-compatible server on a tiny random model: routes, streaming, errors, auth, aborts.

A real uvicorn server runs in a background thread on a free 127.0.0.1 port; the official
``openai`` client (unmodified) and httpx talk to it. Tiny models have no tokenizer, so
prompts are token ids and outputs are compared by token id (``return_token_ids``).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from speculum import LLM, SamplingParams
from speculum.errors import ConfigError
from speculum.server.app import create_app
from speculum.server.runner import ServerThread

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [100, 200, 300, 100, 200], [42] * 3, list(range(10, 40))]
GREEDY = dict(temperature=0.0, max_tokens=24)


def _llm(path, spec=NGRAM, **kw):
    return LLM(str(path), speculative_config=spec, dtype="float32", device="cpu", max_num_seqs=8, **kw)


def _wait_idle(llm, engine, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not engine.num_live_requests and not llm.has_unfinished_requests():
            return True
        time.sleep(0.01)
    return False


@pytest.fixture(scope="module")
def served(tiny_llama):
    """(server, llm, offline outputs): the offline outputs come from the same engine before serving."""
    llm = _llm(tiny_llama)
    offline = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(**GREEDY))
    app = create_app(llm, model_names=["tiny", "tiny-alias"], spec_metrics_level="summary", log_interval_s=0)
    with ServerThread(app) as server:
        server.llm, server.engine = llm, app.state.engine
        yield server, llm, [o.token_ids for o in offline]


@pytest.fixture()
def client(served):
    server = served[0]
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_completions_greedy_match_offline_engine(served, client):
    server, _llm_, offline = served
    for prompt, expected in zip(PROMPTS, offline):
        r = client.completions.create(model="tiny", prompt=prompt, extra_body={"return_token_ids": True}, **GREEDY)
        choice = r.choices[0]
        assert r.object == "text_completion" and r.model == "tiny" and r.id.startswith("cmpl-")
        assert choice.index == 0 and choice.finish_reason in ("stop", "length")
        assert choice.token_ids == expected
        assert r.usage.prompt_tokens == len(prompt)
        assert r.usage.completion_tokens == len(expected)
        assert r.usage.total_tokens == len(prompt) + len(expected)
        spec = r.metrics["speculative_decoding"]
        assert spec["num_emitted_tokens"] == len(expected) or choice.finish_reason == "stop"


def test_streamed_completion_equals_non_streamed(served, client):
    _server, _llm_, offline = served
    stream = client.completions.create(model="tiny-alias", prompt=PROMPTS[0], stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"return_token_ids": True}, **GREEDY)
    chunks = list(stream)
    tokens = [t for c in chunks for ch in c.choices for t in (ch.token_ids or [])]
    assert tokens == offline[0]
    finals = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert len(finals) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(offline[0])
    assert len({c.id for c in chunks}) == 1
    assert len([c for c in chunks if c.choices]) > 2, "tokens should arrive in several chunks"


def test_stream_is_server_sent_events_ending_with_done(served):
    server = served[0]
    body = {"model": "tiny", "prompt": PROMPTS[1], "stream": True, "max_tokens": 8, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    assert last["object"] == "text_completion" and last["choices"][0]["finish_reason"] in ("stop", "length")
    assert set(last["metrics"]["speculative_decoding"]) >= {"draft_acceptance_rate", "num_steps"}


def test_batched_prompts_give_one_choice_each(served):
    server, _llm_, offline = served
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"prompt": PROMPTS[:3], "return_token_ids": True, **GREEDY}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in r["choices"]] == offline[:3]
    assert r["usage"]["completion_tokens"] == sum(len(o) for o in offline[:3])


def test_streamed_batched_prompts_interleave_by_choice_index(served):
    server, _llm_, offline = served
    body = {"prompt": PROMPTS[:2], "stream": True, "return_token_ids": True, **GREEDY}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    got = {0: [], 1: []}
    finals = []
    for e in events:
        for ch in e["choices"]:
            got[ch["index"]] += ch.get("token_ids") or []
            if ch["finish_reason"]:
                finals.append(ch["index"])
    assert [got[0], got[1]] == offline[:2]
    assert sorted(finals) == [0, 1]


def test_seeded_sampling_is_reproducible(served, client):
    kw = dict(model="tiny", prompt=PROMPTS[3], max_tokens=16, temperature=1.0,
              extra_body={"return_token_ids": True, "top_k": 50, "ignore_eos": True})
    a = client.completions.create(seed=1234, **kw).choices[0].token_ids
    b = client.completions.create(seed=1234, **kw).choices[0].token_ids
    assert a == b and len(a) == 16


def test_models_health_and_metrics_routes(served):
    server = served[0]
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny", "tiny-alias"]
    assert models["object"] == "list" and models["data"][0]["object"] == "model"
    assert httpx.get(server.url + "/health").status_code == 200
    text = httpx.get(server.url + "/metrics").text
    for name in ("speculum:spec_decode_num_drafts_total", "speculum:spec_decode_num_draft_tokens_total",
                 "speculum:spec_decode_num_accepted_tokens_total", "speculum:spec_decode_num_emitted_tokens_total",
                 "speculum:spec_decode_num_accepted_tokens_per_pos_total", "speculum:spec_decode_draft_acceptance_rate",
                 "speculum:request_success_total", "speculum:prompt_tokens_total", "speculum:generation_tokens_total",
                 "speculum:time_to_first_token_seconds_bucket", "speculum:time_per_output_token_seconds_bucket",
                 "speculum:inter_token_latency_seconds_bucket", "speculum:e2e_request_latency_seconds_bucket",
                 "speculum:num_requests_running", "speculum:num_requests_waiting", "speculum:kv_cache_usage_perc"):
        assert name in text, name


BAD = [  # (body, status, words the message must contain, param)
    ("{", 400, ["not valid JSON"], None),
    ("[1, 2]", 400, ["JSON object"], None),
    ("", 400, ["empty"], None),
    ('{"prompt": [1, 2], "foo": 1}', 400, ["Unknown field", "foo"], "foo"),
    ('{"prompt": [1, 2], "max_tokens": -3}', 400, ["max_tokens", "greater than or equal to 1"], "max_tokens"),
    ('{"prompt": [1, 2], "max_tokens": 0}', 400, ["max_tokens"], "max_tokens"),
    ('{"prompt": [1, 2], "max_tokens": "5"}', 400, ["max_tokens", "integer"], "max_tokens"),
    ('{"prompt": [1, 2], "temperature": -1}', 400, ["temperature"], "temperature"),
    ('{"prompt": [1, 2], "top_p": 0}', 400, ["top_p"], "top_p"),
    ('{"prompt": [1, "a"]}', 400, ["prompt must be"], "prompt"),
    ('{"prompt": []}', 400, ["prompt"], "prompt"),
    ('{"max_tokens": 4}', 400, ["Missing", "prompt"], "prompt"),
    ('{"prompt": [1, 2], "n": 0}', 400, ["n", "greater than or equal to 1"], "n"),
    ('{"prompt": [1, 2], "model": "gpt-4"}', 404, ["gpt-4", "does not exist", "tiny"], "model"),
    ('{"prompt": [1, 99999]}', 400, ["outside the vocabulary"], None),
    ('{"prompt": "text"}', 400, ["no tokenizer", "token ids"], "prompt"),
    ('{"prompt": [1, 2], "stop": "x"}', 400, ["stop strings need a tokenizer"], None),
    (json.dumps({"prompt": [7] * 1100}), 400, ["maximum context length is 1024", "1100"], "prompt"),
    (json.dumps({"prompt": [7] * 1000, "max_tokens": 100}), 400, ["maximum context length", "max_tokens"], "max_tokens"),
]


ROUNDS = 6  # 6 x 19 kinds = 114 malformed requests, each followed by a good one


def test_bad_requests_get_clear_openai_errors_and_good_ones_still_succeed(served):
    server, _llm_, offline = served
    cases = BAD * ROUNDS

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            good = {"prompt": PROMPTS[0], "return_token_ids": True, **GREEDY}
            jobs = []
            for body, *_ in cases:  # interleave: bad, good, bad, good...
                jobs.append(c.post("/v1/completions", content=body, headers={"content-type": "application/json"}))
                jobs.append(c.post("/v1/completions", json=good))
            jobs.append(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}))
            jobs.append(c.post("/v1/chat/completions", json={"messages": []}))
            jobs.append(c.post("/v1/chat/completions", json={"messages": [{"role": "bot", "content": "x"}]}))
            return await asyncio.gather(*jobs)

    rs = asyncio.run(main())
    bad, good, chat = rs[0:2 * len(cases):2], rs[1:2 * len(cases):2], rs[2 * len(cases):]
    assert len(bad) == len(good) == len(cases) >= 100
    for (body, status, words, param), r in zip(cases, bad):
        assert r.status_code == status, (body[:60], r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        for w in words:
            assert w in err["message"], (body[:60], err["message"])
        assert err["param"] == param, (body[:60], err)
    for r in good:
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == offline[0]
    assert chat[0].status_code == 400 and "no tokenizer" in chat[0].json()["error"]["message"]
    assert chat[1].status_code == 400 and chat[1].json()["error"]["param"] == "messages"
    assert chat[2].status_code == 400 and "role" in chat[2].json()["error"]["param"]
    assert httpx.get(server.url + "/health").status_code == 200
    assert _wait_idle(server.llm, server.engine)


def test_unknown_route_and_method_are_openai_errors(served):
    server = served[0]
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "/v1/completions" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def _aborts(server) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("speculum:request_success_total") and 'finished_reason="abort"' in line:
            return float(line.split()[-1])
    return 0.0


@pytest.fixture()
def slow_steps(served, monkeypatch):
    """10 ms more per engine step, so a long request is surely still running when its client leaves."""
    llm = served[1]
    real_step = llm.step

    def slow_step():
        time.sleep(0.01)
        return real_step()

    monkeypatch.setattr(llm, "step", slow_step)


def test_streaming_client_that_disconnects_aborts_its_request(served, slow_steps):
    server, llm, _ = served
    before = _aborts(server)
    body = {"prompt": PROMPTS[0], "max_tokens": 900, "ignore_eos": True, "temperature": 0, "stream": True,
            "return_token_ids": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body) as r:
            for i, _line in enumerate(r.iter_lines()):
                if i >= 3:
                    break  # leave after a few chunks: closing the response closes the connection
    assert _wait_idle(llm, server.engine), "the aborted request is still in the engine"
    assert _aborts(server) == before + 1
    assert not llm.has_unfinished_requests()


def test_non_streaming_client_that_disconnects_aborts_its_request(served, slow_steps):
    server, llm, _ = served
    before = _aborts(server)
    body = {"prompt": PROMPTS[1], "max_tokens": 900, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    assert _wait_idle(llm, server.engine), "the aborted request is still in the engine"
    assert _aborts(server) == before + 1


def test_disconnects_under_concurrency_abort_only_their_own_requests(served, slow_steps):
    server, llm, offline = served
    before = _aborts(server)

    async def leaver(c: httpx.AsyncClient):
        body = {"prompt": PROMPTS[2], "max_tokens": 900, "ignore_eos": True, "temperature": 0, "stream": True,
                "return_token_ids": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            n = 0
            async for _line in r.aiter_lines():
                n += 1
                if n >= 4:
                    return "left"

    async def stayer(c: httpx.AsyncClient, i: int):
        r = await c.post("/v1/completions", json={"prompt": PROMPTS[i % 2], "return_token_ids": True, **GREEDY})
        return r.json()["choices"][0]["token_ids"] == offline[i % 2]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            return await asyncio.gather(*[leaver(c) for _ in range(5)], *[stayer(c, i) for i in range(5)])

    results = asyncio.run(main())
    assert results[:5] == ["left"] * 5 and all(results[5:])
    assert _wait_idle(llm, server.engine), "aborted requests are still in the engine"
    assert _aborts(server) == before + 5


def test_engine_step_failure_errors_its_requests_and_serving_continues(served, monkeypatch):
    server, llm, offline = served
    real_step = llm.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure")
        return real_step()

    monkeypatch.setattr(llm, "step", failing_step)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPTS[0], **GREEDY}, timeout=30)
    assert r.status_code == 500
    assert "injected failure" in r.json()["error"]["message"] and r.json()["error"]["type"] == "server_error"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPTS[0], "return_token_ids": True, **GREEDY},
                   timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == offline[0]
    assert httpx.get(server.url + "/health").status_code == 200


def test_per_request_metrics_summary_shape(served):
    server = served[0]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPTS[0], **GREEDY}, timeout=30).json()
    spec = r["metrics"]["speculative_decoding"]
    assert {"draft_acceptance_rate", "mean_acceptance_length", "acceptance_histogram", "num_draft_tokens",
            "num_accepted_tokens", "num_steps"} <= set(spec)
    assert "num_draft_tokens_per_step" not in spec
    assert sum(spec["acceptance_histogram"]) == spec["num_steps"]
    assert spec["num_draft_tokens"] > 0, "the repetitive prompt should be drafted by ngram"
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"])
    assert spec["tokens_per_step"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_steps"])


def test_per_request_metrics_detailed_has_per_step_lists(tiny_llama):
    llm = _llm(tiny_llama)
    app = create_app(llm, model_names=["tiny"], spec_metrics_level="detailed", log_interval_s=0)
    with ServerThread(app) as server:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPTS[0], **GREEDY}, timeout=30).json()
        body = {"prompt": PROMPTS[0], "stream": True, **GREEDY}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    spec = r["metrics"]["speculative_decoding"]
    drafted, accepted = spec["num_draft_tokens_per_step"], spec["num_accepted_tokens_per_step"]
    assert len(drafted) == len(accepted) == spec["num_steps"]
    assert sum(drafted) == spec["num_draft_tokens"] and sum(accepted) == spec["num_accepted_tokens"]
    assert all(0 <= a <= d for d, a in zip(drafted, accepted))
    assert [sum(1 for a in accepted if a == i) for i in range(len(spec["acceptance_histogram"]))] == \
        spec["acceptance_histogram"]
    streamed = [e["metrics"]["speculative_decoding"] for e in events if "metrics" in e]
    assert streamed == [spec], "the stream's final chunk carries the same figures"


def test_per_request_metrics_need_speculation(tiny_llama):
    llm = _llm(tiny_llama, spec=None)
    with pytest.raises(ConfigError, match="--speculative-config"):
        create_app(llm, model_names=["tiny"], spec_metrics_level="summary")


def test_serve_cli_refuses_per_request_metrics_without_speculation(capsys):
    from speculum.cli import main
    assert main(["serve", "--per-request-spec-decode-metrics", "detailed", "--port", "1"]) == 2
    assert "--speculative-config" in capsys.readouterr().err


def test_api_key_protects_every_route_but_health(tiny_llama):
    llm = _llm(tiny_llama, spec=None)
    app = create_app(llm, model_names=["tiny"], api_key="s3cret", log_interval_s=0)
    with ServerThread(app) as server:
        assert httpx.get(server.url + "/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            r = httpx.get(server.url + path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(server.url + path, headers={"Authorization": "Bearer nope"}).status_code == 401
            assert httpx.get(server.url + path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"]["message"]
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="tiny", prompt=[1, 2], max_tokens=2)
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="tiny", prompt=[1, 2], max_tokens=2).usage.completion_tokens >= 1
