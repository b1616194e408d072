"""Helpers for tests of speculum and of plugins: tiny random models, real-model access.

Plugin authors can import these in their own test suites (like pytest's ``pytester``).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

import attrs
import torch

TINY_VOCAB = 512


TOKEN_PROMPTS = [{"prompt_token_ids": p} for p in ([5], [7, 9], [30, 31, 32, 30, 31, 32, 30], [10, 11, 12, 13, 14] * 4)]
"""Token-id prompts for tiny targets: one token, two, a repeating pattern (what n-gram and trained
heads draft well) and a longer repeat."""


def make_llm(target, spec=None, device: str = "cpu", **kw):
    """An fp32 engine (on the CPU unless ``device`` says otherwise) of the tiny model at ``target``
    with ``speculative_config`` ``spec`` and a small KV budget (16 MiB: the paged runner allocates
    all of it up front); ``kw`` goes to :class:`speculum.LLM`."""
    from speculum import LLM
    return LLM(str(target), spec, device=device, dtype="float32", kv_cache_memory=16 << 20, **kw)


@contextlib.contextmanager
def spinning_process(settle_s: float = 0.3) -> Iterator[None]:
    """Another process keeping one core busy (a Python loop) for the ``with`` block, started
    ``settle_s`` seconds before it: what a shared machine looks like to a load check."""
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(settle_s)
        yield
    finally:
        spin.kill()
        spin.wait()


def target_fixtures(num_layers: int = 2):
    """Module-scoped pytest fixtures ``(target, parts)`` for a plugin's ``conftest.py``: a tiny
    random Llama (:func:`tiny_model_dir`, seed 0, ``num_layers`` layers) and its
    :class:`~speculum.backends.torch.heads.TargetParts`. Use: ``target, parts = target_fixtures()``."""
    import pytest

    @pytest.fixture(scope="module")
    def target(tmp_path_factory):
        return tiny_model_dir(tmp_path_factory.mktemp("target"), "llama", seed=0, num_layers=num_layers)

    @pytest.fixture(scope="module")
    def parts(target):
        from speculum.backends.torch.heads import TargetParts
        return TargetParts.from_checkpoint(target)

    return target, parts


def tiny_config(arch: str = "llama", num_layers: int = 2, vocab_size: int = TINY_VOCAB, hidden: int = 64):
    """A small transformers config of the Llama family (``llama``, ``qwen2``, ``qwen3``, ``mistral``)."""
    from transformers import AutoConfig
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    if arch in ("qwen3",):
        common["head_dim"] = hidden // 4
    return AutoConfig.for_model(arch, **common)


def tiny_model_dir(path: Path, arch: str = "llama", seed: int = 0, num_layers: int = 2,
                   vocab_size: int = TINY_VOCAB, hidden: int = 64) -> Path:
    """Write a random tiny causal LM (config + safetensors, no tokenizer) to ``path``."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    cfg = tiny_config(arch, num_layers, vocab_size, hidden)
    model = AutoModelForCausalLM.from_config(cfg)
    # sharper logits than the default init so greedy decoding has clear winners
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(str(path))
    return Path(path)


def mt_bench_prompts(n: int | None = None) -> list[dict]:
    """The shipped MT-bench questions (:func:`speculum.datasets.mt_bench`)."""
    from speculum.datasets import mt_bench
    return mt_bench(n)


def token_prompts_file(path: Path, n: int = 80, vocab_size: int = TINY_VOCAB, seed: int = 0) -> Path:
    """A JSONL of random token-id prompts (2..19 tokens) for training on tiny models."""
    import random
    rng = random.Random(seed)
    rows = [{"source": "tiny", "prompt_token_ids": [rng.randrange(3, vocab_size) for _ in range(rng.randrange(2, 20))]}
            for _ in range(n)]
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def train_tiny(method: str, target: Path, workdir: Path, steps: int = 120, num_prompts: int = 64,
               max_tokens: int = 40, extra: tuple[str, ...] = ()) -> Path:
    """Train ``method`` (``speculum train``) on a tiny target in-process; returns the output dir.

    Seconds on a CPU: random token prompts, short answers, a few hundred steps. Plugin
    tests use it to get heads that agree with the target often, but not always.
    """
    from speculum.cli import main
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    prompts = token_prompts_file(workdir / "prompts.jsonl")
    out = workdir / method
    argv = ["train", method, "--model", str(target), "--prompts", str(prompts), "--num-prompts", str(num_prompts),
            "--max-tokens", str(max_tokens), "--steps", str(steps), "--batch-size", "8", "--device", "cpu",
            "--cache-dir", str(workdir / "distill"), "--out", str(out), "--eval-every", "0", "--save-every",
            str(steps), "--warmup", "10", *extra]
    if main(argv) != 0:
        raise RuntimeError(f"speculum {' '.join(argv)} failed")
    return out


def assert_training_starts_from(method: str, target: Path, checkpoint: Path, workdir: Path,
                                extra: tuple[str, ...] = ()) -> Path:
    """``speculum train METHOD --init-from CHECKPOINT --lr 0`` exports the checkpoint's weights
    unchanged (they are where training started, and nothing moved them); returns the output."""
    import torch

    from speculum.proposers.head_checkpoint import read_weights
    out = train_tiny(method, target, workdir, steps=2, num_prompts=16, max_tokens=16,
                     extra=(*extra, "--init-from", str(checkpoint), "--lr", "0", "--save-dtype", "bfloat16"))
    before, after = read_weights(checkpoint), read_weights(out)
    assert set(before) == set(after), set(before) ^ set(after)
    for name, w in before.items():
        assert torch.equal(w, after[name]), name
    return out


def assert_grown_head_drafts_as_before(make_llm, spec: dict, before: Path, grown: Path, new_outputs: Sequence[str],
                                       prompts, params, plain: list, workdir: Path):
    """A head grown by ``--init-from ... --lr 0`` (``grown``, from ``before``): every weight of
    ``before`` is in ``grown`` unchanged, the new part's output projections ``new_outputs`` (an
    ``o_proj`` and a ``down_proj``) are zero and the rest of it initialised (its ``q_proj``), and
    the engine ``make_llm(spec + {"model": ...})`` drafts exactly the tokens it drafted from
    ``before`` with outputs equal to ``plain``. The wrong variant, the same weights with those
    output projections random, drafts other tokens (so the comparison has power). Returns the
    engines for ``before`` and ``grown``."""
    import shutil

    from safetensors.torch import save_file

    from speculum.proposers.head_checkpoint import read_weights
    old, new = read_weights(before), read_weights(grown)
    for name, w in old.items():
        assert torch.equal(w.float(), new[name].float()), name
    assert not any(new[k].any() for k in new_outputs)
    assert new[new_outputs[0].replace("o_proj", "q_proj")].any()  # the rest of the new part is initialised

    def drafts(model: Path):
        llm = make_llm({**spec, "model": str(model)})
        seen = record_drafts(llm)
        outs = [o.token_ids for o in llm.generate(prompts, params)]
        return llm, outs, [d.tolist() for _, d in seen]

    base_llm, base_out, base_drafts = drafts(before)
    grown_llm, grown_out, grown_drafts = drafts(grown)
    assert grown_drafts == base_drafts and grown_out == base_out == plain
    wrong = Path(workdir) / "random_out"
    wrong.mkdir()
    weights = [f for f in grown.iterdir() if f.suffix == ".safetensors"]
    for f in grown.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, wrong / f.name)
    sd = dict(new)
    torch.manual_seed(0)
    for k in new_outputs:
        sd[k] = torch.randn_like(sd[k]) * 0.5
    save_file(sd, str(wrong / weights[0].name))
    assert drafts(wrong)[2] != base_drafts
    return base_llm, grown_llm


def record_drafts(llm) -> list:
    """Wrap ``llm.proposer.propose``; returns the list it appends (token rows, draft ids) to."""
    seen = []
    inner = llm.proposer.propose

    def propose(batch):
        d = inner(batch)
        # copies: the loop masks drafts past a request's room in place
        seen.append(([list(s.token_ids) for s in batch.seqs], d.token_ids.clone()))
        return d

    llm.proposer.propose = propose
    return seen


def static_output_buffers(runner) -> None:
    """Make ``runner.forward`` return its hidden states in buffers it reuses, one per shape
    (as a runner replaying CUDA graphs does): on a CPU, what a caller reads after the next
    forward then shows whether it copied them first."""
    inner, buffers = runner.forward, {}

    def forward(seq_ids, inputs, num_tokens, hidden_layers=(), **kw):
        out = inner(seq_ids, inputs, num_tokens, hidden_layers, **kw)
        states = {}
        for layer, h in out.hidden_states.items():
            buf = buffers.setdefault((layer, tuple(h.shape)), torch.empty_like(h))
            states[layer] = buf.copy_(h)
        return attrs.evolve(out, hidden_states=states)

    runner.forward = forward


class PrefillHidden:
    """Target hidden states of whole sequences from a fresh prefill (for rollback tests)."""

    def __init__(self, target: Path, layers, runner: str = "native"):
        from speculum.backends.torch import TorchBackend
        backend = TorchBackend(device="cpu", dtype="float32", runner=runner, kv_cache_memory=4 << 20)
        self.runner = backend.load_model(Path(target), role="target")
        backend.plan_memory(256)
        self.layers = tuple(layers)
        self._ids = iter(range(1_000_000, 2_000_000))

    def __call__(self, tokens: list[int]) -> dict:
        """{layer: [len(tokens), H]}"""
        sid = next(self._ids)
        out = self.runner.add(sid, tokens, hidden_layers=self.layers)
        self.runner.remove(sid)
        return out


def assert_drafts_equal_fresh_prefills(llm, target: Path, fresh, prompts, params, k: int, layers=(-1,)) -> None:
    """Every greedy draft ``llm`` makes for ``prompts`` equals what the proposer ``fresh`` (the
    same head, nothing fed yet) drafts for those rows from a fresh prefill of their whole
    sequences (the target's ``layers`` states): the state the live proposer carries across steps
    (caches cut back to the accepted tokens, rows joining) is the state of starting over."""
    from speculum.interfaces import ProposeBatch, SequenceView
    from speculum.sampling import SamplingBatch, SamplingParams
    drafts = record_drafts(llm)
    llm.generate(prompts, params)
    assert drafts
    prefill = PrefillHidden(target, layers)
    for n, (rows, live) in enumerate(drafts):
        views = [SequenceView(10_000 + 10 * n + i, toks, 1) for i, toks in enumerate(rows)]
        for v in views:
            fresh.add_request(v, hidden_states=prefill(v.token_ids[:-1]))
        sampling = SamplingBatch.from_params([SamplingParams(temperature=0)] * len(rows), [None] * len(rows))
        assert fresh.propose(ProposeBatch(views, k, sampling)).token_ids.tolist() == live.tolist()
        for v in views:
            fresh.remove_request(v.seq_id)


def mt_bench_chat_prompts(n: int) -> list[list[dict]]:
    """The first turn of one MT-bench question per category (first ``n`` categories), as chat."""
    rows, seen = [], set()
    for r in mt_bench_prompts():
        if r["category"] not in seen:
            seen.add(r["category"])
            rows.append([{"role": "user", "content": r["turns"][0]}])
    return rows[:n]


def check_shipped_heads(root: Path, max_bytes: int = 25 << 20, shared_shape: tuple[int, int] = (49152, 576)) -> int:
    """Assert every head shipped under ``root`` is small and stores no copy of the target's
    embedding / LM head (``shared_shape``); returns how many heads were checked."""
    from safetensors import safe_open
    n = 0
    for cfg in sorted(Path(root).glob("*/config.json")):
        meta = json.loads(cfg.read_text()).get("speculum", {})
        assert meta.get("method") and meta.get("target", {}).get("embed_abs_mean"), f"{cfg}: no speculum metadata"
        assert meta.get("training", {}).get("command", "").startswith("speculum train"), f"{cfg}: no training command"
        for f in cfg.parent.glob("*.safetensors"):
            assert f.stat().st_size < max_bytes, f"{f} is {f.stat().st_size / 2**20:.1f} MiB"
            with safe_open(str(f), "pt") as h:
                for k in h.keys():
                    assert tuple(h.get_slice(k).get_shape()) != shared_shape, f"{f}: {k} copies the target's matrix"
        n += 1
    return n


_BASELINES: dict = {}


def default_model_baseline(num_prompts: int, max_tokens: int) -> list:
    """Greedy outputs of the default model (fp32, CPU, no speculation) on
    :func:`mt_bench_chat_prompts`; computed once per process and shared by test modules."""
    key = (num_prompts, max_tokens)
    if key not in _BASELINES:
        from speculum.engine import LLM
        from speculum.sampling import SamplingParams
        llm = LLM(dtype="float32", device="cpu", max_num_seqs=num_prompts)
        _BASELINES[key] = llm.generate(mt_bench_chat_prompts(num_prompts),
                                       SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return _BASELINES[key]


def assert_shipped_head_lossless(method: str, baseline: list, num_prompts: int, max_tokens: int, k: int = 4,
                                 tree: dict | None = None, options: dict | None = None):
    """Greedy output with ``method``'s shipped head on the default model (fp32, CPU) equals
    ``baseline`` (:func:`default_model_baseline`), and the head's drafts are accepted.
    ``tree``: tree keys of the speculative config (e.g. :data:`TREE_CONFIGS` entries)
    instead of a chain of ``k``; ``options``: the method's options."""
    from speculum.engine import LLM
    from speculum.sampling import SamplingParams
    spec = {"method": method, **(tree if tree is not None else {"num_speculative_tokens": k}),
            **({"options": options} if options else {})}
    llm = LLM(speculative_config=spec, dtype="float32", device="cpu", max_num_seqs=num_prompts)
    outs = llm.generate(mt_bench_chat_prompts(num_prompts),
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    assert [o.token_ids for o in outs] == [b.token_ids for b in baseline]
    m = llm.metrics
    assert m.num_emitted_tokens == num_prompts * max_tokens
    assert m.num_accepted_tokens > 0 and m.mean_acceptance_length > 1.05, m.as_dict()  # it drafts for this target


def use_static_chain_drafts(llm):
    """Give a chain-head engine's proposer the static greedy drafting function, run eagerly:
    what a GPU replays as a CUDA graph (a CPU engine drafts chains with the eager loop).
    Returns the function's object."""
    from speculum.backends.torch.heads import HeadDraftGraphs
    p = llm.proposer
    p.graphs = HeadDraftGraphs(p.head, p.cache, llm.speculative_config.num_speculative_tokens, p.dtype, p.device,
                               use_graphs=False)
    return p.graphs


def assert_static_draft_matches_eager(make_llm, spec: dict, prompts, params) -> None:
    """A chain-head method's static-shape greedy draft (what a GPU replays as a CUDA graph)
    proposes exactly the eager loop's drafts, step for step, and output equals plain
    decoding. ``make_llm(spec)`` builds an engine on the CPU (``spec=None``: no speculation)."""
    import torch

    runs = []
    for static in (False, True):
        llm = make_llm(spec)
        calls = []
        if static:
            graphs = use_static_chain_drafts(llm)
            inner = graphs.run
            graphs.run = lambda *a: calls.append(1) or inner(*a)
        seen = record_drafts(llm)
        outs = llm.generate(prompts, params)
        runs.append(([o.token_ids for o in outs], seen, len(calls)))
    (eager_out, eager_drafts, _), (static_out, static_drafts, n_static) = runs
    assert n_static > 10, n_static  # the static function drafted the steps after each request's first
    assert static_out == eager_out == [o.token_ids for o in make_llm(None).generate(prompts, params)]
    assert len(static_drafts) == len(eager_drafts)
    for (rows_a, ids_a), (rows_b, ids_b) in zip(eager_drafts, static_drafts):
        assert rows_a == rows_b
        assert torch.equal(ids_a, ids_b)


def graphed_vs_eager_drafts(target: Path, spec: dict, prompts, params, device: str = "cuda"):
    """The same speculative engine with and without CUDA graphs (fp32, 4 sequences): both
    outputs must equal plain decoding and the graphed engine must have captured a draft
    graph. Returns ({False: eager engine, True: graphed engine}, per draft step whether the
    two drafted the same tokens)."""
    import torch

    from speculum.engine import LLM
    ref = LLM(str(target), device=device, dtype="float32", max_num_seqs=4).generate(prompts, params)
    llms, runs = {}, {}
    for graphs in (False, True):
        llm = llms[graphs] = LLM(str(target), spec, device=device, dtype="float32", max_num_seqs=4,
                                 cuda_graphs=graphs)
        runs[graphs] = record_drafts(llm)
        assert [o.token_ids for o in llm.generate(prompts, params)] == [r.token_ids for r in ref]
    assert llms[True].proposer.graphs._graphs, "no draft graph was captured"
    assert len(runs[False]) == len(runs[True])
    return llms, [torch.equal(a[1].cpu(), b[1].cpu()) for a, b in zip(runs[False], runs[True])]


# ------------------------------------------------------------------------- token trees
#: tree configs for tests: dynamic (EAGLE-2), static, and a dynamic tree that is a chain
TREE_CONFIGS = {
    "dynamic": {"tree_topk": 3, "tree_depth": 3, "num_draft_tokens": 8},
    "static": {"speculative_token_tree": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]},
    "chain": {"tree_topk": 1, "tree_depth": 3, "num_draft_tokens": 4},
}


def run_with_an_abort_and_a_join(llm, prompts: list, params) -> tuple[dict, int, int]:
    """The schedule of the overlap tests: three requests, four steps, the second aborted,
    three steps, a fourth joining, then to the end (an abort and a join each drop a step
    run or drafted ahead). Returns ({request id: output token ids}, drafts, accepted)."""
    outs: dict = {}
    for i in range(3):
        llm.add_request(f"r{i}", prompts[i], params)
    for _ in range(4):
        llm.step()
    llm.abort_request("r1")
    for _ in range(3):
        llm.step()
    llm.add_request("r3", prompts[3], params)
    while llm.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0].token_ids for o in llm.step() if o.finished})
    llm.scheduler.check()
    return outs, llm.stats.num_drafts, llm.stats.num_accepted_tokens


def verified_drafts(llm) -> list:
    """The list to which each verify step of ``llm``'s loop appends the draft token ids it
    checks ([B, k] as lists): a wrapper on the verifier, installed on the first call."""
    verifier = llm.loop.verifier
    if not hasattr(verifier, "_seen"):
        seen, inner = [], verifier.verify

        def verify(logits, draft, sampling, **kw):
            seen.append(draft.token_ids.tolist())
            return inner(logits, draft, sampling, **kw)

        verifier.verify, verifier._seen = verify, seen
    return verifier._seen


def assert_drafting_ahead_changes_nothing(build, prompts: list, params, plain: list | None = None):
    """The overlap tests' check: ``build(overlap)`` makes an engine (a CPU engine does not
    overlap unless told: ``llm.loop.overlap = overlap``); :func:`run_with_an_abort_and_a_join`
    runs once with overlap and once without. Outputs must be equal (and equal ``plain``,
    plain decoding's token ids per prompt, for the requests that finish), drafts and
    accepted tokens equal with some accepted, more than 10 steps used ahead and at least 2
    dropped, and every step verified the same draft tokens. Returns (drafts, accepted)
    without overlap and the overlapped run's loop, for a wrong variant to differ from and
    the caller's own checks."""
    llm, other = build(True), build(False)
    steps_on, steps_off = verified_drafts(llm), verified_drafts(other)
    on, drafts_on, acc_on = run_with_an_abort_and_a_join(llm, prompts, params)
    off, drafts_off, acc_off = run_with_an_abort_and_a_join(other, prompts, params)
    assert steps_on == steps_off and len(steps_on) > 10
    assert on == off
    if plain is not None:
        assert on == {f"r{i}": plain[i] for i in (0, 2, 3)}
    assert llm.loop.ahead_used > 10 and llm.loop.ahead_dropped >= 2
    assert (drafts_on, acc_on) == (drafts_off, acc_off) and acc_on > 0
    return (drafts_off, acc_off), llm.loop


def assert_overlap_changes_nothing(make_llm, target, spec: dict, prompts: list, params, max_num_seqs: int = 4):
    """:func:`assert_drafting_ahead_changes_nothing` for the engines ``make_llm(target, spec,
    max_num_seqs=...)`` with overlap forced on and off, against plain decoding
    (``make_llm(target)``). Returns what that function returns."""
    def build(overlap: bool):
        llm = make_llm(target, spec, max_num_seqs=max_num_seqs)
        llm.loop.overlap = overlap
        return llm
    plain = [o.outputs[0].token_ids for o in make_llm(target).generate(prompts, params)]
    return assert_drafting_ahead_changes_nothing(build, prompts, params, plain)


def reference_tree_paths(spec, topk) -> set[tuple[int, ...]]:
    """The token paths of the tree ``spec`` (a :class:`speculum.tree.TreeSpec`) drafted in
    plain Python: ``topk(path, width)`` gives (log-probs, token ids) of the ``width`` best
    children of the node reached by the token tuple ``path`` (``()`` = the root). Static
    trees follow their ranks; dynamic ones EAGLE-2 (expand the frontier's top-k, keep the
    top-k by summed log-prob as the next frontier, then the best nodes of all candidates,
    earlier candidates first on ties)."""
    if spec.is_static:
        tok: dict[tuple, tuple] = {}
        for ranks in spec.paths:
            prefix = tok[ranks[:-1]] if len(ranks) > 1 else ()
            _, ids = topk(prefix, ranks[-1] + 1)
            tok[ranks] = prefix + (int(ids[-1]),)
        return set(tok.values())
    K, order, cands = spec.topk, 0, []
    lp, ids = topk((), K)
    front = [(float(s), (int(t),)) for s, t in zip(lp, ids)]
    for s, p in front:
        cands.append((s, order, p))
        order += 1
    for _ in range(1, spec.depth):
        new = []
        for s, p in front:
            lp, ids = topk(p, K)
            new += [(s + float(v), p + (int(t),)) for v, t in zip(lp, ids)]
        for s, p in new:
            cands.append((s, order, p))
            order += 1
        front = sorted(new, key=lambda x: -x[0])[:K]
    return {p for _, _, p in sorted(cands, key=lambda x: (-x[0], x[1]))[: spec.num_nodes]}


def tree_token_paths(tokens: list[int], parents: list[int]) -> set[tuple[int, ...]]:
    """The token path of every node of one drafted tree (nodes with token -1 left out)."""
    out: list[tuple] = []
    for t, p in zip(tokens, parents):
        out.append((out[p] if p >= 0 else ()) + (t,))
    return {p for p, t in zip(out, tokens) if t >= 0}


def record_trees(llm) -> list:
    """Wrap ``llm.proposer.propose``; returns the list it appends (token rows, tokens,
    parents) to, for drafts that carry a tree."""
    seen = []
    inner = llm.proposer.propose

    def propose(batch):
        d = inner(batch)
        if d.tree is not None:
            seen.append(([list(s.token_ids) for s in batch.seqs], d.token_ids.tolist(), d.tree.parents.tolist(),
                         list(d.lengths) if d.lengths is not None else None))
        return d

    llm.proposer.propose = propose
    return seen


def tight_kv_options(bytes_per_token: int, tokens: int, block_size: int = 4) -> dict:
    """Engine options for a KV budget of about ``tokens`` tokens (all cache groups
    together cost ``bytes_per_token``): small enough to force preemption."""
    return dict(block_size=block_size, kv_cache_memory=bytes_per_token * tokens)


def assert_drafts_from_verdict_under_preemption(target, spec: dict, kv_cache_memory: int,
                                                forward_from_verdict: bool = False) -> None:
    """Overlap forced on (a CPU engine does not overlap) with a KV budget that forces
    preemption: eight repeating prompts of 6-18 tokens x 40 greedy tokens, rows leave and
    come back while their chains or trees are drafted from the device verdict
    (:class:`~speculum.interfaces.VerdictDrafter`; a chain head gets its static function,
    :func:`use_static_chain_drafts`); the scheduler's books balance, more than ten steps
    drafted from the verdict, and outputs equal plain decoding. ``forward_from_verdict``: a
    chain's next verify forward is launched from the verdict too (more than ten of them used,
    some dropped)."""
    from speculum.engine import LLM
    from speculum.sampling import SamplingParams
    prompts = [{"prompt_token_ids": [3 + i, 17, 29, 41, 3 + i, 17] * (1 + i % 3)} for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = LLM(str(target), spec, device="cpu", dtype="float32", kv_cache_memory=kv_cache_memory, max_model_len=256,
              max_num_seqs=8)
    llm.loop.overlap = True
    if llm.speculative_config.tree is None and getattr(llm.proposer, "graphs", True) is None:
        use_static_chain_drafts(llm)
    llm.loop.forward_from_verdict = forward_from_verdict
    outs = llm.generate(prompts, params)
    llm.scheduler.check()
    assert llm.num_preemptions > 0 and llm.loop.drafted_from_verdict > 10
    if forward_from_verdict:
        assert llm.loop.forwards_from_verdict > 10, llm.loop.forwards_from_verdict
    plain = LLM(str(target), device="cpu", dtype="float32", kv_cache_memory=16 << 20, max_num_seqs=8).generate(
        prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


def assert_tree_greedy_lossless_under_preemption(target, spec: dict, bytes_per_token: int, tokens: int = 160):
    """Six 20-token prompts x 40 greedy tokens with a KV budget of about ``tokens`` tokens
    (``bytes_per_token`` for all cache groups together, fp32 on the CPU): sequences are
    preempted and recomputed, and the tree output still equals output without speculation."""
    import torch
    from speculum.engine import LLM
    from speculum.sampling import SamplingParams
    g = torch.Generator().manual_seed(2)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (20,), generator=g).tolist()} for _ in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = assert_tree_greedy_lossless(
        lambda sp_, **kw: LLM(str(target), sp_, device="cpu", dtype="float32", max_model_len=96,
                              **{"kv_cache_memory": 16 << 20, **kw}), spec, prompts, sp, max_num_seqs=6,
        **tight_kv_options(bytes_per_token, tokens))
    assert llm.num_preemptions > 0, "the budget was meant to force preemption"
    return llm


def assert_tree_greedy_lossless(make_llm, spec: dict, prompts, params, max_num_seqs: int = 2, **kw):
    """Greedy output with the tree config ``spec`` equals output without speculation
    (``make_llm(spec, **kw)`` builds an engine), trees were verified, and some of their
    nodes were accepted and some rejected. Returns the speculative engine."""
    base = make_llm(None, max_num_seqs=len(prompts)).generate(prompts, params)
    llm = make_llm(spec, max_num_seqs=max_num_seqs, **kw)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    m = llm.metrics
    assert m.num_tree_steps > 0 and m.num_tree_nodes == m.num_draft_tokens, m.as_dict()
    assert 0 < m.num_accepted_tokens < m.num_draft_tokens, m.as_dict()
    assert sum(m.acceptance_histogram) == m.num_steps and sum(m.accepted_per_position) == m.num_accepted_tokens
    # positions are depths: every tree reaches depth 1, none goes deeper than the config's
    depth = llm.speculative_config.tree.depth
    assert m.drafts_per_position[0] == m.num_drafts and len(m.drafts_per_position) <= depth, m.as_dict()
    assert all(a <= d for a, d in zip(m.accepted_per_position, m.drafts_per_position))
    return llm


class HeadPathReference:
    """A hidden-state head's best children at the end of any token path, computed the
    plain way: a fresh prefill of the target, the head's catch-up over it, then a chain of
    head steps through the path's tokens (own cache, no tree mask)."""

    def __init__(self, head, target: Path, layers):
        from speculum.backends.torch.heads import HeadKVCache
        p = next(head.parameters())
        self.head = head
        self.cache = HeadKVCache("reference", head.num_layers, head.num_kv_heads, head.head_dim, p.dtype, p.device,
                                 max_model_len=1024)
        self.prefill = PrefillHidden(target, layers)
        self._ids = iter(range(3_000_000, 4_000_000))

    def topk_fn(self, tokens: list[int]):
        """``topk(path, width)`` for :func:`reference_tree_paths`, after the sequence ``tokens``."""
        from speculum.backends.torch.heads import head_topk
        head, cache = self.head, self.cache
        with torch.inference_mode():
            feats = head.features(self.prefill(tokens[:-1]))  # [len - 1, H]
        nxt = torch.tensor([tokens[1:]], device=feats.device)  # x_{t+1} of each t

        def topk(path, width):
            sid = next(self._ids)
            cache.add(sid)
            n = feats.shape[0]
            with torch.inference_mode():
                pos, ctx = cache.prepare([sid], [n], n)
                h = head(feats.unsqueeze(0), nxt, pos, ctx)[0, -1]
                for t in path:
                    pos, ctx = cache.prepare([sid], [1], 1)
                    h = head(h.view(1, 1, -1), torch.tensor([[t]], device=h.device), pos, ctx)[0, 0]
                lp, ids = head_topk(head, h, width)
            cache.remove(sid)
            return lp.tolist(), ids.tolist()

        return topk


def assert_trees_follow_reference(seen: list, spec, topk_for, every: int = 3) -> int:
    """Every ``every``-th recorded tree (:func:`record_trees`) holds exactly the token paths
    of :func:`reference_tree_paths` with ``topk_for(sequence tokens)``; returns how many
    trees were compared."""
    n = 0
    for rows, tokens, parents, lengths in seen[::every]:
        for b, toks in enumerate(rows):
            if lengths is not None and lengths[b] == 0:
                continue
            want = reference_tree_paths(spec, topk_for(toks))
            assert tree_token_paths(tokens[b], parents[b]) == want, f"tree after {len(toks)} tokens"
            n += 1
    return n


def truth_table(prompts: list[dict], outputs: list[list[int]]) -> dict:
    """{(prompt ids, output so far): the rest of the output + 4 zeros}: what an oracle drafts from."""
    truth = {}
    for p, r in zip(prompts, outputs):
        for i in range(len(r) + 1):
            truth[(tuple(p["prompt_token_ids"]), tuple(r[:i]))] = list(r[i:]) + [0] * 4
    return truth


class TreeOracle:
    """A tree proposer for tests (register it through a plugin): a static tree of six nodes
    (:attr:`PATHS`, for ``speculative_token_tree``) whose branch through node 0 (odd calls:
    nodes 0, 2, 5) or node 1 (even calls: nodes 1, 4) holds the reference output's next
    tokens (:func:`truth_table`), its other nodes wrong tokens."""

    PATHS = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    PARENTS = [-1, -1, 0, 0, 1, 2]
    supports_trees = True
    kv_lookahead = 0

    def __init__(self, truth: dict, vocab_size: int = 512):
        self.truth, self.vocab, self.i = truth, vocab_size, 0

    def propose(self, batch):
        from speculum.interfaces import Draft
        from speculum.tree import TokenTree
        rows = []
        for s in batch.seqs:
            self.i += 1
            f = self.truth[(tuple(s.token_ids[:s.num_prompt_tokens]), tuple(s.token_ids[s.num_prompt_tokens:]))]
            w = [(t + 1) % self.vocab for t in f]
            rows.append([f[0], w[0], f[1], w[1], w[1], f[2]] if self.i % 2 else [w[0], f[0], w[1], w[1], f[1], w[2]])
        parents = torch.tensor([self.PARENTS] * len(rows), dtype=torch.int64)
        return Draft(token_ids=torch.tensor(rows, dtype=torch.int64), tree=TokenTree(parents, max_depth=3, max_children=2))

    def observe(self, feedback) -> None:
        pass


def proposer_plugin(name: str, proposer):
    """A plugin object registering ``proposer`` (one instance, for every engine) as method
    ``name``: ``LLM(..., plugins=[proposer_plugin("oracle", oracle)])``."""
    from speculum import hookimpl

    class Plugin:
        @hookimpl
        def speculum_register_proposers(self, register):
            register(name, lambda ctx: proposer)

    return Plugin()
