"""Stop conditions: max_tokens, max_model_len, stop_token_ids, EOS and stop strings.

Each case runs on the plain engine and on a speculative one (the target drafting for
itself with k=4, so every draft is accepted and each step emits 5 tokens). Stops are
placed so that they fall *inside* an accepted run: the speculative step emits tokens past
the stop, which must be cut. Expected outputs are derived from one greedy reference run,
so both engines must agree exactly on token ids, text, finish_reason and stop_reason.

The tiny models have no tokenizer; stop strings use a fake one whose text is the token
ids joined by spaces ("12 7 301").
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from speculum import LLM, SamplingParams
from speculum.errors import RequestError
from speculum.testing import make_llm
from speculum.tokenizer import Tokenizer

K = 4
PROMPTS = [
    {"prompt_token_ids": [5]},
    {"prompt_token_ids": [30, 31, 32, 30, 31, 32, 30]},
    {"prompt_token_ids": [10, 11, 12, 13, 14, 200, 201, 202, 203, 204] * 2},
]
N = 40
ENGINES = ["baseline", "speculative"]


class FakeHFTokenizer:
    """The least a transformers tokenizer must offer the engine: ids <-> "1 2 3" text."""

    eos_token_id = None
    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)

    def encode(self, text, add_special_tokens=True):
        return [int(t) for t in text.split()]


@contextlib.contextmanager
def tokenizer(llm: LLM, tok: Tokenizer):
    """Give an engine another tokenizer (the engine and its loop both hold one)."""
    saved = llm.tokenizer, llm.loop.tokenizer
    llm.tokenizer = llm.loop.tokenizer = tok
    try:
        yield llm
    finally:
        llm.tokenizer, llm.loop.tokenizer = saved


def fake_tokenizer(eos=()) -> Tokenizer:
    return Tokenizer(FakeHFTokenizer(), list(eos))


def decode(ids) -> str:
    return FakeHFTokenizer().decode(ids)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engines(tiny_llama) -> dict[str, LLM]:
    kw = dict(max_num_seqs=len(PROMPTS))
    return {
        "baseline": make_llm(tiny_llama, **kw),
        "speculative": make_llm(tiny_llama, {"method": "draft_model", "model": str(tiny_llama),
                                              "num_speculative_tokens": K}, **kw),
    }


@pytest.fixture(scope="module")
def reference(engines) -> list[list[int]]:
    """Greedy outputs with no stop but max_tokens (nor EOS)."""
    outs = engines["baseline"].generate(PROMPTS, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))
    return [o.token_ids for o in outs]


def inside_run(j: int) -> bool:
    """Self-drafted steps emit positions 5m..5m+4; a stop at j cuts its run unless j = 5m+4."""
    return j % (K + 1) != K


def first_new_token(ref: list[int], start: int, stop_offset: int = 0) -> int:
    """The first position j >= start whose token is new in the output, such that a stop
    at j + stop_offset does not end a speculative run."""
    for j in range(start, len(ref) - stop_offset):
        if ref[j] not in ref[:j] and inside_run(j + stop_offset):
            return j
    raise AssertionError(f"no usable stop position in {ref}")


def greedy(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", N)
    return SamplingParams(temperature=0, **kw)


def assert_cut_inside_run(engine: str, out) -> None:
    """For the speculative engine: the stop really cut an accepted run short."""
    if engine == "speculative":
        m = out.metrics
        assert m.num_accepted_tokens > 0
        assert m.num_emitted_tokens > len(out.token_ids), "the stop did not fall inside a speculative run"


# --------------------------------------------------------------------------- length
@pytest.mark.parametrize("engine", ENGINES)
def test_max_tokens(engines, reference, engine):
    sizes = [1, 7, 23]
    outs = engines[engine].generate(PROMPTS, [greedy(max_tokens=n, ignore_eos=True) for n in sizes])
    for o, n, ref in zip(outs, sizes, reference):
        assert o.token_ids == ref[:n]
        assert (o.finish_reason, o.outputs[0].stop_reason) == ("length", None)
        assert o.metrics.num_emitted_tokens == n  # drafts never run past max_tokens
    if engine == "speculative":
        assert outs[0].metrics.num_draft_tokens == 0  # max_tokens=1 leaves no room to draft


@pytest.mark.parametrize("runner", ["native", "hf"])
@pytest.mark.parametrize("engine", ENGINES)
def test_max_model_len(tiny_llama, reference, engine, runner):
    spec = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": K} if engine == "speculative" else None
    llm = make_llm(tiny_llama, spec, max_model_len=27, runner=runner)
    prompt = PROMPTS[2]  # 20 tokens: 7 fit
    out = llm.generate(prompt, greedy(ignore_eos=True))[0]
    assert out.token_ids == reference[2][:7]
    assert out.finish_reason == "length"
    with pytest.raises(RequestError, match="context holds 27"):
        llm.generate({"prompt_token_ids": [3] * 27}, greedy())


# ---------------------------------------------------------------------- stop tokens
@pytest.mark.parametrize("engine", ENGINES)
def test_stop_token_ids(engines, reference, engine):
    stops = [first_new_token(ref, 6) for ref in reference]
    params = [greedy(stop_token_ids=[ref[j]], ignore_eos=True) for ref, j in zip(reference, stops)]
    outs = engines[engine].generate(PROMPTS, params)
    for o, ref, j in zip(outs, reference, stops):
        assert o.token_ids == ref[: j + 1]  # the stop token is kept, nothing after it
        assert (o.finish_reason, o.outputs[0].stop_reason) == ("stop", ref[j])
        assert_cut_inside_run(engine, o)


@pytest.mark.parametrize("engine", ENGINES)
def test_first_of_several_stop_token_ids_wins(engines, reference, engine):
    ref = reference[1]
    a = first_new_token(ref, 3)
    b = first_new_token(ref, a + 1)
    out = engines[engine].generate(PROMPTS[1], greedy(stop_token_ids=[ref[b], ref[a]], ignore_eos=True))[0]
    assert out.token_ids == ref[: a + 1]
    assert out.outputs[0].stop_reason == ref[a]


# ------------------------------------------------------------------------------ EOS
def test_model_eos_is_known(engines):
    for llm in engines.values():
        assert 2 in llm.tokenizer.eos_token_ids  # eos_token_id of the tiny config


@pytest.mark.parametrize("engine", ENGINES)
def test_eos(engines, reference, engine):
    """Make a token the baseline emits the EOS: generation stops right after it."""
    llm = engines[engine]
    for ref, prompt in zip(reference, PROMPTS):
        j = first_new_token(ref, 8)
        with tokenizer(llm, Tokenizer(None, [ref[j]])):
            out = llm.generate(prompt, greedy())[0]
            assert out.token_ids == ref[: j + 1]
            assert (out.finish_reason, out.outputs[0].stop_reason) == ("stop", None)
            assert_cut_inside_run(engine, out)
            ignored = llm.generate(prompt, greedy(ignore_eos=True))[0]
            assert ignored.token_ids == ref and ignored.finish_reason == "length"


# --------------------------------------------------------------------- stop strings
def expected_stop(ref: list[int], stops: list[str]) -> tuple[list[int], str, str] | None:
    """Reference semantics: stop at the first token whose text completes a stop string;
    keep that token, cut the text before the earliest stop string."""
    for n in range(1, len(ref) + 1):
        text = decode(ref[:n])
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            i, s = min(hits)
            return ref[:n], text[:i], s
    return None


def stop_string_cases(ref: list[int]) -> list[list[str]]:
    j = first_new_token(ref, 5)
    a, b = str(ref[j]), str(ref[j + 1])
    j2 = first_new_token(ref, j + 3)
    return [
        [f" {a} {b}"],               # two whole tokens
        [f"{a} {b[0]}"],             # completed in the middle of a token's text
        ["no such text", f" {ref[j2]} ", f" {a} "],  # the earliest of several wins
    ]


@pytest.mark.parametrize("engine", ENGINES)
def test_stop_strings(engines, reference, engine):
    llm = engines[engine]
    with tokenizer(llm, fake_tokenizer()):
        for ref, prompt in zip(reference, PROMPTS):
            for stops in stop_string_cases(ref):
                toks, text, which = expected_stop(ref, stops)
                out = llm.generate(prompt, greedy(stop=stops, ignore_eos=True))[0]
                assert out.token_ids == toks, stops
                assert out.text == text and which not in out.text
                assert (out.finish_reason, out.outputs[0].stop_reason) == ("stop", which)
            # a stop string that never appears: the full output and its text
            out = llm.generate(prompt, greedy(stop=["x"], ignore_eos=True))[0]
            assert out.token_ids == ref and out.text == decode(ref) and out.finish_reason == "length"


def test_stop_string_inside_speculative_run(engines, reference):
    ref = reference[2]
    j = first_new_token(ref, 10, stop_offset=1)
    stop = f" {ref[j]} "  # completed by token j+1's leading space: stops after j+1
    with tokenizer(engines["speculative"], fake_tokenizer()) as llm:
        out = llm.generate(PROMPTS[2], greedy(stop=[stop], ignore_eos=True))[0]
    assert out.token_ids == ref[: j + 2]
    assert out.text == decode(ref[:j])
    m = out.metrics
    assert m.num_accepted_tokens > 0 and m.num_emitted_tokens > len(out.token_ids)


def test_stop_strings_need_a_tokenizer(engines):
    with pytest.raises(RequestError, match="stop strings need a tokenizer"):
        engines["baseline"].generate(PROMPTS[0], greedy(stop=["x"]))


def test_engines_agree_on_a_mixed_batch(engines, reference):
    """All stop kinds at once, in one batch: both engines give identical outputs."""
    ref0, ref1, ref2 = reference
    j1 = first_new_token(ref1, 4)
    j2 = first_new_token(ref2, 9)
    params = [
        greedy(max_tokens=13, ignore_eos=True),
        greedy(stop_token_ids=[ref1[j1]], ignore_eos=True),
        greedy(stop=[f" {ref2[j2]} {ref2[j2 + 1]}"], ignore_eos=True),
        greedy(max_tokens=N),  # EOS 2 of the model, if it ever comes
    ]
    results = {}
    for name, llm in engines.items():
        with tokenizer(llm, fake_tokenizer([2])):
            outs = llm.generate(PROMPTS + [PROMPTS[0]], params)
        results[name] = [(o.token_ids, o.text, o.finish_reason, o.outputs[0].stop_reason) for o in outs]
    assert results["baseline"] == results["speculative"]
    assert [r[2] for r in results["baseline"][:3]] == ["length", "stop", "stop"]
