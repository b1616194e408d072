"""The native Llama-family runner matches transformers, and the paged KV cache is safe."""

from __future__ import annotations

import pytest
import torch

from speculum import LLM, SamplingParams
from speculum.backends.torch.backend import TorchBackend
from speculum.backends.torch.native.runner import NativeRunner
from speculum.errors import ConfigError
from speculum.testing import tiny_model_dir

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="module", params=ARCHS)
def arch_dir(request, tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param, seed=3)


def _hf_logits(path, ids):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0]


def test_native_logits_match_transformers(arch_dir):
    ids = [5, 17, 300, 42, 9, 77, 120, 3, 8, 250, 11]
    ref = _hf_logits(arch_dir, ids)
    be = TorchBackend(device="cpu", dtype="float32", runner="native")
    runner = be.load_model(arch_dir, "target", max_model_len=256)
    assert isinstance(runner, NativeRunner)
    be.plan_memory(256)
    # prefill 6 tokens, then a 3-token verify-style forward, then 2 single-token steps
    runner.add(0, ids[:6])
    out = [runner.forward([0], torch.tensor([ids[6:9]]), [3]).logits[0]]
    out += [runner.forward([0], torch.tensor([[t]]), [1]).logits[0] for t in ids[9:]]
    got = torch.cat(out)
    diff = (got - ref[6:]).abs().max().item()
    assert diff < 1e-4, f"max abs diff {diff}"


def test_native_rollback_then_rewrite_matches(arch_dir):
    """Writing rejected tokens, truncating, and writing others gives the clean logits."""
    ids = [5, 17, 300, 42, 9, 77, 120]
    ref = _hf_logits(arch_dir, ids)
    be = TorchBackend(device="cpu", dtype="float32", runner="native", block_size=4)
    runner = be.load_model(arch_dir, "target", max_model_len=64)
    be.plan_memory(64)
    runner.add(0, ids[:4])
    runner.forward([0], torch.tensor([[ids[4], 1, 2, 3, 4, 6]]), [6])  # 5 junk drafts span 2 blocks
    runner.truncate(0, 5)
    got = runner.forward([0], torch.tensor([ids[5:7]]), [2]).logits[0]
    assert (got - ref[5:7]).abs().max().item() < 1e-4


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}])
def test_native_greedy_equals_transformers_runner(arch_dir, spec):
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (n,), generator=g).tolist()} for n in (1, 4, 9, 23)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # fp32 on any device (on CUDA the default bf16 rounds differently in the two runners'
    # kernels: on the H200, 2026-12-03, one prompt of four differed)
    hf = LLM(str(arch_dir), runner="hf", max_num_seqs=3, dtype="float32").generate(prompts, sp)
    nat = LLM(str(arch_dir), speculative_config=spec, runner="native", max_num_seqs=3,
              dtype="float32").generate(prompts, sp)
    assert [o.token_ids for o in hf] == [o.token_ids for o in nat]


def test_preemption_keeps_outputs_identical(tiny_llama):
    g = torch.Generator().manual_seed(2)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (20,), generator=g).tolist()} for _ in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = LLM(str(tiny_llama), max_num_seqs=6).generate(prompts, sp)
    spec = {"model": str(tiny_llama), "num_speculative_tokens": 3}
    # per token: 2 layers * 2 (k,v) * 2 heads * 16 dims * 4 bytes = 512 B per group; two groups
    tight = LLM(str(tiny_llama), speculative_config=spec, max_num_seqs=6, block_size=4,
                kv_cache_memory=40 * 4 * 1024, max_model_len=96)
    outs = tight.generate(prompts, sp)
    assert tight.num_preemptions > 0, "the budget was meant to force preemption"
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_impossible_kv_budget_is_a_clear_error(tiny_llama):
    with pytest.raises(ConfigError, match="less than one sequence of max_model_len"):
        LLM(str(tiny_llama), kv_cache_memory=4096, max_model_len=512)


def test_prefill_chunk_sets_the_prompt_tokens_per_forward_and_not_the_output(tiny_llama):
    """`prefill_chunk` (as the jax backend's): a prompt of 30 tokens in chunks of 7 (five
    forwards, the later ones reading the earlier chunks through the cache) gives the greedy
    tokens of one whole-prompt forward; a chunk below 1 is a clear error."""
    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (n,), generator=g).tolist()} for n in (30, 9, 17)]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    whole = LLM(str(tiny_llama), prefill_chunk=64)
    chunked = LLM(str(tiny_llama), prefill_chunk=7)
    assert (whole.target.prefill_chunk, chunked.target.prefill_chunk) == (64, 7)
    assert [o.token_ids for o in chunked.generate(prompts, sp)] == [o.token_ids for o in whole.generate(prompts, sp)]
    with pytest.raises(ConfigError, match="prefill_chunk must be an integer >= 1"):
        TorchBackend(device="cpu", prefill_chunk=0)


def test_runner_choice_is_logged(tiny_llama, caplog):
    import logging
    with caplog.at_level(logging.INFO, logger="speculum"):
        LLM(str(tiny_llama))
    assert any("native llama runner" in r.message for r in caplog.records)
    assert any("memory plan" in r.message for r in caplog.records)


def test_max_num_batched_tokens_bounds_admission_and_keeps_outputs(tiny_llama):
    g = torch.Generator().manual_seed(4)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (n,), generator=g).tolist()} for n in (30, 5, 30, 8, 12)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = LLM(str(tiny_llama), max_num_seqs=5).generate(prompts, sp)
    llm = LLM(str(tiny_llama), max_num_seqs=5, max_num_batched_tokens=32)
    for i, p in enumerate(prompts):
        llm.add_request(str(i), p, sp)
    outs = {}

    def step():
        for o in llm.step():
            if o.finished:
                outs[o.request_id] = o.token_ids

    step()
    assert llm.num_running == 1 and llm.num_waiting == 4  # 30 + 5 > 32: only the head fits
    step()
    assert llm.num_running == 2  # the 5-token prompt joins next; FIFO order is kept
    while llm.has_unfinished_requests():
        step()
    assert [outs[str(i)] for i in range(len(prompts))] == [r.token_ids for r in ref]


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (9, 3)])
def test_fresh_prefill_attention_equals_the_gathered_causal_path(hq, hkv):
    """A prefill's first chunk attends over its own keys only (flash-eligible SDPA, no mask):
    every real row equals the gathered-context path with the causal mask, with right padding
    written to a shared scratch slot and a block table wider than the chunk."""
    from speculum.backends.torch.native.attention import causal_mask, fresh_attention, sdpa_attention
    torch.manual_seed(0)
    B, T, D, Lc = 3, 7, 16, 16
    lens = [7, 3, 5]
    k_pool, v_pool = torch.randn(64, hkv, D), torch.randn(64, hkv, D)
    q = torch.randn(B, T, hq, D)
    read = torch.stack([torch.arange(16 + 16 * b, 32 + 16 * b) for b in range(B)])  # [B, Lc]
    write = read[:, :T].clone()
    for b, n in enumerate(lens):
        write[b, n:] = 0  # padding goes to the scratch slot
    pos = torch.arange(T).expand(B, T)
    fast = fresh_attention(q, k_pool, v_pool, write, D ** -0.5)
    ref = sdpa_attention(q, k_pool, v_pool, read, causal_mask(pos, Lc), D ** -0.5)
    for b, n in enumerate(lens):
        torch.testing.assert_close(fast[b, :n], ref[b, :n], rtol=1e-5, atol=1e-5)
    # the wrong rule (attending to the whole chunk) differs
    wrong = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k_pool[read[:, :T]].repeat_interleave(hq // hkv, 2).transpose(1, 2),
        v_pool[read[:, :T]].repeat_interleave(hq // hkv, 2).transpose(1, 2), scale=D ** -0.5).transpose(1, 2)
    assert not torch.allclose(wrong[0], ref[0], atol=1e-3)



def test_sdpa_leaves_cudnn_out_on_cuda_only(monkeypatch):
    """Every SDPA call of the native runner, the heads' prefill and the transformers runner's
    forwards runs with cuDNN's attention switched off on CUDA (it builds a plan per new
    shape: 2.3 ms of host time a call in a batched generation on the H200) and the other
    kernels on; on the CPU nothing changes. The flags are read here without a GPU."""
    from speculum.backends.torch import hf_runner
    from speculum.backends.torch.native import attention
    flags = torch.backends.cuda
    assert flags.cudnn_sdp_enabled()
    with attention.no_cudnn_attention("cuda"):
        assert not flags.cudnn_sdp_enabled() and flags.flash_sdp_enabled() and flags.mem_efficient_sdp_enabled()
    assert flags.cudnn_sdp_enabled()
    with attention.no_cudnn_attention("cpu"):
        assert flags.cudnn_sdp_enabled()
    seen = []
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda *a, **k: seen.append(flags.cudnn_sdp_enabled()) or a[0])
    q = torch.zeros(1, 1, 2, 8)
    attention.sdpa(q, q, q, is_causal=True)
    assert seen == [True]  # a CPU tensor: cuDNN's flag untouched
    assert hf_runner.no_cudnn_attention is attention.no_cudnn_attention
