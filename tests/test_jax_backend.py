"""The JAX backend against the torch native one on tiny random models (fp32, CPU).

- The model: hidden states and logits of the JAX Llama family (Llama, Qwen2's q/k/v
  biases, Qwen3's q/k norms) equal the torch native runner's within float32 noise, at
  prefill, batched multi-token verify with ragged rows, and decode after a rollback;
  RoPE frequencies (Llama-3 scaling included) equal the torch ones.
- The engine: ``LLM(backend="jax")`` gives greedy output token-identical to
  ``LLM(backend="torch")``, without speculation and with the unchanged ngram and
  draft_model plugins, with requests joining mid-flight and all at once; seeded sampled
  requests reproduce; the JAX verifiers serve the engine.
- Methods without a JAX path (EAGLE, Medusa, MTP) are a clear ConfigError.
"""

from __future__ import annotations

import pytest
import torch

jax = pytest.importorskip("jax")

from speculum import LLM, SamplingParams  # noqa: E402
from speculum.backends.jax import make_backend  # noqa: E402
from speculum.backends.jax.runner import JaxRunner, query_bucket  # noqa: E402
from speculum.backends.torch.backend import TorchBackend  # noqa: E402
from speculum.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KV = 16 << 20  # a small KV budget: pools are allocated up front
ENGINE_KW = dict(device="cpu", dtype="float32", kv_cache_memory=KV)
PROMPT_IDS = [[5], [7, 9], [30, 31, 32, 30, 31, 32, 30], [10, 11, 12, 13, 14] * 8]
PROMPTS = [{"prompt_token_ids": p} for p in PROMPT_IDS]
MAX_TOKENS = [24, 20, 24, 16]  # sequences leave at different steps
GREEDY = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


def runners(model_dir):
    """(torch native runner, JAX runner) of one checkpoint, each with a planned cache."""
    tb = TorchBackend(device="cpu", dtype="float32", runner="native", kv_cache_memory=8 << 20)
    jb = make_backend(device="cpu", dtype="float32", kv_cache_memory=8 << 20)
    tr, jr = tb.load_model(model_dir), jb.load_model(model_dir)
    tb.plan_memory(256)
    jb.plan_memory(256)
    return tr, jr


# ----------------------------------------------------------------------------- the model
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_jax_model_matches_torch_native(request, arch):
    tr, jr = runners(request.getfixturevalue(f"tiny_{arch}"))
    assert isinstance(jr, JaxRunner) and jr.device == torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 17, 40)]
    layers = (0, 1, -1)
    ht = tr.add_many([0, 1, 2], prompts, hidden_layers=layers)
    hj = jr.add_many([0, 1, 2], prompts, hidden_layers=layers)
    for s, p in enumerate(prompts):
        for layer in layers:
            assert hj[s][layer].shape == (len(p), 64)
            torch.testing.assert_close(hj[s][layer], ht[s][layer], rtol=1e-4, atol=1e-5)
    # a ragged multi-token verify step: rows keep 4, 2 and 3 of their 4 tokens
    ids = torch.randint(3, 500, (3, 4), generator=g)
    ot = tr.forward([0, 1, 2], ids, [4, 2, 3], hidden_layers=(1,))
    oj = jr.forward([0, 1, 2], ids, [4, 2, 3], hidden_layers=(1,))
    assert oj.logits.shape == (3, 4, 512) and oj.logits.dtype == torch.float32
    for b, n in enumerate([4, 2, 3]):
        torch.testing.assert_close(oj.logits[b, :n], ot.logits[b, :n], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(oj.hidden_states[1][b, :n], ot.hidden_states[1][b, :n], rtol=1e-4, atol=1e-5)
    assert [jr.length(s) for s in range(3)] == [9, 19, 43]
    # rollback by length, then decode: the rejected positions are overwritten
    for r in (tr, jr):
        r.truncate(0, 6)
        r.truncate(1, 17)
        r.remove(2)
    ids = torch.randint(3, 500, (2, 1), generator=g)
    ot, oj = tr.forward([0, 1], ids, [1, 1]), jr.forward([0, 1], ids, [1, 1])
    torch.testing.assert_close(oj.logits, ot.logits, rtol=1e-4, atol=1e-4)
    assert jr.length(0) == 7 and jr.allocator.length(2) == 0


def test_rope_frequencies_match_torch_including_llama3_scaling(tiny_llama):
    import attrs
    import numpy as np

    from speculum.backends.jax.model import rope_inv_freq as jax_inv_freq
    from speculum.backends.torch.native.arch import read_arch
    from speculum.backends.torch.native.model import rope_inv_freq as torch_inv_freq
    arch, _ = read_arch(tiny_llama)
    llama3 = attrs.evolve(arch, rope_theta=500000.0, head_dim=128, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    for a in (arch, llama3):
        np.testing.assert_allclose(jax_inv_freq(a), torch_inv_freq(a).numpy(), rtol=2e-7)
    # the scaling did something: long wavelengths slowed 8x, short ones kept
    plain = jax_inv_freq(attrs.evolve(llama3, rope_scaling=None))
    scaled = jax_inv_freq(llama3)
    assert scaled[0] == plain[0] and scaled[-1] == pytest.approx(plain[-1] / 8)


def test_shapes_are_bucketed():
    assert [query_bucket(q) for q in (1, 2, 5, 8, 9, 17)] == [1, 2, 5, 8, 16, 32]
    assert [query_bucket(q, prefill=True) for q in (1, 16, 17, 300, 512)] == [16, 16, 32, 512, 512]


def test_runner_without_memory_plan_says_what_to_do(tiny_llama):
    jr = make_backend(device="cpu", dtype="float32").load_model(tiny_llama)
    with pytest.raises(RuntimeError, match="call the backend's plan_memory first"):
        jr.add(0, [1, 2, 3])


# ---------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def torch_baseline(tiny_llama) -> list[list[int]]:
    llm = LLM(model=str(tiny_llama), backend="torch", max_num_seqs=len(PROMPTS), **ENGINE_KW)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def spec_config(name: str, tiny_llama, tiny_llama_draft):
    return {
        "none": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
        "draft_model": {"model": str(tiny_llama_draft), "num_speculative_tokens": 3},
        "self_draft_1_layer": {"model": str(tiny_llama), "num_speculative_tokens": 3, "options": {"num_layers": 1}},
    }[name]


@pytest.mark.parametrize("max_num_seqs", [2, len(PROMPTS)], ids=["joins-mid-flight", "all-at-once"])
@pytest.mark.parametrize("method", ["none", "ngram", "draft_model", "self_draft_1_layer"])
def test_jax_engine_greedy_identical_to_torch(tiny_llama, tiny_llama_draft, torch_baseline, method, max_num_seqs):
    spec = spec_config(method, tiny_llama, tiny_llama_draft)
    llm = LLM(model=str(tiny_llama), speculative_config=spec, backend="jax", max_num_seqs=max_num_seqs, **ENGINE_KW)
    assert isinstance(llm.target, JaxRunner)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == torch_baseline
    m = llm.metrics
    assert m.num_emitted_tokens == sum(MAX_TOKENS)
    if spec is not None:
        assert isinstance(llm.proposer.runner, JaxRunner) if method != "ngram" else True
        assert m.num_draft_tokens > 0, "the proposer never drafted: the test would be vacuous"
    if method in ("ngram", "self_draft_1_layer"):
        assert m.num_accepted_tokens > 0, "nothing was ever accepted: the test would be vacuous"


def test_jax_verifiers_in_the_engine(tiny_llama, torch_baseline):
    """acceptance_method 'greedy_jax' / 'rejection_sampler_jax': identical greedy output;
    seeded sampled requests reproduce (and differ between seeds)."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    for name in ("greedy_jax", "rejection_sampler_jax"):
        llm = LLM(model=str(tiny_llama), speculative_config={**spec, "acceptance_method": name}, backend="jax",
                  max_num_seqs=len(PROMPTS), **ENGINE_KW)
        assert type(llm.verifier).__name__ == {"greedy_jax": "JaxGreedyVerifier",
                                               "rejection_sampler_jax": "JaxRejectionSampler"}[name]
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == torch_baseline
    sampled = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=s, ignore_eos=True) for s in (1, 1, 2, 3)]
    outs = [o.token_ids for o in llm.generate(PROMPTS[:1] * 4, sampled)]
    again = [o.token_ids for o in llm.generate(PROMPTS[:1] * 4, sampled)]
    assert outs == again and outs[0] == outs[1] and len({tuple(o) for o in outs}) >= 2


def test_sampled_draft_model_on_jax_reproduces(tiny_llama):
    """A sampled draft (probs from the JAX draft runner) through the JAX rejection sampler."""
    spec = {"model": str(tiny_llama), "num_speculative_tokens": 3, "options": {"num_layers": 1},
            "acceptance_method": "rejection_sampler_jax"}
    llm = LLM(model=str(tiny_llama), speculative_config=spec, backend="jax", max_num_seqs=2, **ENGINE_KW)
    params = [SamplingParams(temperature=1.0, max_tokens=16, seed=s, ignore_eos=True) for s in (7, 8)]
    first = [o.token_ids for o in llm.generate(PROMPTS[2:], params)]
    assert first == [o.token_ids for o in llm.generate(PROMPTS[2:], params)]
    assert llm.metrics.num_draft_tokens > 0


@pytest.mark.parametrize("method", ["eagle", "medusa", "mtp"])
def test_methods_without_jax_path_are_a_clear_error(tiny_llama, method):
    with pytest.raises(ConfigError, match=f"method '{method}' .* has no implementation for backend 'jax'; "
                                          "it supports: torch"):
        LLM(model=str(tiny_llama), speculative_config={"method": method, "num_speculative_tokens": 2},
            backend="jax", **ENGINE_KW)


def test_jax_backend_options_are_checked(tiny_llama):
    with pytest.raises(ConfigError, match="does not accept these options"):
        LLM(model=str(tiny_llama), backend="jax", runner="native", **ENGINE_KW)
    with pytest.raises(ConfigError, match="unknown dtype"):
        LLM(model=str(tiny_llama), backend="jax", device="cpu", dtype="int8")
    with pytest.raises(ConfigError, match="KV cache budget"):
        LLM(model=str(tiny_llama), backend="jax", device="cpu", dtype="float32", kv_cache_memory=1 << 10)
    if jax.default_backend() == "cpu":
        with pytest.raises(ConfigError, match="JAX sees no GPU"):
            LLM(model=str(tiny_llama), backend="jax", device="cuda")


# ------------------------------------------------------------------------- the benchmark
@pytest.mark.parametrize("separate", [False, True], ids=["one-process", "separate-processes"])
def test_bench_backends_runs_the_same_code_on_both(tiny_llama, tmp_path, capsys, separate):
    import json

    from speculum.cli import main
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPT_IDS[2:]))
    out = tmp_path / "backends.json"
    methods = [] if separate else ["--method", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}']
    rc = main(["bench", "backends", "--model", str(tiny_llama), "--dataset", str(data), "--num-prompts", "2",
               "--max-tokens", "8", "--batch-size", "2", "--dtype", "float32", "--device", "cpu", "--json", str(out),
               *methods, *(["--separate-processes"] if separate else [])])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["backends"] == ["torch", "jax"] and report["environment"]["jax"] == jax.__version__
    assert [r["method"] for r in report["results"]] == ["autoregressive"] + ([] if separate else ["ngram(k=3)"])
    for row in report["results"]:
        torch_run, jax_run = row["backends"]["torch"], row["backends"]["jax"]
        assert torch_run["tokens"] == jax_run["tokens"] > 0 and jax_run["identical_to_torch"] is True
        assert jax_run["tokens_per_s"] > 0 and jax_run["first_pass_s"] > 0 and "token_ids" not in jax_run
    printed = capsys.readouterr().out
    assert "torch tok/s" in printed and "jax/torch" in printed


def test_capture_compiles_ahead_and_leaves_the_cache_alone(tiny_llama):
    tr, jr = runners(tiny_llama)
    tr.add(0, [5, 6, 7, 8])
    jr.add(0, [5, 6, 7, 8])
    assert jr.capture([1, 3], [1, 4], max_block_buckets=1) == 4  # rows 1 and 4, queries 1 and 4
    assert {(1, 1, 16, (), True), (4, 4, 16, (), True)} <= jr.step_shapes
    assert jr.capture([1], [1], max_block_buckets=1) == 0
    ids = torch.tensor([[9, 10]])
    torch.testing.assert_close(jr.forward([0], ids, [2]).logits, tr.forward([0], ids, [2]).logits,
                               rtol=1e-4, atol=1e-4)
