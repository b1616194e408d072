"""N-gram drafting on the device from the verdict (``speculum_ngram.device``): the device
lookup drafts what the host lookup drafts (the request's own match, then the corpus's), and
an engine that drafts from the verdict (overlap forced on: a CPU engine does not overlap)
emits the target's tokens, verifies the same drafts at every step as one that drafts on
the host, and launches its next verify forward from the device when asked."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from speculum.sampling import SamplingParams
from speculum.testing import make_llm, run_with_an_abort_and_a_join, tiny_model_dir, verified_drafts
from speculum_ngram import device, kernels
from speculum_ngram.corpus import Corpus
from speculum_ngram.device import DeviceHistory, suffix_match
from speculum_ngram.proposer import SuffixIndex

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("seed", range(3))
def test_the_device_lookup_drafts_what_the_host_index_drafts(seed):
    """Random short sequences over a small vocabulary (many matches, ties, windows cutting
    them): every row's device draft (-1 padding stripped) equals SuffixIndex.draft."""
    rng = random.Random(seed)
    checked = found = 0
    for _ in range(150):
        B, n_min = rng.randint(1, 4), rng.randint(1, 3)
        n_max, k, window = rng.randint(n_min, 5), rng.randint(1, 6), rng.choice([0, 0, 3, 8, 20])
        seqs = [[rng.randint(0, 4) for _ in range(rng.randint(1, 40))] for _ in range(B)]
        W = max(map(len, seqs)) + 3
        hist = torch.full((B, W), 7, dtype=torch.int64)  # junk past each length: never read as tokens
        for b, s in enumerate(seqs):
            hist[b, : len(s)] = torch.tensor(s)
        d, f, _ = suffix_match(hist, torch.tensor([len(s) for s in seqs]), n_min, n_max, k, window)
        for b, s in enumerate(seqs):
            want = SuffixIndex(list(s), n_min, n_max).draft(k, window)
            assert [x for x in d[b].tolist() if x >= 0] == want and bool(f[b]) == bool(want), (s, n_min, n_max, k)
            checked, found = checked + 1, found + bool(want)
    assert found > checked // 3  # not vacuous: most rows find a match


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_the_device_corpus_drafts_what_the_host_corpus_drafts(dev):
    """DeviceCorpus.lookup against Corpus.draft for every suffix of random streams (the
    table's hashes wrap in int64 on both sides)."""
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 6, 3000)
    toks[rng.integers(0, 3000, 60)] = -1  # stream separators
    c = Corpus(toks, 1, 4, depth=5)
    ctxs = [rng.integers(0, 7, rng.integers(1, 9)).tolist() for _ in range(300)]
    suffix = torch.tensor([[x[-1 - j] if j < len(x) else -2 for j in range(4)] for x in ctxs])
    d, f = c.on(dev).lookup(suffix.to(dev), torch.tensor([len(x) for x in ctxs], device=dev), 5)
    d, f = d.cpu(), f.cpu()
    want = [c.draft(x, 5) for x in ctxs]
    assert [[t for t in row if t >= 0] for row in d.tolist()] == want
    assert f.tolist() == [bool(w) for w in want] and sum(map(bool, want)) > 100


def test_history_rows_are_reused_and_grow():
    h = DeviceHistory("cpu", capacity=4)
    seqs = [type("S", (), {"seq_id": i, "token_ids": list(range(i, i + 6))})() for i in range(3)]
    h.sync(seqs)
    assert h.buf.shape[1] >= 7 and [h.buf[h.row[i], :6].tolist() for i in range(3)] == [s.token_ids for s in seqs]
    h.release(1)
    h.sync([type("S", (), {"seq_id": 9, "token_ids": [5, 5]})()])
    assert h.row[9] == 1 and h.known[9] == 2 and h.buf[1, :2].tolist() == [5, 5]
    h.append(torch.tensor([0]), torch.tensor([6]), torch.tensor([[40, 41, 42]]), max_len=6)
    assert h.buf[0, 6:9].tolist() == [40, 41, 42]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("target"), "llama", seed=0)


def _strip(steps):
    return [[[t for t in row if t >= 0] for row in step] for step in steps]


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("mode", ["draft", "forward", "corpus"])
def test_an_engine_drafting_from_the_verdict_verifies_the_host_drafts(target, tmp_path, mode, dev, monkeypatch):
    """Overlap forced on (off for the host run; on CUDA the graphed runner), greedy, the
    overlap tests' schedule (an abort and a join drop steps drafted ahead): outputs equal plain decoding, each step verifies the drafts the
    host lookup makes (padding aside: a device draft always has k columns), the accepted
    count and the steps that drafted (the metrics) equal the run drafting on the host, and most steps were drafted from the
    verdict ("forward": the next verify forward launched from it too). The wrong variant,
    a device lookup that misses the verdict's last token (an off-by-one in the accepted
    count), verifies other drafts and accepts fewer."""
    kw = dict(device=dev, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    base = [torch.randint(3, 400, (5,), generator=g).tolist() for _ in range(4)]
    first = [o.token_ids for o in make_llm(target, **kw).generate([{"prompt_token_ids": b} for b in base], params)]
    # each prompt holds the target's own answer to its start, then the start again: lookup pays
    prompts = [{"prompt_token_ids": b + f + b} for b, f in zip(base, first)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if mode == "corpus":  # the answers in a corpus instead, the prompts without them
        np.save(tmp_path / "c.npy", np.array([t for s in zip(base, first) for t in (*s[0], *s[1], -1)], dtype=np.int32))
        spec["options"] = {"corpus": str(tmp_path / "c.npy")}
        prompts = [{"prompt_token_ids": b} for b in base]
    plain = [o.token_ids for o in make_llm(target, **kw).generate(prompts, params)]

    def run(from_verdict: bool, broken: bool = False):
        llm = make_llm(target, spec, **kw)
        llm.loop.overlap = from_verdict
        llm.loop.forward_from_verdict = from_verdict and mode == "forward"
        if broken:  # both ways of looking up: torch ops (CPU) and the kernel (CUDA)
            real, real_k = device.suffix_match, kernels.ngram_draft
            monkeypatch.setattr(device, "suffix_match", lambda h, L, *a: real(h, L - 1, *a))
            monkeypatch.setattr(kernels, "ngram_draft", lambda h, rows, base, v, *a: real_k(
                h, rows, base, torch.cat([(v[:, :1] - 1).clamp_min(0), v[:, 1:]], dim=1), *a))
        steps = verified_drafts(llm)  # (engines share the verifier: this run's steps only)
        n0 = len(steps)
        outs, drafts, acc = run_with_an_abort_and_a_join(llm, prompts, params)
        return outs, (drafts, acc), _strip(steps[n0:]), llm.loop

    host_outs, host_acc, host_steps, _ = run(False)
    outs, acc, steps, loop = run(True)
    assert outs == host_outs == {f"r{i}": plain[i] for i in (0, 2, 3)}
    # (drafting steps and accepted tokens: the device counts read with the verdict give the
    # host's metrics, though every row verified k positions)
    assert steps == host_steps and acc == host_acc and acc[1] > 10
    assert loop.drafted_from_verdict > len(steps) // 2, (loop.drafted_from_verdict, len(steps))
    assert (loop.forwards_from_verdict > len(steps) // 2) == (mode == "forward")
    _, bad_acc, bad_steps, _ = run(True, broken=True)
    assert bad_steps != host_steps and bad_acc[1] < host_acc[1]


#: ``TRITON_INTERPRET=1 SPECULUM_TRITON_INTERPRET=1`` on a CPU with triton: the kernel test
#: runs through Triton's interpreter
INTERPRET = os.environ.get("SPECULUM_TRITON_INTERPRET") == "1" and kernels.triton is not None


@pytest.mark.skipif(not (torch.cuda.is_available() and kernels.triton is not None) and not INTERPRET,
                    reason="needs CUDA with triton (or SPECULUM_TRITON_INTERPRET=1)")
@pytest.mark.parametrize("with_corpus", [False, True])
def test_the_kernel_drafts_what_the_torch_lookup_drafts(with_corpus):
    """kernels.ngram_draft (append the verdict, match, corpus) against DeviceHistory.append,
    suffix_match and DeviceCorpus.lookup, on random rows of a small vocabulary: the same
    drafts, and the same history written."""
    dev = "cpu" if INTERPRET else "cuda"
    rng = random.Random(0)
    gen = np.random.default_rng(0)
    toks = gen.integers(0, 6, 4000)
    toks[gen.integers(0, 4000, 80)] = -1
    corpus = Corpus(toks, 1, 4, depth=5).on(dev) if with_corpus else None
    for _ in range(40):
        R, n_min = rng.randint(1, 5), rng.randint(1, 2)
        n_max, k, window = 4 if with_corpus else rng.randint(n_min, 5), rng.randint(1, 5), rng.choice([0, 0, 6])
        q = k + 1
        lengths = [rng.randint(1, 300) for _ in range(R)]
        hist = torch.randint(0, 6, (R + 2, 512), dtype=torch.int64, device=dev)
        rows = torch.tensor(rng.sample(range(R + 2), R), device=dev)
        base = torch.tensor(lengths, device=dev)
        acc = torch.tensor([rng.randint(0, k) for _ in range(R)], device=dev)
        vrows = torch.cat([acc.view(R, 1), torch.randint(0, 6, (R, q), device=dev)], dim=1)
        h1, h2 = hist.clone(), hist.clone()
        got, counts = kernels.ngram_draft(h1, rows, base, vrows, n_min, n_max, k, window, corpus)
        h2[rows.view(R, 1), base.view(R, 1) + torch.arange(q, device=dev)] = vrows[:, 1:]
        L = base + acc + 1
        want, found, suffix = suffix_match(h2[rows, : max(lengths) + q], L, n_min, n_max, k, window)
        if corpus is not None:
            cd, _ = corpus.lookup(suffix, L, k)
            want = torch.where(found.view(R, 1), want, cd)
        assert torch.equal(h1, h2)
        assert got.tolist() == want.tolist(), (lengths, n_min, n_max, k, window)
        assert counts.tolist() == (want >= 0).sum(1).tolist()


def test_ngram_launches_the_next_forward_from_the_verdict_unless_told_otherwise(target):
    """from_verdict left out: the method's choice, "forward" for n-gram; a value given wins."""
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    default = make_llm(target, spec).loop
    assert default.from_verdict and default.forward_from_verdict
    draft = make_llm(target, {**spec, "from_verdict": "draft"}).loop
    assert draft.from_verdict and not draft.forward_from_verdict
    assert not make_llm(target, {**spec, "from_verdict": "off"}).loop.from_verdict
