"""A fault-injection soak of the engine: nothing lost, nothing stuck, nothing leaked.

Thousands of requests of random prompt and output lengths (up to and past
``max_model_len``), random aborts at every stage (waiting, just admitted, mid-decode),
a proposer that randomly raises (for the batch or for one row) or returns malformed
drafts, KV budgets from tiny to the exact edge (forcing preemption), and mixed greedy and
sampled requests. After every step it checks that no KV block is leaked or held twice in
any cache group (target, draft model, draft head) and that only running requests hold
any; at the end, that every request finished exactly once and that every greedy request
that completed equals plain decoding of the same prompt.

``speculum bench soak`` runs it (``--server``: the same through the HTTP server, with
clients that disconnect at random, checking that ``/metrics`` equals the sum of the
per-request figures). The test suite runs a short version on the CPU.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any, Callable

import attrs
import torch

from speculum.errors import RequestError, RowError
from speculum.interfaces import Draft


@attrs.define
class SoakStats:
    requests: int = 0
    rejected: int = 0  # refused at add_request (prompt too long...)
    finished: dict = attrs.field(factory=dict)  # finish reason -> count
    aborts: dict = attrs.field(factory=dict)  # stage -> count
    faults: dict = attrs.field(factory=dict)  # kind -> injected
    preemptions: int = 0
    steps: int = 0
    greedy_completed: int = 0
    greedy_identical: int = 0
    leaked_blocks: int = 0
    lost: int = 0
    duplicated: int = 0
    seconds: float = 0.0

    def count(self, d: dict, key: str, n: int = 1) -> None:
        d[key] = d.get(key, 0) + n


class FaultInjector:
    """Wraps a proposer; with probability ``rate`` per call it raises for the batch, raises
    a :class:`RowError` for one row, or returns a malformed draft (wrong shape, token ids
    outside the vocabulary, NaN probabilities). Everything else is passed through."""

    KINDS = ("raise", "row", "shape", "vocab", "nan_probs")

    def __init__(self, inner, rate: float, rng: random.Random, stats: SoakStats, vocab_size: int):
        self.inner, self.rate, self.rng, self.stats, self.vocab = inner, rate, rng, stats, vocab_size
        self.hidden_layers = getattr(inner, "hidden_layers", ())
        if hasattr(inner, "add_request"):
            self.add_request = inner.add_request
            self.remove_request = inner.remove_request

    def propose(self, batch):
        kind = self.rng.choice(self.KINDS) if self.rng.random() < self.rate else None
        if kind:
            self.stats.count(self.stats.faults, kind)
        if kind == "raise":
            raise RuntimeError("injected: proposer failure")
        if kind == "row":
            raise RowError("injected: row failure", [self.rng.randrange(len(batch.seqs))])
        draft = self.inner.propose(batch)
        if kind == "shape":
            return Draft(token_ids=torch.zeros(len(batch.seqs) + 1, 1, dtype=torch.int64))
        if kind == "vocab":
            ids = draft.token_ids.clone()
            if ids.numel():
                ids[:, 0] = self.vocab + 7
            return Draft(token_ids=ids, probs=draft.probs, lengths=draft.lengths)
        if kind == "nan_probs" and draft.token_ids.shape[1]:
            B, k = draft.token_ids.shape
            probs = torch.full((B, k, self.vocab), float("nan"), device=draft.token_ids.device)
            return Draft(token_ids=draft.token_ids, probs=probs, lengths=draft.lengths)
        return draft

    def observe(self, feedback):
        self.inner.observe(feedback)


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    """A prompt of ``n`` tokens with some repetition (so n-gram lookup drafts too)."""
    period = rng.randrange(3, 24)
    base = [rng.randrange(3, vocab) for _ in range(period)]
    return [base[i % period] if rng.random() < 0.8 else rng.randrange(3, vocab) for i in range(n)]


def soak_engine(llm, *, num_requests: int, seed: int = 0, fault_rate: float = 0.05, abort_rate: float = 0.1,
                sampled_fraction: float = 0.3, max_concurrent: int = 24,
                reference: Callable[[list[int], int], list[int]] | None = None,
                progress: Callable[[str], Any] | None = None) -> SoakStats:
    """Drive ``llm`` with a random workload; check invariants after every step.

    ``reference(prompt, max_tokens)``: greedy output of plain decoding, to compare every
    completed greedy request with (None: no identity check).
    """
    from speculum.sampling import SamplingParams
    rng = random.Random(seed)
    stats = SoakStats()
    V, L = llm.target.vocab_size, llm.max_model_len
    if llm.proposer is not None:
        inj = FaultInjector(llm.proposer, fault_rate, rng, stats, V)
        llm.loop.proposer = inj
    reqs: dict[str, dict] = {}
    done: dict[str, Any] = {}
    plan_abort: dict[str, tuple[str, int]] = {}
    t0 = time.perf_counter()
    issued = 0
    while issued < num_requests or llm.has_unfinished_requests():
        # keep up to max_concurrent in flight; new ones arrive in bursts
        while issued < num_requests and llm.num_running + llm.num_waiting < max_concurrent and rng.random() < 0.7:
            rid = f"r{issued}"
            issued += 1
            n = rng.choice([rng.randrange(1, 24), rng.randrange(1, L // 2 + 1), rng.randrange(L - 24, L + 8)])
            prompt = random_prompt(rng, max(n, 1), V)
            max_tokens = rng.choice([rng.randrange(1, 40), rng.randrange(1, 2 * L)])
            greedy = rng.random() >= sampled_fraction
            params = SamplingParams(temperature=0.0 if greedy else rng.choice([0.7, 1.0]),
                                    top_k=0 if greedy else rng.choice([0, 20]), max_tokens=max_tokens,
                                    seed=None if greedy else rng.randrange(1 << 30), ignore_eos=True)
            stats.requests += 1
            try:
                llm.add_request(rid, {"prompt_token_ids": prompt}, params)
            except RequestError:
                stats.rejected += 1
                continue
            reqs[rid] = {"prompt": prompt, "params": params, "steps": 0}
            if rng.random() < abort_rate:
                plan_abort[rid] = (rng.choice(["waiting", "admitted", "decoding"]), rng.randrange(1, 12))
        # aborts at their stage
        for rid, (stage, after) in list(plan_abort.items()):
            seqs = llm._by_request.get(rid)
            if seqs is None:
                plan_abort.pop(rid)
                continue
            seq = seqs[0]
            running = seq in llm.scheduler.running
            hit = (stage == "waiting" and not running) or (stage == "admitted" and running and reqs[rid]["steps"] <= 1) \
                or (stage == "decoding" and running and reqs[rid]["steps"] >= after)
            if hit:
                llm.abort_request(rid)
                plan_abort.pop(rid)
                stats.count(stats.aborts, stage)
                if rid in done:
                    stats.duplicated += 1
                done[rid] = "abort"
        if not llm.has_unfinished_requests():
            continue
        before = llm.num_preemptions
        for out in llm.step(include_running=True):
            if out.request_id in reqs:
                reqs[out.request_id]["steps"] += 1
            if not out.finished:
                continue
            if out.request_id in done:
                stats.duplicated += 1
            done[out.request_id] = out
        stats.preemptions += llm.num_preemptions - before
        stats.steps += 1
        try:
            llm.scheduler.check()
        except AssertionError as exc:
            stats.leaked_blocks += 1
            raise AssertionError(f"after step {stats.steps}: {exc}") from exc
        if progress and stats.steps % 200 == 0:
            progress(f"step {stats.steps}: {len(done)}/{len(reqs)} requests done")
    stats.seconds = time.perf_counter() - t0
    for rid in reqs:
        if rid not in done:
            stats.lost += 1
    for rid, out in done.items():
        reason = out if isinstance(out, str) else out.finish_reason
        stats.count(stats.finished, reason)
        r = reqs[rid]
        if reference is not None and not isinstance(out, str) and r["params"].temperature == 0 \
                and reason in ("length", "stop"):
            stats.greedy_completed += 1
            stats.greedy_identical += out.token_ids == reference(r["prompt"], r["params"].max_tokens)
    for c in llm.scheduler.caches:  # everything came back
        stats.leaked_blocks += c.num_usable_blocks - c.num_free_blocks
    return stats


def plain_reference(model: str | None, max_model_len: int, **engine_kw) -> Callable[[list[int], int], list[int]]:
    """Greedy plain decoding of one prompt (cached), for the identity check."""
    from speculum.engine import LLM
    from speculum.sampling import SamplingParams
    llm = LLM(model, max_model_len=max_model_len, max_num_seqs=1, **engine_kw)
    cache: dict = {}

    def ref(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in cache:
            cache[key] = llm.generate({"prompt_token_ids": prompt},
                                      SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0].token_ids
        return cache[key]
    return ref


# ------------------------------------------------------------------------------ CLI
def add_parser(sub) -> None:
    p = sub.add_parser("soak", help="fault-injection soak: random requests, aborts, proposer faults, tight KV")
    p.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--method", action="append", default=[], metavar="JSON",
                   help="speculative config to soak (repeatable; default: ngram k=4)")
    p.add_argument("--num-requests", type=int, default=2000, help="requests per method")
    p.add_argument("--max-model-len", type=int, default=256, help="context limit (prompts go past it)")
    p.add_argument("--kv-blocks", type=int, default=0,
                   help="usable KV blocks per cache group (0: the exact edge, one max-length sequence)")
    p.add_argument("--fault-rate", type=float, default=0.05, help="probability a propose call is sabotaged")
    p.add_argument("--abort-rate", type=float, default=0.1, help="probability a request is aborted")
    p.add_argument("--max-num-seqs", type=int, default=16, help="max_num_seqs of the engine")
    p.add_argument("--dtype", default="float32", help="float32 keeps the identity check exact")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload")
    p.add_argument("--server", action="store_true",
                   help="soak the HTTP server instead: streamed clients that disconnect at random")
    p.add_argument("--concurrency", type=int, default=64, help="--server: requests in flight")
    p.add_argument("--json", default="results/bench_soak.json", help="where the JSON goes")
    p.set_defaults(func=run)


def _engine(args, cfg, blocks: int):
    from speculum.engine import LLM
    probe = LLM(args.model, cfg, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs)
    plan = probe.backend.plan
    if not blocks:
        from speculum.kv import blocks_for
        blocks = blocks_for(args.max_model_len + plan.overshoot, plan.block_size)
    budget = (blocks + 1) * sum(plan.bytes_per_block.values())
    del probe
    return LLM(args.model, cfg, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
               max_num_seqs=args.max_num_seqs, kv_cache_memory=budget)


def run(args) -> int:
    import sys
    configs = [json.loads(m) for m in args.method] or [{"method": "ngram", "num_speculative_tokens": 4}]
    if args.server:
        from speculum.bench.soak_server import run_server_soak
        report = run_server_soak(args, configs)
    else:
        ref = plain_reference(args.model, args.max_model_len, dtype=args.dtype, device=args.device)
        report = {"mode": "engine", "runs": []}
        for cfg in configs:
            llm = _engine(args, cfg, args.kv_blocks)
            print(f"soak: {json.dumps(cfg)}, {args.num_requests} requests, {llm.backend.plan.usable_blocks} usable "
                  "KV blocks", file=sys.stderr, flush=True)
            st = soak_engine(llm, num_requests=args.num_requests, seed=args.seed, fault_rate=args.fault_rate,
                             abort_rate=args.abort_rate, reference=ref,
                             progress=lambda m: print(f"   {m}", file=sys.stderr, flush=True))
            report["runs"].append({"config": cfg, **attrs.asdict(st)})
            del llm
    print(table(report))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    bad = any(r["lost"] or r["duplicated"] or r["leaked_blocks"] or r.get("greedy_identical") != r.get(
        "greedy_completed") or r.get("metrics_mismatch") for r in report["runs"])
    return 1 if bad else 0


def table(report: dict) -> str:
    head = (f"{'method':<28}{'requests':>9}{'rejected':>9}{'aborts':>7}{'faults':>7}{'preempt':>8}{'errors':>7}"
            f"{'leaked':>7}{'lost':>5}{'dup':>4}{'greedy same':>13}{'s':>7}")
    lines = [head, "-" * len(head)]
    for r in report["runs"]:
        cfg = r["config"]
        name = f"{cfg.get('method')}(k={cfg.get('num_speculative_tokens')})" if cfg else "none"
        lines.append(f"{name:<28}{r['requests']:>9}{r['rejected']:>9}{sum(r['aborts'].values()):>7}"
                     f"{sum(r['faults'].values()):>7}{r['preemptions']:>8}{r['finished'].get('error', 0):>7}"
                     f"{r['leaked_blocks']:>7}{r['lost']:>5}{r['duplicated']:>4}"
                     f"{r['greedy_identical']:>6}/{r['greedy_completed']:<6}{r['seconds']:>7.0f}")
    return "\n".join(lines)
