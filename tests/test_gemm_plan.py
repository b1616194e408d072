"""The GEMM plan (speculum.backends.torch.native.gemm): which BLAS library each GEMM shape
takes, chosen by timing before a CUDA graph is captured. On a CPU the choice logic runs
with a fake timer and a recording library switch; on CUDA the real libraries are timed."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from speculum.backends.torch import LlamaArch, NativeRunner, random_native
from speculum.backends.torch.native import gemm
from speculum.kv import PagedKVAllocator

ARCH = dict(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=8, rms_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
            tie_word_embeddings=False, qkv_bias=False, qk_norm=False, max_position_embeddings=256,
            eos_token_id=None)


def fake_timer(table):
    """A timer answering ``table[(N, backend)]`` microseconds for a weight of N rows."""
    seen = []

    def timer(fns, backend):
        out = fns[0]()  # the GEMM under test: [rows, N]
        seen.append((out.shape[0], backend))
        return table[(out.shape[1], backend)]

    timer.seen = seen
    return timer


def test_tune_keeps_the_default_unless_an_alternative_is_clearly_faster():
    w_fast, w_tie, w_slow = torch.randn(8, 4), torch.randn(16, 4), torch.randn(24, 4)
    timer = fake_timer({(8, None): 10.0, (8, "cublaslt"): 9.0,     # 10% faster: chosen
                        (16, None): 10.0, (16, "cublaslt"): 9.9,   # 1%: within MARGIN, default kept
                        (24, None): 10.0, (24, "cublaslt"): 12.0})  # slower: default kept
    plan = gemm.GemmPlan(timer)
    plan.tune([w_fast, w_tie, w_slow], rows=33)
    assert plan.choice == {(33, 8, 4, torch.float32): "cublaslt", (33, 16, 4, torch.float32): None,
                           (33, 24, 4, torch.float32): None}
    assert plan.summary() == {"33x8x4": "cublaslt"}
    assert plan.timings[(33, 8, 4, torch.float32)] == {"default": 10.0, "cublaslt": 9.0}
    # every candidate was timed at the rows asked for; a shape already tuned is not timed again
    assert timer.seen == [(33, None), (33, "cublaslt")] * 3
    plan.tune([w_fast], rows=33)
    assert len(timer.seen) == 6
    plan.tune([w_fast], rows=1)  # a decode step's GEMMs keep PyTorch's choice: not timed
    assert len(timer.seen) == 6 and (1, 8, 4, torch.float32) not in plan.choice


def test_timing_cycles_through_copies_of_a_small_weight():
    """A weight that fits in L2 is timed through enough copies to leave it (COLD_BYTES)."""
    counts = []
    plan = gemm.GemmPlan(lambda fns, backend: counts.append(len(fns)) or 1.0)
    w = torch.randn(64, 32)  # 8 KiB: the copies are capped
    plan.tune([w], rows=4)
    assert counts == [256, 256]
    plan.tune([torch.randn(64, 1024)], rows=4)  # 256 KiB: 512 copies would pass the cap too
    elements = gemm.COLD_BYTES // 4  # float32: a weight of COLD_BYTES, one copy beside it, 10 calls
    plan.tune([torch.empty(elements // 1024, 1024)], rows=4)
    assert counts[-2:] == [10, 10]


def test_linear_switches_library_only_for_the_tuned_rows_and_shape(monkeypatch):
    used = []

    @contextlib.contextmanager
    def recording_blas(backend):
        used.append(backend)
        yield

    monkeypatch.setattr(gemm, "blas", recording_blas)
    w = torch.randn(8, 4)
    plan = gemm.GemmPlan(fake_timer({(8, None): 10.0, (8, "cublaslt"): 5.0}))
    x1 = torch.randn(1, 4)
    assert torch.equal(plan.linear(x1, w), F.linear(x1, w)) and used == []  # nothing tuned: no switch
    plan.tune([w], rows=6)
    x = torch.randn(2, 3, 4)  # 6 rows in [B, q, K]
    assert torch.equal(plan.linear(x, w), F.linear(x, w))
    assert used == ["cublaslt"]
    plan.linear(torch.randn(5, 4), w)  # another row count: the default, no switch
    plan.linear(torch.randn(6, 4), torch.randn(9, 4))  # another shape: the default
    assert used == ["cublaslt"]


def test_a_shape_that_cannot_be_timed_keeps_pytorchs_choice(caplog):
    """No memory for the weight's copies (the KV cache took it), or a library the GPU or the
    build lacks: a warning, the default kept, the other shapes still timed."""
    def timer(fns, backend):
        if fns[0]().shape[1] == 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 128 MiB")
        return 5.0 if backend else 10.0

    plan = gemm.GemmPlan(timer)
    with caplog.at_level("WARNING", logger="speculum.backends.torch.native.gemm"):
        plan.tune([torch.randn(8, 4), torch.randn(16, 4)], rows=3)
    assert plan.choice == {(3, 8, 4, torch.float32): None, (3, 16, 4, torch.float32): "cublaslt"}
    assert "8 x 4 at 3 rows not timed" in caplog.text


def test_a_cpu_model_tunes_nothing_and_its_forward_is_unchanged():
    model = random_native(LlamaArch(**ARCH), torch.float32, torch.device("cpu"))
    model.tune_gemms(5)
    assert model.gemm.choice == {}
    assert all(layer.attn.gemm is model.gemm and layer.mlp.gemm is model.gemm for layer in model.layers)


def test_tuning_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("SPECULUM_GEMM_TUNE", "0")
    assert not gemm.tuning_enabled()
    monkeypatch.setenv("SPECULUM_GEMM_TUNE", "1")
    assert gemm.tuning_enabled()


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_onednn
def test_a_cpu_runner_packs_every_fp32_gemm_and_computes_what_f_linear_does(monkeypatch):
    """On a CPU in fp32 every GEMM of the forward (4 per layer and the LM head) goes through
    oneDNN's prepacked copy; the logits match the unpacked twin's (SPECULUM_GEMM_TUNE=0) to
    rounding, and the copies count in the runner's weight bytes (the memory plan's log)."""
    model = random_native(LlamaArch(**ARCH), torch.float32, torch.device("cpu"))
    dense_bytes = sum(p.numel() * 4 for p in model.parameters())
    layer_weights = [w for layer in model.layers for w in (layer.attn.qkv.weight, layer.attn.o.weight,
                                                           layer.mlp.gate_up.weight, layer.mlp.down.weight)]
    weights = layer_weights + [model.lm_head.weight]
    gemm_bytes = sum(w.numel() * 4 for w in weights)
    runner = NativeRunner(model, max_model_len=256)
    assert {id(w) for w in weights} == set(model.gemm.packed)
    assert runner.packed_bytes == gemm_bytes
    # the layers' dense weights are given back, so only the LM head's copy adds to the model's memory
    assert all(w.numel() == 0 for w in layer_weights) and model.lm_head.weight.numel() > 0
    assert runner.weight_bytes == sum(p.numel() * 4 for p in model.parameters()) + runner.packed_bytes
    assert runner.weight_bytes == dense_bytes + model.lm_head.weight.numel() * 4
    calls = []
    real = gemm._onednn_linear
    monkeypatch.setattr(gemm, "_onednn_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    runner.attach_cache(PagedKVAllocator("target", 64, 16, 256))
    prompt = torch.randint(0, ARCH["vocab_size"], (1, 12))
    tok = torch.randint(0, ARCH["vocab_size"], (1, 4))
    runner.forward([0], prompt, [12])
    packed = runner.forward([0], tok, [4]).logits
    assert len(calls) == 2 * (4 * ARCH["num_layers"] + 1)  # the prefill's GEMMs, then the verify's

    monkeypatch.setenv("SPECULUM_GEMM_TUNE", "0")
    twin = NativeRunner(random_native(LlamaArch(**ARCH), torch.float32, torch.device("cpu")), max_model_len=256)
    assert twin.packed_bytes == 0 and twin.model.gemm.packed == {}
    twin.attach_cache(PagedKVAllocator("target", 64, 16, 256))
    twin.forward([0], prompt, [12])
    assert torch.allclose(twin.forward([0], tok, [4]).logits, packed, atol=1e-5, rtol=1e-4)


@needs_onednn
def test_a_weight_changed_after_packing_is_never_read_from_its_stale_copy():
    w, x = torch.randn(16, 8), torch.randn(3, 8)
    plan = gemm.GemmPlan()
    assert plan.pack([w]) == 16 * 8 * 4
    assert torch.allclose(plan.linear(x, w), F.linear(x, w), atol=1e-5)
    with torch.no_grad():
        w.mul_(2)  # written in place: its version moves on
    assert torch.equal(plan.linear(x, w), F.linear(x, w))
    plan.pack([w])  # packed already: kept as it was (stale, unused)
    w2 = torch.randn(16, 8)
    plan.pack([w2])
    w2.data = torch.randn(16, 8)  # swapped storage (what module.to() does)
    assert torch.equal(plan.linear(x, w2), F.linear(x, w2))
    w3 = torch.randn(16, 8)
    plan.pack([w3])
    w3.requires_grad_(True)  # training: the prepacked product has no gradient
    plan.linear(x, w3).sum().backward()
    assert w3.grad is not None and torch.allclose(w3.grad, x.sum(0).expand(16, 8))


@needs_onednn
def test_released_weights_come_back_dense_for_the_batch_invariant_mode():
    """A CPU runner's layers give their dense weights back after packing; switching the model to
    the batch-invariant mode (its GEMM reads dense weights) restores them bit for bit from the
    prepacked copies, and its logits then equal those of a twin that was never packed."""
    arch = LlamaArch(**ARCH)
    twin = random_native(arch, torch.float32, torch.device("cpu"))  # the same seed: the same weights
    model = random_native(arch, torch.float32, torch.device("cpu"))
    runner = NativeRunner(model, max_model_len=256)
    assert model.gemm.released and all(w.numel() == 0 for layer in model.layers for w in layer.gemm_weights())
    model.set_batch_invariant()
    assert not model.gemm.released
    for a, b in zip(model.parameters(), twin.parameters()):
        assert a.shape == b.shape and torch.equal(a, b)
    twin_runner = NativeRunner(twin.set_batch_invariant(), max_model_len=256)
    assert twin_runner.packed_bytes == 0
    prompt = torch.randint(0, ARCH["vocab_size"], (1, 12))
    out = []
    for r in (runner, twin_runner):
        r.attach_cache(PagedKVAllocator("target", 64, 16, 256))
        out.append(r.forward([0], prompt, [12]).logits)
    assert torch.equal(out[0], out[1])


@needs_onednn
def test_a_released_weight_goes_through_its_copy_until_given_other_values():
    w, x = torch.randn(16, 8), torch.randn(3, 8)
    want = F.linear(x, w)
    plan = gemm.GemmPlan()
    plan.pack([w])
    assert plan.release([w]) == 16 * 8 * 4 and w.numel() == 0
    assert plan.release([w]) == 0  # released already
    assert torch.allclose(plan.linear(x, w), want, atol=1e-5)
    w.data = torch.randn(16, 8)  # other dense values put back by hand: never the stale copy's
    assert torch.equal(plan.linear(x, w), F.linear(x, w))
    stale = torch.randn(16, 8)
    plan.pack([stale])
    with torch.no_grad():
        stale.mul_(2)
    assert plan.release([stale]) == 0 and stale.numel() == 16 * 8  # a stale copy keeps its weight


def test_only_fp32_cpu_weights_are_packed_and_not_in_batch_invariant_mode(monkeypatch):
    assert not gemm.packable(torch.randn(4, 4, dtype=torch.bfloat16))
    assert not gemm.packable(torch.randn(4))
    model = random_native(LlamaArch(**ARCH), torch.float32, torch.device("cpu")).set_batch_invariant()
    assert model.pack_gemms() == 0 and model.gemm.packed == {}  # its own GEMM, whose rows are the claim
    monkeypatch.setenv("SPECULUM_GEMM_TUNE", "0")
    assert not gemm.packable(torch.randn(4, 4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_tune_before_capture_and_match_eager():
    dev = torch.device("cuda")
    arch = LlamaArch(**{**ARCH, "hidden_size": 256, "intermediate_size": 512, "vocab_size": 1024,
                        "head_dim": 64})
    model = random_native(arch, torch.bfloat16, dev)
    runner = NativeRunner(model, max_model_len=256)
    runner.attach_cache(PagedKVAllocator("target", 64, 16, 256))
    eager = NativeRunner(model, max_model_len=256, cuda_graphs=False)
    eager.attach_cache(PagedKVAllocator("target", 64, 16, 256))
    tok = torch.randint(0, arch.vocab_size, (1, 5), device=dev)
    prompt = torch.randint(0, arch.vocab_size, (1, 16), device=dev)
    for r in (runner, eager):
        r.forward([0], prompt, [16])
    out_g = runner.forward([0], tok, [5]).logits
    # the graph of 5 rows was captured after its GEMMs were timed under both libraries
    assert {k[0] for k in model.gemm.timings} >= {5}
    assert all(set(t) == {"default", *gemm.ALTERNATIVES} for t in model.gemm.timings.values())
    model.gemm.choice = {k: "cublaslt" for k in model.gemm.choice}  # force the switch for the eager twin
    out_e = eager.forward([0], tok, [5]).logits
    assert torch.allclose(out_g, out_e, atol=0.1, rtol=0.05)
