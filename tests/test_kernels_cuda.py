"""The fused Triton kernels agree with their torch twins (runs only where CUDA exists).

CI has no GPU: there the torch twins are what the native model runs, and every other
test exercises them. This file is run on the GPU machine; on a CPU with a triton install
the fp32 cases run through Triton's interpreter
(``TRITON_INTERPRET=1 SPECULUM_TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os

import pytest
import torch

from speculum.backends.torch.native import kernels

INTERPRET = os.environ.get("SPECULUM_TRITON_INTERPRET") == "1" and kernels.triton is not None
DEV = torch.device("cpu" if INTERPRET else "cuda")
pytestmark = pytest.mark.skipif(not INTERPRET and (not torch.cuda.is_available() or kernels.triton is None),
                                reason="needs CUDA and Triton (or SPECULUM_TRITON_INTERPRET=1 with triton)")
DTYPES = [torch.float32] if INTERPRET else [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    if INTERPRET:  # the kernels on CPU tensors, with the same rule about gradients
        monkeypatch.setattr(kernels, "use_triton", lambda t, *others: not kernels.wants_grad(t, *others))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm_matches_torch(dtype, with_residual):
    g = _gen(0)
    x = torch.randn(7, 3, 576, generator=g).to(DEV).to(dtype)
    r = torch.randn(7, 3, 576, generator=g).to(DEV).to(dtype) if with_residual else None
    w = torch.randn(576, generator=g).to(DEV).to(dtype)
    out, h = kernels.add_rmsnorm(x, r, w, 1e-5)
    ref_out, ref_h = kernels.add_rmsnorm_torch(x, r, w, 1e-5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(h.float(), ref_h.float(), atol=tol, rtol=tol)
    assert torch.allclose(out.float(), ref_out.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("strided_slots", [False, True])
@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 8, 128)], ids=["smollm2", "llama3-8b"])
def test_rope_write_kv_matches_torch(dtype, strided_slots, heads):
    """SmolLM2's heads (9 q, 3 k/v, 64 wide) and Llama-3-8B's (32, 8, 128)."""
    g = _gen(1)
    (nq, nkv, d), B, t, slots = heads, 3, 4, 64
    if strided_slots:  # one column of a wider slot table (a head's draft step): a strided view
        t = 1
    qkv = torch.randn(B, t, (nq + 2 * nkv) * d, generator=g).to(DEV).to(dtype)
    ang = torch.randn(B, t, 1, d // 2, generator=g).to(DEV)
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    wsl = torch.randperm(slots, generator=g).to(DEV)[: B * 4].view(B, 4)
    wsl = wsl[:, 1:2] if strided_slots else wsl
    k1, v1 = (torch.zeros(slots, nkv, d, device=DEV, dtype=dtype) for _ in range(2))
    k2, v2 = (torch.zeros(slots, nkv, d, device=DEV, dtype=dtype) for _ in range(2))
    q1 = kernels.rope_write_kv(qkv, nq, nkv, d, cos, sin, wsl, k1, v1)
    qh, kh, vh = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
    q2 = kernels.rope_write_kv_torch(qh.reshape(B, t, nq, d), kh.reshape(B, t, nkv, d), vh.reshape(B, t, nkv, d),
                                     cos, sin, wsl, k2, v2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(q1.float(), q2.float(), atol=tol, rtol=tol)
    assert torch.allclose(k1.float(), k2.float(), atol=tol, rtol=tol)
    assert torch.equal(v1, v2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    g = _gen(2)
    gu = (torch.randn(5, 3, 2 * 1536, generator=g).to(DEV) * 3).to(dtype)
    out = kernels.silu_mul(gu, 1536)
    ref = kernels.silu_mul_torch(gu, 1536)
    assert out.shape == ref.shape == (5, 3, 1536)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,k", [((1, 8192), 8), ((2, 8, 8192), 8), ((3, 49152), 16), ((5, 1000), 4),
                                     ((4, 700), 32), ((2, 40), 40)])
def test_topk_logprobs_matches_torch(dtype, shape, k):
    """The fused top-k of a tree level: the same ids as ``log_softmax`` + ``topk`` (distinct
    random logits, so no ties), log-probs within float32 rounding; vocabularies that are not
    a multiple of the chunk; k past ``TOPK_MAX_K`` takes the torch path."""
    x = (torch.randn(*shape, generator=_gen(3)) * 4).to(DEV).to(dtype)
    lp, ids = kernels.topk_logprobs(x, k)
    ref_lp, ref_ids = kernels.topk_logprobs_torch(x, k)
    assert lp.shape == ids.shape == (*shape[:-1], k) and lp.dtype == torch.float32 and ids.dtype == torch.int64
    if dtype == torch.float32:  # bf16 logits tie often: compare the values chosen there
        assert torch.equal(ids, ref_ids)
    assert torch.allclose(lp, ref_lp, atol=1e-5, rtol=1e-5)
    assert torch.equal(x.float().gather(-1, ids), x.float().gather(-1, ref_ids))


def test_topk_logprobs_breaks_ties_by_the_lower_id():
    """Equal logits come out in id order (``torch.topk`` leaves it open): the tree a graph
    drafts does not depend on how a kernel happens to order them."""
    x = torch.zeros(2, 3000, device=DEV)
    x[:, [2999, 5, 1500, 1024]] = 1.0
    _, ids = kernels.topk_logprobs(x, 6)
    assert ids.tolist() == [[5, 1024, 1500, 2999, 0, 1]] * 2


@pytest.mark.parametrize("shape,k", [((1, 64), 8), ((3, 200), 31), ((2, 5000), 32), ((2, 40), 33)])
def test_topk_keeps_a_stable_sorts_order(shape, k):
    """The fused top-k of a tree's frontiers and nodes (raw values): exactly a stable
    descending sort's first k, ties included (scores made of few distinct values), and
    never an index twice even among -inf values."""
    from speculum.proposers.tree import topk_stable
    x = torch.randint(0, 6, shape, generator=_gen(5)).float().to(DEV)
    x[..., ::7] = float("-inf")
    v, i = kernels.topk(x, k)
    rv, ri = topk_stable(x, k)
    assert torch.equal(i, ri) and torch.equal(v, rv)
    assert all(len(set(row)) == k for row in i.reshape(-1, k).tolist())
    y = torch.full((2, 50), float("-inf"), device=DEV)  # every value -inf: still distinct indices
    assert kernels.topk(y, 10)[1].tolist() == [list(range(10))] * 2


def _random_tree(B: int, N: int, V: int, seed: int, match: float = 0.6):
    """(argmax [B, N+1], node tokens [B, N], parents [B, N]): random parents (earlier nodes
    or the root), tokens that drafted the target's argmax after their parent with
    probability ``match``, some missing nodes (-1)."""
    g = _gen(seed)
    parents = torch.full((B, N), -1, dtype=torch.int64)
    for i in range(1, N):
        parents[:, i] = torch.randint(-1, i, (B,), generator=g)
    am = torch.randint(0, V, (B, N + 1), generator=g)
    tokens = torch.where(torch.rand(B, N, generator=g) < match, am.gather(1, parents + 1),
                         torch.randint(0, V, (B, N), generator=g))
    tokens = torch.where(torch.rand(B, N, generator=g) < 0.05, -1, tokens)
    return am, tokens, parents


@pytest.mark.parametrize("N", [1, 2, 7, 16, 31, 63, 100, 127])
def test_greedy_tree_path_matches_the_eager_verifier(N):
    """The fused greedy tree verification gives the eager function's verdict (emitted
    tokens, accepted count, path) for random trees of every size it takes, trees where
    nearly everything matches (deep accepted paths) and where nothing does, and deep
    chains; 128 nodes or more are left to the eager function (None)."""
    from speculum.interfaces import Verdict
    from speculum.tree import TokenTree
    from speculum.verifiers.tree import greedy_path
    cases = [_random_tree(3, N, 16, N), _random_tree(2, N, 5, N + 1, match=0.97), _random_tree(2, N, 50, N + 2, 0.0)]
    chain = TokenTree.chain(2, N, torch.device("cpu")).parents
    am = torch.randint(0, 9, (2, N + 1), generator=_gen(N + 3))
    tokens = am[:, :N].clone()  # a chain that matches all the way, then one that stops halfway
    tokens[1, N // 2:] = (tokens[1, N // 2:] + 1) % 9
    cases.append((am, tokens, chain))
    for am, tokens, parents in cases:
        tree = TokenTree(parents)
        args = [x.to(DEV) for x in (am, tokens, tree.parents, tree.ancestors, tree.depth)]
        rows, eager = kernels.greedy_tree_path(*args), greedy_path(*args)
        assert rows is not None and rows.shape == (am.shape[0], 2 * N + 2)
        fused = Verdict.from_rows(rows, path_width=N)  # [count | tokens | path]
        for a, b in zip((fused.token_ids, fused.num_accepted, fused.path), eager):
            assert torch.equal(a, b), (a, b)
        assert fused.packed() is rows
    assert max(eager[1].tolist()) > 0 or N == 1
    big = _random_tree(1, 128, 5, 0)
    tree = TokenTree(big[2])
    assert kernels.greedy_tree_path(*[x.to(DEV) for x in (big[0], big[1], tree.parents, tree.ancestors,
                                                          tree.depth)]) is None


@pytest.mark.parametrize("k", [1, 2, 4, 7, 16, 63])
def test_greedy_chain_verdict_matches_the_eager_verifier(k):
    """The fused greedy chain verification gives the eager verdict (tokens emitted with -1
    after the first mismatch, accepted count) for rows that match all the way, not at all,
    up to a random point, with -1 padding (a row drafting fewer), and at random, as one
    tensor [count | tokens] per row; with no drafts, count 0 and the argmax."""
    from speculum.interfaces import Verdict
    from speculum.verifiers import greedy
    g = _gen(k)
    B = 9
    am = torch.randint(0, 7, (B, k + 1), generator=g)
    drafts = am[:, :k].clone()
    drafts[1] = (drafts[1] + 1) % 7                          # nothing matches
    for b in range(2, 5):                                    # a mismatch at a random position
        drafts[b, int(torch.randint(0, k, (1,), generator=g))] = 7
    drafts[5, k // 2:] = -1                                  # padded after k // 2 drafts
    drafts[6:] = torch.randint(0, 7, (B - 6, k), generator=g)  # random: mostly short prefixes
    am, drafts = am.to(DEV), drafts.to(DEV)
    rows = kernels.greedy_chain_verdict(am, drafts)
    assert rows is not None and rows.shape == (B, k + 2) and rows.dtype == torch.int64
    eager_acc = (drafts == am[:, :k]).cumprod(dim=1).sum(dim=1)
    eager_out = am.masked_fill(torch.arange(k + 1, device=DEV).view(1, -1) > eager_acc.view(B, 1), -1)
    assert torch.equal(rows[:, 0], eager_acc) and torch.equal(rows[:, 1:], eager_out)
    assert rows[0, 0] == k and rows[1, 0] == 0 and rows[5, 0] == k // 2
    none = kernels.greedy_chain_verdict(am[:, :1], drafts[:, :0])  # no drafts: the argmax, nothing accepted
    assert torch.equal(none[:, 0], torch.zeros(B, dtype=torch.int64, device=DEV)) and torch.equal(none[:, 1:], am[:, :1])
    # the verifier takes it (CUDA) or its twin (CPU): same verdict, packed as one tensor either way
    logits = torch.randn(B, k + 1, 11, generator=g)
    logits.scatter_(2, am.cpu().unsqueeze(-1), 10.0)
    for v in (greedy.greedy_verify(logits.to(DEV), drafts), greedy.greedy_verify(logits, drafts.cpu())):
        assert torch.equal(v.token_ids.cpu(), eager_out.cpu()) and torch.equal(v.num_accepted.cpu(), eager_acc.cpu())
        assert v.packed() is v.rows and torch.equal(v.rows[:, 1:], v.token_ids)
        assert Verdict(token_ids=v.token_ids.clone(), num_accepted=v.num_accepted, rows=v.rows).packed() is None


def test_fused_kernels_step_aside_where_a_gradient_is_wanted():
    """The kernels have no backward: with a gradient wanted they fall back to torch, so a
    head trained on the GPU trains every weight (the fifth and sixth sessions' EAGLE-3 runs
    left the head's MLP gate/up at their initial values through the fused ``silu_mul``)."""
    from speculum.backends.torch.heads import RMSNorm, arch_from_config
    from speculum.backends.torch.native.model import MLP
    from speculum.testing import tiny_config

    arch = arch_from_config(tiny_config().to_dict())
    mlp, norm = MLP(arch).to(DEV), RMSNorm(arch.hidden_size, 1e-5).to(DEV)
    x = torch.randn(2, 3, arch.hidden_size, device=DEV)
    mlp(norm(x)).square().sum().backward()  # x itself wants no gradient: the weights do
    for name, p in [*mlp.named_parameters(), *norm.named_parameters()]:
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name} got no gradient"
    with torch.no_grad():
        assert kernels.use_triton(x, norm.weight)  # drafting: the fused kernels
    assert not kernels.use_triton(x, norm.weight)
