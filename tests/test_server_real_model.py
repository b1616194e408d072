"""The server on the real default model (SmolLM2-135M-Instruct): text, chat and their streams.

Greedy answers through the official ``openai`` client must equal ``LLM.generate`` /
``LLM.chat`` on the same engine, and streamed text must add up to the same text (stop
strings and partial UTF-8 held back, never sent).
"""

from __future__ import annotations

import openai
import pytest

from speculum import LLM, SamplingParams
from speculum.server.app import create_app, server_tokenizer
from speculum.server.detokenize import IncrementalDetokenizer
from speculum.server.runner import ServerThread

pytestmark = pytest.mark.real_model

MAX_TOKENS = 12
TEXT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]
STOP_PROMPT = "List the days of the week: Monday, Tuesday,"


@pytest.fixture(scope="module")
def served():
    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 3}, dtype="float32", device="cpu",
              max_num_seqs=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    offline = {
        "text": llm.generate(TEXT, greedy)[0],
        "chat": llm.chat(CHAT, greedy)[0],
        "stop": llm.generate(STOP_PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[" Thursday"]))[0],
    }
    app = create_app(llm, model_names=["SmolLM2-135M-Instruct"], spec_metrics_level="summary", log_interval_s=0)
    with ServerThread(app) as server:
        yield server, llm, offline


@pytest.fixture()
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_text_completion_matches_offline(served, client):
    offline = served[2]["text"]
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=TEXT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == offline.text
    assert "Paris" in r.choices[0].text
    assert r.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert r.usage.completion_tokens == len(offline.token_ids)


def test_chat_and_streamed_chat_match_offline(served, client):
    offline = served[2]["chat"]
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=MAX_TOKENS,
                                       temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == offline.text
    assert r.metrics["speculative_decoding"]["num_steps"] >= 1
    chunks = list(client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT,
                                                 max_tokens=MAX_TOKENS, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == offline.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [offline.finish_reason]


def test_streamed_text_holds_back_stop_strings(served, client):
    offline = served[2]["stop"]
    assert offline.finish_reason == "stop", "the prompt should reach the stop string within the budget"
    kw = dict(model="SmolLM2-135M-Instruct", prompt=STOP_PROMPT, max_tokens=MAX_TOKENS, temperature=0,
              stop=[" Thursday"])
    assert client.completions.create(**kw).choices[0].text == offline.text
    deltas = [c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(deltas) == offline.text
    assert not any("Thursday" in d for d in deltas)


def test_incremental_detokenizer_never_sends_partial_utf8(served):
    tok = server_tokenizer(served[1])
    text = "Café ☕ and 😀 emoji, naïve façade — done."
    ids = tok.hf.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok.decode)
    deltas = [detok.add([t]) for t in ids]
    deltas.append(detok.finish(None))
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
