"""Host time per loop step: autoregressive, an EAGLE-3 chain and an EAGLE-3 token tree (and
``plain``: the head kept current on steps that do not draft).

By default the target is a tiny random Llama (4 layers, hidden 64, vocabulary 512) and the
EAGLE-3 head one trained on it here for a few seconds, on the CPU with one torch thread: the compute is
then negligible and a step's time is nearly all host (Python) work, the part that leaves a
GPU idle. ``--model default`` (SmolLM2-135M-Instruct, the shipped EAGLE-3 head) with
``--device cuda --dtype bfloat16`` gives the same table on a GPU.

For each config and batch size it prints ms per loop step (one engine step over every
running row): ``wall`` (the whole generate, engine and scheduler included, untimed),
``step`` (``DraftVerifyLoop.step`` alone) and, from a second run with the device
synchronised around each part (``speculum.bench.step_profile``), its split into draft,
verify and the rest (``host``). ``--cprofile N`` prints the N heaviest functions of one
more run (sorted by own time, then cumulative), the graphed parts left out off CUDA.

    OMP_NUM_THREADS=1 python scripts/host_step_profile.py [--batch-sizes 1,4] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

CONFIGS = {
    "ar": None,
    "chain": {"method": "eagle3", "num_speculative_tokens": 4},
    "tree": {"method": "eagle3", "tree_topk": 8, "tree_depth": 4, "num_draft_tokens": 32},
    # the head loaded and kept up to date, but every step plain (a load schedule of k = 0):
    # what a head costs the steps on which the cost model switched drafting off
    "plain": {"method": "eagle3", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": {"1-4096": 0}},
}


def tiny_target_and_head(work: Path) -> tuple[str, str]:
    """A tiny random target and an EAGLE-3 head trained on it for a few seconds
    (``speculum.testing.train_tiny``: it agrees with the target often, not always)."""
    import contextlib
    import os

    from speculum.testing import tiny_model_dir, train_tiny
    target = tiny_model_dir(work / "target", "llama", seed=0, num_layers=4)
    null = open(os.devnull, "w")  # left open: a logging handler made while training may keep it
    with contextlib.redirect_stderr(null), contextlib.redirect_stdout(null):
        head = train_tiny("eagle3", target, work, steps=300, extra=("--draft-vocab", "384"))
    return str(target), str(head)


def prompts_for(tiny: bool, n: int) -> list:
    if tiny:  # random token prompts like those the head was trained on (another seed)
        import random
        rng = random.Random(1)
        return [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(rng.randrange(4, 20))]} for _ in range(n)]
    from speculum.datasets import mt_bench
    return [q["turns"][0] if isinstance(q, dict) and "turns" in q else q for q in mt_bench(n)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="'tiny' (random, built here), 'default' (SmolLM2-135M) or a path")
    p.add_argument("--head", default=None, help="EAGLE-3 head directory (default: random for tiny, else shipped)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--configs", default="ar,chain,tree", help=f"comma separated, of {','.join(CONFIGS)}")
    p.add_argument("--batch-sizes", default="1,4")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--repeat", type=int, default=3, help="untimed runs per config; the fastest is reported")
    p.add_argument("--cprofile", type=int, default=0, metavar="N", help="print the N heaviest functions per config")
    p.add_argument("--dump", default=None, metavar="PREFIX", help="with --cprofile: write PREFIX.CONFIG.B.prof")
    p.add_argument("--no-overlap", action="store_true", help="LLM(overlap=False)")
    p.add_argument("--from-verdict", default="draft", choices=("off", "draft", "forward"),
                   help="the speculative config's from_verdict: what a step launches from the device verdict")
    p.add_argument("--critical", action="store_true",
                   help="also time the host's critical path: from the moment the verdict reaches the host to "
                        "the next launch of the head's drafting and of the target's forward (medians)")
    args = p.parse_args(argv)

    from speculum import LLM, SamplingParams
    from speculum.bench.step_profile import profile_steps

    work = Path(tempfile.mkdtemp(prefix="host_step_"))
    tiny = args.model == "tiny"
    if tiny:
        model, head = tiny_target_and_head(work)
        head = args.head or head
    else:
        model, head = (None if args.model == "default" else args.model), args.head
    torch.set_num_threads(args.threads)  # after training, which sets its own
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    print(f"device {args.device}, dtype {args.dtype}, torch threads {torch.get_num_threads()}, "
          f"max_tokens {args.max_tokens}, model {args.model}", flush=True)
    print(f"{'config':<8}{'batch':>6}{'steps':>7}{'tok/step':>9}{'wall ms':>9}{'step ms':>9}{'ungraph':>9}"
          f"{'draft':>8}{'verify':>8}{'host':>8}", flush=True)
    for name in args.configs.split(","):
        spec = CONFIGS[name]
        if spec is not None and head is not None:
            spec = {**spec, "model": head}
        if spec is not None:
            spec = {**spec, "from_verdict": args.from_verdict}
        llm = LLM(model, spec, device=args.device, dtype=args.dtype, threads=args.threads,
                  max_num_seqs=max(sizes), overlap=not args.no_overlap,
                  **({"kv_cache_memory": 64 << 20} if tiny else {}))
        _static_chain_drafts(llm)
        if not args.no_overlap:  # a CPU engine does not overlap its steps; a GPU's does: measure that host work
            llm.loop.overlap = True
        for B in sizes:
            prompts = prompts_for(tiny, B)
            llm.generate(prompts, params)  # warm-up (graphs, caches, allocator)
            best = None
            for _ in range(args.repeat):
                clock = _Clock(llm)
                try:
                    _sync(args.device)
                    t0 = time.perf_counter()
                    outs = llm.generate(prompts, params)
                    _sync(args.device)
                    wall = time.perf_counter() - t0
                finally:
                    clock.undo()
                n = clock.steps
                run = (wall * 1e3 / n, clock.step * 1e3 / n, clock.graphed * 1e3 / n, n,
                       sum(o.metrics.num_emitted_tokens for o in outs) / n)
                best = run if best is None or run[0] < best[0] else best
            crit = critical_path(llm, prompts, params) if args.critical else None
            split = profile_steps(llm, prompts, params)
            wall_ms, step_ms, graphed_ms, n, per = best
            print(f"{name:<8}{B:>6}{n:>7}{per:>9.2f}{wall_ms:>9.3f}{step_ms:>9.3f}{step_ms - graphed_ms:>9.3f}"
                  f"{split['draft_ms']:>8.3f}{split['verify_ms']:>8.3f}{split['host_ms']:>8.3f}", flush=True)
            if crit:
                print(f"    critical path, verdict on the host -> " + ", ".join(
                    f"{k} {v:.3f} ms" for k, v in crit.items()), flush=True)
            if args.cprofile:  # the loop steps' host work (graphed parts left out, see _Clock)
                prof = cProfile.Profile()
                clock = _Clock(llm, prof)
                prof.enable()
                try:
                    llm.generate(prompts, params)
                finally:
                    prof.disable()
                    clock.undo()
                if args.dump:
                    prof.dump_stats(f"{args.dump}.{name}.{B}.prof")
                stats = pstats.Stats(prof)
                print(f"--- {name} batch {B}: {stats.total_tt * 1e3 / clock.steps:.3f} ms profiled per step "
                      "(cumulative times of frames around a graphed part are partial)")
                for key in ("tottime", "cumulative"):
                    s = io.StringIO()
                    stats.stream = s
                    stats.sort_stats(key).print_stats(args.cprofile)
                    print(f"--- {name} batch {B}, by {key}\n" + s.getvalue().split("\n\n", 2)[-1], flush=True)
    return 0


def critical_path(llm, prompts: list, params) -> dict[str, float]:
    """Median host milliseconds, per step, from the moment this step's verdict reaches the host
    (the copy waited for in ``DraftVerifyLoop.step``) to the next call of the head's drafting
    function (``head draft``) and of the target model's forward (``target forward``) in the
    same step: the work the GPU waits through when the next step is launched from the host.
    Chains and trees drafted from the device verdict (:class:`speculum.interfaces.VerdictDrafter`)
    are launched before it reaches the host: ``head draft from the verdict`` is then negative,
    and so is ``target forward from the verdict`` (``--from-verdict forward``).
    Off CUDA the timed calls run their compute inline, so read the launch times only."""
    import speculum.loop as loop_mod
    marks: list[tuple[str, float]] = []
    inner_to_host = loop_mod._to_host

    def to_host(*a, **kw):
        wait = inner_to_host(*a, **kw)

        def waited():
            rows = wait()
            marks.append(("verdict", time.perf_counter()))
            return rows
        return waited

    inside = []  # set while the runner launches a forward from the verdict (its model call is that one)

    def mark(obj, name: str, label: str):
        inner = getattr(obj, name)
        had = name in vars(obj)

        def called(*a, **kw):
            if not inside:
                marks.append((label, time.perf_counter()))
            if label.startswith("target forward from"):
                inside.append(1)
            try:
                return inner(*a, **kw)
            finally:
                if label.startswith("target forward from"):
                    inside.pop()
        setattr(obj, name, called)
        return lambda: setattr(obj, name, inner) if had else delattr(obj, name)

    undo = []
    model = getattr(llm.target, "model", None)
    if model is not None:
        undo.append(mark(model, "forward", "target forward"))
    if getattr(llm.loop, "forward_from_verdict", False):
        undo.append(mark(llm.target, "forward_from_verdict", "target forward from the verdict"))
    graphs = getattr(llm.proposer, "graphs", None)
    if graphs is not None:
        undo.append(mark(graphs, "run", "head draft"))
        if hasattr(graphs, "run_from_device"):  # launched from the device verdict, before the host reads it
            undo.append(mark(graphs, "run_from_device", "head draft from the verdict"))
    loop_mod._to_host = to_host
    try:
        llm.generate(prompts, params)
    finally:
        loop_mod._to_host = inner_to_host
        for u in undo:
            u()
    gaps: dict[str, list[float]] = {}
    for i, (name, t) in enumerate(marks):
        if name.endswith("from the verdict"):  # launched before the verdict: time until it arrives (negative)
            arrival = next((t2 for other, t2 in marks[i + 1:] if other == "verdict"), None)
            if arrival is not None:
                gaps.setdefault(name, []).append((t - arrival) * 1e3)
        if name != "verdict":
            continue
        seen = set()
        for other, t2 in marks[i + 1:]:
            if other == "verdict":
                break
            if other not in seen:
                seen.add(other)
                gaps.setdefault(other, []).append((t2 - t) * 1e3)
    return {k: sorted(v)[len(v) // 2] for k, v in sorted(gaps.items(), key=lambda kv: not kv[0].startswith("head"))}


def _static_chain_drafts(llm) -> None:
    """Off CUDA a head drafts chains eagerly step by step; a GPU replays its static drafting
    function (``HeadDraftGraphs``) instead: run that function here too (eagerly), so the
    host work measured is the GPU's."""
    from speculum.testing import use_static_chain_drafts
    p = llm.proposer
    if (llm.target.device.type != "cuda" and isinstance(getattr(p, "graphs", 0), type(None))
            and getattr(p, "tree", 0) is None and llm.loop.k):
        use_static_chain_drafts(llm)


class _Clock:
    """Times ``DraftVerifyLoop.step`` and, inside it, the functions a CUDA device replays
    as graphs (the target model's forward with its read slots and tree inputs, the head's
    static drafting function, greedy tree acceptance): off CUDA, ``step - graphed`` is the host work a GPU would still see."""

    def __init__(self, llm, prof: cProfile.Profile | None = None):
        import speculum.verifiers.tree as vtree
        self.steps0, self.loop, self.prof = llm.loop._steps, llm.loop, prof
        self.step = self.graphed = 0.0
        self.inside = False
        self._undo = [self._wrap(llm.loop, "step", "step")]
        if llm.target.device.type != "cuda":
            model = getattr(llm.target, "model", None)
            if model is not None:  # the native runner's graph: read slots, tree inputs, the model
                self._undo.append(self._wrap(model, "forward", "graphed"))
                for name in ("_read_slots", "_tree"):
                    if hasattr(llm.target, name):
                        self._undo.append(self._wrap(llm.target, name, "graphed"))
            graphs = getattr(llm.proposer, "graphs", None)
            if graphs is not None:
                self._undo.append(self._wrap(graphs, "_draft", "graphed"))
                if hasattr(graphs, "run_from_device"):  # a tree drafted from the device verdict: one graph too
                    self._undo.append(self._wrap(graphs, "run_from_device", "graphed"))
            self._undo.append(self._wrap(vtree, "greedy_path", "graphed"))

    def _wrap(self, obj, name: str, part: str):
        inner = getattr(obj, name)
        had = name in vars(obj)

        def timed(*a, **kw):
            if part == "graphed" and not self.inside:
                return inner(*a, **kw)
            self.inside = True
            pause = self.prof is not None and part == "graphed"  # profile the host work alone
            if pause:
                self.prof.disable()
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                setattr(self, part, getattr(self, part) + time.perf_counter() - t0)
                self.inside = part != "step"
                if pause:
                    self.prof.enable()

        setattr(obj, name, timed)
        return lambda: setattr(obj, name, inner) if had else delattr(obj, name)

    @property
    def steps(self) -> int:
        return max(1, self.loop._steps - self.steps0)

    def undo(self) -> None:
        for u in self._undo:
            u()


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
