"""The fused Triton kernels agree with their torch twins (runs only where CUDA exists).

CI has no GPU: there the torch twins are what the native model runs, and every other
test exercises them. This file is run on the GPU machine.
"""

from __future__ import annotations

import pytest
import torch

from speculum.backends.torch.native import kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or kernels.triton is None,
                                reason="needs CUDA and Triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm_matches_torch(dtype, with_residual):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(7, 3, 576, device="cuda", generator=g).to(dtype)
    r = torch.randn(7, 3, 576, device="cuda", generator=g).to(dtype) if with_residual else None
    w = torch.randn(576, device="cuda", generator=g).to(dtype)
    out, h = kernels.add_rmsnorm(x, r, w, 1e-5)
    ref_out, ref_h = kernels.add_rmsnorm_torch(x, r, w, 1e-5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(h.float(), ref_h.float(), atol=tol, rtol=tol)
    assert torch.allclose(out.float(), ref_out.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strided_slots", [False, True])
def test_rope_write_kv_matches_torch(dtype, strided_slots):
    g = torch.Generator(device="cuda").manual_seed(1)
    B, t, nq, nkv, d, slots = 3, 4, 9, 3, 64, 64
    if strided_slots:  # one column of a wider slot table (a head's draft step): a strided view
        t = 1
    qkv = torch.randn(B, t, (nq + 2 * nkv) * d, device="cuda", generator=g).to(dtype)
    ang = torch.randn(B, t, 1, d // 2, device="cuda", generator=g)
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    wsl = torch.randperm(slots, device="cuda", generator=g)[: B * 4].view(B, 4)
    wsl = wsl[:, 1:2] if strided_slots else wsl
    k1, v1 = (torch.zeros(slots, nkv, d, device="cuda", dtype=dtype) for _ in range(2))
    k2, v2 = (torch.zeros(slots, nkv, d, device="cuda", dtype=dtype) for _ in range(2))
    q1 = kernels.rope_write_kv(qkv, nq, nkv, d, cos, sin, wsl, k1, v1)
    qh, kh, vh = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
    q2 = kernels.rope_write_kv_torch(qh.reshape(B, t, nq, d), kh.reshape(B, t, nkv, d), vh.reshape(B, t, nkv, d),
                                     cos, sin, wsl, k2, v2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(q1.float(), q2.float(), atol=tol, rtol=tol)
    assert torch.allclose(k1.float(), k2.float(), atol=tol, rtol=tol)
    assert torch.equal(v1, v2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(dtype):
    g = torch.Generator(device="cuda").manual_seed(2)
    gu = (torch.randn(5, 3, 2 * 1536, device="cuda", generator=g) * 3).to(dtype)
    out = kernels.silu_mul(gu, 1536)
    ref = kernels.silu_mul_torch(gu, 1536)
    assert out.shape == ref.shape == (5, 3, 1536)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol)


def test_fused_kernels_step_aside_where_a_gradient_is_wanted():
    """The kernels have no backward: with a gradient wanted they fall back to torch, so a
    head trained on the GPU trains every weight (the fifth and sixth sessions' EAGLE-3 runs
    left the head's MLP gate/up at their initial values through the fused ``silu_mul``)."""
    from speculum.backends.torch.heads import RMSNorm, arch_from_config
    from speculum.backends.torch.native.model import MLP
    from speculum.testing import tiny_config

    arch = arch_from_config(tiny_config().to_dict())
    mlp, norm = MLP(arch).cuda(), RMSNorm(arch.hidden_size, 1e-5).cuda()
    x = torch.randn(2, 3, arch.hidden_size, device="cuda")
    mlp(norm(x)).square().sum().backward()  # x itself wants no gradient: the weights do
    for name, p in [*mlp.named_parameters(), *norm.named_parameters()]:
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name} got no gradient"
    with torch.no_grad():
        assert kernels.use_triton(x, norm.weight)  # drafting: the fused kernels
    assert not kernels.use_triton(x, norm.weight)
