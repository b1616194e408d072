"""The CUDA-graph helper's replay path, on the CPU.

A stand-in graph re-runs the captured function into the outputs it returned at capture
(what a real replay does in place), so the native runner's and the draft heads' graphed
paths (staging buffers, metadata layout, static inputs, bucketed shapes) are checked
against their eager paths without a GPU. The capture itself (side-stream warm-up,
shared pool) needs one: tests/test_trees_cuda.py and tests/test_heads_cuda.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from speculum.backends.torch import TorchBackend
from speculum.backends.torch.graphs import GraphPool, StaticGraph
from speculum.backends.torch.heads import (HeadDecoderLayer, HeadDraftGraphs, HeadKVCache, HeadTreeGraphs, Rope,
                                           arch_from_config, init_layer)
from speculum.interfaces import ForwardOutput
from speculum.tree import TokenTree, TreeSpec


class _Event:
    made: list["_Event"] = []

    def __init__(self):
        self.synced = 0
        _Event.made.append(self)

    def record(self, stream=None):
        pass

    def synchronize(self):
        self.synced += 1


def _copy_into(dst, src) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, dict):
        for key in dst:
            _copy_into(dst[key], src[key])
    elif isinstance(dst, (tuple, list)):
        for a, b in zip(dst, src):
            _copy_into(a, b)


class _Replay:
    """Stands for a captured graph: a replay runs the function into its first outputs."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self):
        with torch.inference_mode():
            _copy_into(self.out, self.fn())


@pytest.fixture
def emulated_graphs(monkeypatch):
    """GraphPool.capture without CUDA; returns the list of captured functions."""
    captured = []

    def capture(self, fn, meta, staging=1, warmup=2):
        with torch.inference_mode():
            for _ in range(warmup):
                fn()
            out = fn()
        captured.append(fn)
        return StaticGraph(_Replay(fn, out), out, meta, staging)

    _Event.made.clear()
    monkeypatch.setattr(GraphPool, "capture", capture)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    return captured


def test_staging_buffers_take_turns_and_wait_for_their_last_copy(emulated_graphs):
    meta = torch.zeros(3, dtype=torch.int64)
    graph = GraphPool().capture(lambda: meta * 2, meta, staging=2)
    seen = []
    for step in range(5):
        host = graph.host()
        seen.append(host.ctypes.data)
        host[:] = step
        graph.upload()
        assert graph.replay().tolist() == [2 * step] * 3
    assert seen[0] == seen[2] == seen[4] != seen[1] == seen[3]
    # steps 2, 3 and 4 reuse a buffer: each waits for that buffer's previous copy once
    assert [e.synced for e in _Event.made] == [1, 1, 1, 0, 0]


def _runner(path, graphs: bool):
    backend = TorchBackend(device="cpu", dtype="float32", runner="native", block_size=4)
    runner = backend.load_model(path, "target", max_model_len=128)
    backend.plan_memory(128)
    runner.cuda_graphs = graphs  # on the CPU only with emulated graphs
    return runner


def test_graphed_inputs_with_last_tokens_on_the_host_match_eager(tiny_llama, emulated_graphs):
    """The graphed forward's own input handling: each row's last token given on the host
    (``last_tokens``) with the drafts apart, ids past the vocabulary and -1 padding clamped
    inside the graph function, a batch smaller than its bucket, gives the eager forward's
    logits on the full inputs. (The loop passes ``last_tokens`` to the native runner in every
    step: the CPU greedy-identity tests run its eager twin.)"""
    eager, graphed = _runner(tiny_llama, False), _runner(tiny_llama, True)
    prompts = {0: [5, 17, 300, 42], 1: [9, 77, 120, 3, 8, 250], 2: [11, 12, 13]}
    for r in (eager, graphed):
        r.add_many(list(prompts), list(prompts.values()))
    V = eager.vocab_size
    drafts = torch.tensor([[4, V + 7, 9], [-1, -1, -1], [6, 2, -1]])
    last = [21, 22, 23]
    full = torch.cat([torch.tensor(last).view(3, 1), drafts.clamp(0, V - 1)], dim=1)
    a = eager.forward([0, 1, 2], full, [4, 1, 3])
    b = graphed.forward([0, 1, 2], drafts, [4, 1, 3], last_tokens=last)
    for i, n in enumerate([4, 1, 3]):  # the valid columns of each row
        torch.testing.assert_close(b.logits[i, :n], a.logits[i, :n], rtol=1e-5, atol=1e-5)
    assert graphed._graphs and all(k[0] == 4 for k in graphed._graphs)  # batch 3 ran in bucket 4


def test_native_runner_replays_what_it_computes_eagerly(tiny_llama, emulated_graphs):
    eager, graphed = _runner(tiny_llama, False), _runner(tiny_llama, True)
    prompts = {0: [5, 17, 300, 42, 9], 1: [7, 8, 9], 2: list(range(20, 43))}
    for r in (eager, graphed):
        r.add_many(list(prompts), list(prompts.values()))
    gen = torch.Generator().manual_seed(0)
    chain = [([0, 1, 2], 3, None), ([0, 2], 1, None), ([1], 5, None), ([2, 0, 1], 4, None), ([0, 1], 3, None)]
    parents = torch.tensor([[-1, -1, 0, 0, 2], [-1, 0, 1, -1, 3], [-1, -1, -1, 1, 1]])
    trees = [([0, 1, 2], 6, parents), ([1, 2], 6, parents[1:]), ([0, 1, 2], 6, parents.flip(0))]
    for sids, q, tree_parents in chain + trees + chain:
        ids = torch.randint(0, eager.vocab_size, (len(sids), q), generator=gen)
        valid = [q if tree_parents is not None else q - (i % q) for i in range(len(sids))]
        for i, n in enumerate(valid):
            ids[i, n:] = -1  # padding ids, as the loop passes them: each path clamps them (the graph inside)
        tree = None if tree_parents is None else TokenTree(tree_parents)
        a = eager.forward(sids, ids, valid, hidden_layers=(1, -1), tree=tree)
        b = graphed.forward(sids, ids, valid, hidden_layers=(1, -1), tree=tree)
        # the graph computes each row's finiteness (the loop's NaN/inf check) with the logits
        assert a.finite is None and b.finite is not None
        assert torch.equal(b.finite, ForwardOutput.finite_of(b.logits)) and bool(b.finite.all())
        # ... and each position's argmax (what a greedy verifier reads)
        assert a.argmax is None and torch.equal(b.argmax, b.logits.argmax(dim=-1))
        for i, n in enumerate(valid):
            torch.testing.assert_close(b.logits[i, :n], a.logits[i, :n])
            for layer in (1, -1):
                torch.testing.assert_close(b.hidden_states[layer][i, :n], a.hidden_states[layer][i, :n])
        for i, (sid, n) in enumerate(zip(sids, valid)):  # accept some, roll back the rest
            keep = eager.length(sid) - n + (i + len(sids)) % (n + 1)
            eager.truncate(sid, keep)
            graphed.truncate(sid, keep)
    assert emulated_graphs and len(graphed._graphs) == len(emulated_graphs) >= 4
    assert any(key[-1] for key in graphed._graphs)  # tree verify graphs too
    nan, inf = float("nan"), float("inf")
    assert ForwardOutput.finite_of(torch.tensor([[[0.0, 1.0]], [[nan, 1.0]], [[-inf, 0.0]]])).tolist() == \
        [True, False, False]


def test_loop_hands_the_runners_argmax_to_the_verifier_for_raw_logits_only(tiny_llama, emulated_graphs,
                                                                          monkeypatch):
    """A graphed runner returns each position's argmax (``ForwardOutput.argmax``, made in its
    graph); the loop hands it to a verifier that takes it (the default one's greedy rows),
    except when a logits processor changed the logits (a repetition penalty here, which
    changes these outputs): either way the outputs are the eager engine's."""
    from speculum import LLM, SamplingParams
    from speculum.verifiers import greedy, sampled
    prompts = [{"prompt_token_ids": [5, 17, 300, 42, 9, 5, 17]}, {"prompt_token_ids": [7, 8, 9, 7, 8]}]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    penalised = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=5.0)
    kw = dict(speculative_config=spec, runner="native", max_num_seqs=2, device="cpu", dtype="float32")
    ref = LLM(str(tiny_llama), **kw)
    want = {n: [o.token_ids for o in ref.generate(prompts, p)] for n, p in (("plain", plain), ("pen", penalised))}
    assert want["plain"] != want["pen"]  # the raw logits' argmax would be wrong for the penalised rows
    llm = LLM(str(tiny_llama), **kw)  # on the CPU on a GPU machine too: the capture is emulated
    llm.target.cuda_graphs = True  # graphed forwards, run eagerly through the emulated capture
    seen = []

    def spy(logits, drafts, argmax=None):
        seen.append(argmax is not None)
        return greedy.greedy_verify(logits, drafts, argmax)
    monkeypatch.setattr(sampled, "greedy_verify", spy)
    assert [o.token_ids for o in llm.generate(prompts, plain)] == want["plain"]
    assert seen and all(seen) and llm.loop.use_runner_argmax
    seen.clear()
    assert [o.token_ids for o in llm.generate(prompts, penalised)] == want["pen"]
    assert seen and not any(seen)


ARCH = arch_from_config({"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "vocab_size": 61})


class _TinyHead(nn.Module):
    """A one-layer chain head: fc([embed(x_{t+1}); f_t]) -> decoder layer -> logits."""

    num_layers, num_kv_heads, head_dim = 1, ARCH.num_kv_heads, ARCH.head_dim

    def __init__(self):
        super().__init__()
        H = ARCH.hidden_size
        self.embed = nn.Embedding(ARCH.vocab_size, H)
        self.fc = nn.Linear(2 * H, H)
        self.layer = HeadDecoderLayer(ARCH)
        init_layer(self.layer, std=0.2)
        self.rope = Rope(ARCH)
        self.lm_head = nn.Linear(H, ARCH.vocab_size, bias=False)

    def features(self, hidden):
        return hidden[-1]

    def forward(self, feats, tokens, positions, ctx):
        h = self.fc(torch.cat([self.embed(tokens), feats], dim=-1))
        cos, sin = self.rope(positions, h.dtype)
        return self.layer(h, cos, sin, ctx)

    def logits(self, out):
        return self.lm_head(out)


@pytest.mark.parametrize("tree", [None, "dynamic", "static"])
def test_head_graphs_replay_what_they_compute_eagerly(emulated_graphs, tree):
    torch.manual_seed(0)
    head = _TinyHead().eval()
    spec = {None: None, "dynamic": TreeSpec.dynamic(3, 3, 8),
            "static": TreeSpec.static([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])}[tree]
    drafts = []
    for use_graphs in (False, True):
        cache = HeadKVCache("head", 1, ARCH.num_kv_heads, ARCH.head_dim, torch.float32, torch.device("cpu"),
                            max_model_len=256)
        if spec is None:
            graphs = HeadDraftGraphs(head, cache, 4, torch.float32, torch.device("cpu"), use_graphs=False)
        else:
            graphs = HeadTreeGraphs(head, cache, spec, torch.float32, torch.device("cpu"), use_graphs=False)
        graphs.use_graphs = use_graphs  # on the CPU only with emulated graphs
        gen = torch.Generator().manual_seed(1)
        out, added = [], set()
        for step, sids in enumerate([[0, 1, 2], [0, 1, 2], [1, 2], [0, 1, 2, 3], [3, 0], [0, 1, 2, 3]]):
            for sid in set(sids) - added:
                cache.add(sid)
                added.add(sid)
            counts = [1 + (step + i) % graphs.Q for i in range(len(sids))]
            feats = [torch.randn(n, ARCH.hidden_size, generator=gen) for n in counts]
            tokens = [torch.randint(0, ARCH.vocab_size, (n,), generator=gen).tolist() for n in counts]
            out.append(graphs.run(sids, feats, tokens, counts).clone())
            for i, (sid, n) in enumerate(zip(sids, counts)):  # keep the catch-up, drop the drafts
                cache.truncate(sid, cache.length(sid) - graphs.extra - i % 2)
        drafts.append(out)
    eager, graphed = drafts
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)
    assert len(emulated_graphs) >= 2  # batch buckets 4 and 2


def test_batches_past_the_largest_bucket_share_graphs(tiny_llama, emulated_graphs):
    """Past the largest batch bucket a batch rounds up to a multiple of it, so batch sizes
    that drift (requests ending and refilling a large batch) reuse a few graphs; a bucket of
    the size itself captured a graph for every size seen (the wrong variant: 3 graphs here)."""
    from speculum.backends.torch.graphs import BATCH_BUCKETS, bucket
    from speculum.backends.torch.native.runner import BATCH_BUCKETS as TARGET
    assert [bucket(n, TARGET) for n in (257, 300, 320, 321, 512, 513, 1025)] == [320, 320, 320, 384, 512, 1024, 1536]
    assert [bucket(n) for n in (256, 257, 600)] == [256, 512, 768]
    assert BATCH_BUCKETS[-1] == 256
    runner = _runner(tiny_llama, True)
    n = 300
    runner.add_many(list(range(n)), [[5 + i % 50, 7, 9] for i in range(n)])
    for B in (300, 290, 265):
        out = runner.forward(list(range(B)), torch.full((B, 1), 3), [1] * B)
        assert out.logits.shape[0] == B
    assert len(runner._graphs) == 1 and next(iter(runner._graphs))[0] == 320
