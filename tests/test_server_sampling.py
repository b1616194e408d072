"""Sampling features through the OpenAI API with speculation on (tiny model, token ids).

Each field reaches the engine (answers equal the offline engine's for the same
parameters), logprobs come back in OpenAI's shapes (completions and chat, streamed and
not), n / best_of give n choices, per-request ``speculative`` / ``num_speculative_tokens``
work, and what cannot be served is a 400 that says why.
"""

from __future__ import annotations

import json

import httpx
import pytest

from speculum import LLM, SamplingParams
from speculum.server.app import create_app
from speculum.server.runner import ServerThread

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
PROMPT = [17, 4, 30, 9, 17, 4, 30, 9, 17, 4]


@pytest.fixture(scope="module")
def served(tiny_llama):
    llm = LLM(str(tiny_llama), speculative_config=SPEC, dtype="float32", device="cpu", max_num_seqs=8)
    base = LLM(str(tiny_llama), dtype="float32", device="cpu", max_num_seqs=8)
    app = create_app(llm, model_names=["tiny"], spec_metrics_level="summary", log_interval_s=0)
    with ServerThread(app) as server:
        yield server, base


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_every_sampling_field_reaches_the_engine(served):
    server, base = served
    fields = dict(temperature=0, max_tokens=16, presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.3,
                  logit_bias={"184": -100, "466": 3.0}, min_tokens=4, stop_token_ids=[372])
    r = post(server, "/v1/completions", {"prompt": PROMPT, "return_token_ids": True, **fields})
    assert r.status_code == 200, r.text
    want = base.generate({"prompt_token_ids": PROMPT},
                         SamplingParams(**{**fields, "logit_bias": {184: -100, 466: 3.0}}))[0]
    assert r.json()["choices"][0]["token_ids"] == want.token_ids


def test_completion_logprobs_match_the_engine(served):
    server, base = served
    r = post(server, "/v1/completions", {"prompt": PROMPT, "temperature": 0, "max_tokens": 8, "logprobs": 3,
                                         "prompt_logprobs": 1, "return_token_ids": True}).json()
    choice = r["choices"][0]
    lp = choice["logprobs"]
    want = base.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=8, logprobs=3))[0]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 8
    for got, d, tok in zip(lp["token_logprobs"], want.outputs[0].logprobs, want.token_ids):
        assert abs(got - d[tok].logprob) < 1e-5
    assert all(len(t) == 3 for t in lp["top_logprobs"])
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(PROMPT)


def test_chat_logprobs_shape(tiny_llama):
    """Chat needs a tokenizer; the shape is checked on the function the route uses."""
    from speculum.logprobs import Logprob
    from speculum.server.protocol import chat_logprobs
    entries = [{5: Logprob(-0.1, 1), 7: Logprob(-2.5, 2)}, {9: Logprob(-3.0, 4), 2: Logprob(-0.5, 1)}]
    out = chat_logprobs(entries, lambda ids: f"<{ids[0]}>", top_n=2)
    assert out["content"][0]["token"] == "<5>" and out["content"][0]["logprob"] == -0.1
    assert [t["token"] for t in out["content"][0]["top_logprobs"]] == ["<5>", "<7>"]
    assert [t["token"] for t in out["content"][1]["top_logprobs"]] == ["<2>"]  # rank 4 is not in the top 2
    assert out["content"][1]["bytes"] == list(b"<9>")


def test_streamed_logprobs_cover_every_token(served):
    server, _base = served
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 12, "logprobs": 2, "stream": True,
            "return_token_ids": True}
    toks, lps = [], []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"]
                for ch in c:
                    toks += ch.get("token_ids") or []
                    if ch["logprobs"]:
                        lps += ch["logprobs"]["token_logprobs"]
    assert len(toks) == len(lps) == 12


def test_n_and_best_of_give_n_choices(served):
    server, _base = served
    r = post(server, "/v1/completions", {"prompt": [PROMPT, PROMPT[:6]], "temperature": 1.0, "max_tokens": 6, "n": 3,
                                         "seed": 5, "return_token_ids": True}).json()
    assert [c["index"] for c in r["choices"]] == list(range(6))
    assert len({tuple(c["token_ids"]) for c in r["choices"][:3]}) > 1
    assert r["usage"]["prompt_tokens"] == len(PROMPT) + 6  # each prompt once
    again = post(server, "/v1/completions", {"prompt": [PROMPT, PROMPT[:6]], "temperature": 1.0, "max_tokens": 6,
                                             "n": 3, "seed": 5, "return_token_ids": True}).json()
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in r["choices"]]
    b = post(server, "/v1/completions", {"prompt": PROMPT, "temperature": 1.0, "max_tokens": 6, "n": 2, "best_of": 4,
                                         "seed": 5, "return_token_ids": True})
    assert b.status_code == 200 and len(b.json()["choices"]) == 2


def test_per_request_speculation_control(served):
    server, _base = served
    off = post(server, "/v1/completions", {"prompt": PROMPT, "temperature": 0, "max_tokens": 16,
                                           "speculative": False}).json()
    on = post(server, "/v1/completions", {"prompt": PROMPT, "temperature": 0, "max_tokens": 16,
                                          "num_speculative_tokens": 2}).json()
    assert off["choices"][0]["text"] == on["choices"][0]["text"]
    assert off["metrics"]["speculative_decoding"]["num_draft_tokens"] == 0


@pytest.mark.parametrize("body, words", [
    ({"num_speculative_tokens": 9}, ["higher than the engine's 3"]),
    ({"logprobs": 50}, ["at most 20"]),
    ({"logit_bias": {"99999": 1.0}}, ["outside the vocabulary"]),
    ({"n": 2, "best_of": 3, "stream": True}, ["cannot stream"]),
    ({"best_of": 1, "n": 2}, ["best_of"]),
    ({"presence_penalty": 3}, ["presence_penalty"]),
    ({"bad_words": ["x"]}, ["bad_words need a tokenizer"]),
    ({"echo": True}, ["echo is not supported"]),
])
def test_what_cannot_be_served_is_a_clear_400(served, body, words):
    server, _base = served
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert all(w in msg for w in words), msg
