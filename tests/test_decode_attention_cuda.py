"""The Triton decode/verify attention against the gathered SDPA path it replaces on CUDA.

Runs on a CUDA device; on a CPU with ``TRITON_INTERPRET=1`` and a triton install the
same checks run through Triton's interpreter (``SPECULUM_TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os

import pytest
import torch

from speculum.backends.torch.native import attention
from speculum.tree import TreeMask, tree_attention_mask

INTERPRET = os.environ.get("SPECULUM_TRITON_INTERPRET") == "1"
if INTERPRET:
    DEV = torch.device("cpu")
elif torch.cuda.is_available():
    DEV = torch.device("cuda")
else:
    pytest.skip("needs CUDA (or SPECULUM_TRITON_INTERPRET=1 with triton)", allow_module_level=True)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    if INTERPRET:
        monkeypatch.setattr(attention, "use_triton", lambda t: True)


def _case(B, T, Lc, hq=9, hkv=3, d=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    nslots = B * Lc + 16
    k_pool = torch.randn(nslots, hkv, d, generator=g).to(DEV, dtype)
    v_pool = torch.randn(nslots, hkv, d, generator=g).to(DEV, dtype)
    slots = torch.randperm(nslots, generator=g)[: B * Lc].view(B, Lc).to(DEV)
    q = torch.randn(B, T, hq, d, generator=g).to(DEV, dtype)
    # rows at different lengths; the last query of row b at position Lc - 1 - 7 * b
    last = torch.tensor([Lc - 1 - 7 * b for b in range(B)])
    positions = (last.view(B, 1) - (T - 1) + torch.arange(T).view(1, T)).clamp_min(0).to(DEV)
    return q, k_pool, v_pool, slots, positions


def _check(q, k_pool, v_pool, slots, positions, mask=None, tol=2e-5):
    scale = q.shape[-1] ** -0.5
    ref_mask = mask if mask is not None else attention.causal_mask(positions, slots.shape[1])
    ref = attention.sdpa_attention(q.float(), k_pool.float(), v_pool.float(), slots, ref_mask, scale)
    out = attention.paged_decode_attention(q, k_pool, v_pool, slots, positions, scale, mask)
    assert out.shape == q.shape and out.dtype == q.dtype
    err = (out.float() - ref).abs().max().item()
    assert err < tol, err


@pytest.mark.parametrize("B,T,Lc", [(1, 1, 64), (1, 2, 80), (2, 5, 200), (1, 33, 160), (3, 9, 640)])
def test_matches_sdpa_fp32(B, T, Lc):
    _check(*_case(B, T, Lc))


def test_split_and_direct_paths_agree(monkeypatch):
    case = _case(1, 3, 512)
    _check(*case)  # B=1: the context is split across programs and combined
    monkeypatch.setattr(attention, "TARGET_PROGRAMS", 1)  # one split: the kernel writes the output itself
    _check(*case)


def _tree(parents: list[int], root: torch.Tensor, Lc: int):
    """(positions [B, T], mask) of a verify forward over ``[root, nodes...]`` whose nodes
    have ``parents`` (-1 = the root), for each row's ``root`` position."""
    B, T = root.shape[0], len(parents) + 1
    depth = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    vis = torch.zeros(B, T, T, dtype=torch.bool)
    vis[:, :, 0] = True
    for i, p in enumerate(parents):
        vis[:, i + 1, i + 1] = True
        while p >= 0:
            vis[:, i + 1, p + 1] = True
            p = parents[p]
    positions = root.view(B, 1) + torch.tensor([0, *depth], device=DEV).view(1, T)
    return positions, tree_attention_mask(Lc, root, vis.to(DEV)), TreeMask(root, vis.to(DEV))


def test_tree_mask():
    B, T, Lc = 2, 6, 96
    q, k_pool, v_pool, slots, _ = _case(B, T, Lc)
    # root, then nodes: 0 <- 1, 0 <- 2 (siblings), 1 <- 3, 2 <- 4
    positions, mask, compact = _tree([-1, 0, 0, 1, 2], torch.tensor([50, 70], device=DEV), Lc)
    _check(q, k_pool, v_pool, slots, positions, mask)
    # the compact form (what tree forwards pass since the eighteenth session): the same
    # attention, with and without positions, and spelled out by the SDPA path
    scale = q.shape[-1] ** -0.5
    ref = attention.sdpa_attention(q.float(), k_pool.float(), v_pool.float(), slots, mask, scale)
    assert torch.equal(attention.sdpa_attention(q.float(), k_pool.float(), v_pool.float(), slots, compact, scale), ref)
    for pos in (positions, None):
        out = attention.paged_decode_attention(q, k_pool, v_pool, slots, pos, scale, compact)
        assert (out.float() - ref).abs().max().item() < 2e-5


def test_compact_tree_mask_wider_than_the_queries():
    """A draft head's tree level: F queries over a tree region of K > F keys (each query
    sees the context before the region and a random subset of it), no positions; keys
    past the region hold NaN and are never read."""
    B, T, Lc, K = 2, 4, 300, 11
    q, k_pool, v_pool, slots, _ = _case(B, T, Lc, seed=3)
    g = torch.Generator().manual_seed(4)
    vis = (torch.rand(B, T, K, generator=g) < 0.5).to(DEV)
    vis[:, :, 0] = True
    base = torch.tensor([120, 250], device=DEV)
    compact = TreeMask(base, vis)
    scale = q.shape[-1] ** -0.5
    ref = attention.sdpa_attention(q.float(), k_pool.float(), v_pool.float(), slots, compact.dense(Lc), scale)
    for b in range(B):
        past = slots[b, int(base[b]) + K:]
        k_pool[past], v_pool[past] = float("nan"), float("nan")
    out = attention.paged_decode_attention(q, k_pool, v_pool, slots, None, scale, compact)
    assert (out.float() - ref).abs().max().item() < 2e-5


def test_tree_mask_in_a_long_context_reads_no_key_past_the_tree():
    """A verify tree near the start of a long block bucket: the kernel stops reading at
    the deepest query's position + T (positions given with the mask) and still matches
    the reference; the keys past that hold NaN, so reading one would show (without the
    bound the kernel reads the whole bucket)."""
    B, T, Lc = 1, 9, 1024
    q, k_pool, v_pool, slots, _ = _case(B, T, Lc)
    positions, mask, _ = _tree([-1, 0, 0, 1, 1, 2, 3, 6], torch.tensor([200], device=DEV), Lc)
    scale = q.shape[-1] ** -0.5
    ref = attention.sdpa_attention(q.float(), k_pool.float(), v_pool.float(), slots, mask, scale)
    past = slots[0, int(positions.max()) + T:]
    k_pool[past], v_pool[past] = float("nan"), float("nan")
    out = attention.paged_decode_attention(q, k_pool, v_pool, slots, positions, scale, mask)
    assert (out.float() - ref).abs().max().item() < 2e-5


@pytest.mark.skipif(INTERPRET, reason="bf16 dot products need a GPU")
def test_bf16_close_to_fp32_reference():
    _check(*_case(2, 5, 300, dtype=torch.bfloat16), tol=2e-2)


def test_gqa_group_of_four_and_head_dim_128():
    _check(*_case(1, 17, 200, hq=8, hkv=2, d=128))
