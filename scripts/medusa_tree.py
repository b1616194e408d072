"""A static Medusa tree calibrated on the target's own answers (Medusa's ``medusa_choices``).

Medusa's heads draft independently of each other: head ``i`` reads the target's state
``h_t`` and ranks candidates for the token ``i + 2`` places ahead (sequential heads also read
the tokens of the node's path, which are the true tokens wherever the node can be accepted:
their ranks are read with the true tokens fed, teacher-forced). So whether a static tree
(paths of top-k ranks) accepts ``d`` tokens at a position depends only on the ranks
``(r_1, ..., r_d)`` of the true next tokens under heads ``0..d-1``: the tree accepts the
longest prefix of that rank tuple it contains. A node's contribution to the mean
acceptance length is the share of positions whose rank tuple starts with its path, so
the best tree of ``N`` nodes for a set of answers is the ``N`` most frequent rank
prefixes (a child is never more frequent than its parent: the set is a tree).

This script answers calibration prompts with the target (greedy, never MT-bench: the
training prompts by default), reads the heads' ranks along the answers
(teacher-forced), and prints that tree as a ``speculative_token_tree`` config, with the
acceptance length it expects on the calibration answers against the chain. With
``--eval-prompts FILE`` it answers those prompts too and reports, on their answers, the
chain, this tree, the dynamic trees of ``--topk`` (the proposer's own EAGLE-2 rule over
the heads' log-probabilities, same node count) and the best static tree for those answers
themselves (an upper bound for any static tree there, not a config to ship), and trees
chosen per position from calibrated head scores (:func:`fit_calibration` on the calibration
answers; the best nodes by summed score, and the dynamic rule on those scores). ``--cache
FILE`` keeps both answer sets' ranks and top log-probabilities, so a rerun needs no model:

    python scripts/medusa_tree.py --num-prompts 64 --nodes 32 --json medusa_tree.json
    python scripts/medusa_tree.py --prompts self_prompts.jsonl --num-prompts 160 --nodes 31 \\
        --eval-prompts mt_bench.jsonl --eval-num-prompts 80
    speculum bench offline --method "$(python -c 'import json;print(json.dumps(json.load(open("medusa_tree.json"))["config"]))')"
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from pathlib import Path

import torch


def read_chats(path: str, n: int, seed: int | None) -> list[list[dict]]:
    """The first ``n`` prompts of a JSONL file (``prompt``, or MT-bench's ``turns``: the first
    turn) as one-turn chats, shuffled with ``seed`` first (None: file order)."""
    from speculum.datasets import eval_set_path, read_jsonl
    rows = read_jsonl(eval_set_path(path))  # a shipped set by name (mt_bench, other_tasks) or a path
    if seed is not None:
        random.Random(seed).shuffle(rows)
    return [[{"role": "user", "content": r["prompt"] if "prompt" in r else r["turns"][0]}] for r in rows[:n]]


def head_ranks(llm, heads, chats, max_tokens: int, depth: int, width: int):
    """Greedy answers to ``chats``, then per answer position with a token two ahead: the
    ranks of the true tokens under heads ``0..depth-1`` ([P, depth], -1: beyond ``width`` or
    past the answer) and each head's top-``width`` log-probabilities ([P, depth, width])."""
    from speculum import SamplingParams
    outs = llm.generate(chats, SamplingParams(temperature=0, max_tokens=max_tokens))
    runner = llm.target  # teacher-forced states from the engine's own target (idle between calls)
    ranks, top = [], []
    for n, o in enumerate(outs):
        toks = list(o.prompt_token_ids) + list(o.token_ids)
        P, T = len(o.prompt_token_ids), len(o.prompt_token_ids) + len(o.token_ids)
        sid = 10**9 + n  # ids past the engine's own requests
        h = runner.add(sid, toks, hidden_layers=(-1,))[-1]  # [len, H]: h[t] produced toks[t + 1]
        runner.remove(sid)
        with torch.inference_mode():  # the heads on the answer's states only: [D, len - P + 1, V]
            # (token-aware heads also read the token each state produced, toks[t + 1]; none after the last;
            # sequential heads the true tokens after it: a tree node is accepted only where its path holds those;
            # a prefix layer attends over the whole sequence's features, the prompt's included)
            produced = torch.tensor(toks[1:] + [0], device=h.device)  # the token each state produced
            x = heads.sequence_features(h[None], produced[None])[0, P - 1:]
            nxt = produced[P - 1:]
            logits = torch.stack([heads.logits(i, z) for i, z in enumerate(heads.teacher_forced(x, nxt, depth))]).float()
            top.append(logits.log_softmax(-1).topk(width, dim=-1).values[:, : max(T - P - 1, 0)].transpose(0, 1).cpu())
            # states inside the answer with a token 2 ahead (t = P - 1 + u): head i's rank of
            # toks[t + i + 2], or width (a miss) past the answer
            U = max(T - P - 1, 0)
            r = torch.full((U, depth), width, dtype=torch.int64)
            ids = torch.tensor(toks, device=logits.device)
            for i in range(min(depth, U)):
                u = torch.arange(U - i, device=logits.device)
                true = logits[i, u, ids[u + P + 1 + i]]
                r[: U - i, i] = (logits[i, u] > true[:, None]).sum(-1).cpu()
            ranks.append(torch.where(r < width, r, -1))
    return (torch.cat(ranks) if ranks else torch.zeros(0, depth, dtype=torch.int64),
            torch.cat(top) if top else torch.zeros(0, depth, width))


def prefix_counts(ranks: torch.Tensor) -> Counter:
    """How many positions' rank tuples start with each path (a path stops at the first -1)."""
    counts: Counter = Counter()
    for row in ranks.tolist():
        for d in range(len(row)):
            if row[d] < 0:
                break
            counts[tuple(row[: d + 1])] += 1
    return counts


def best_static(counts: Counter, nodes: int) -> list[tuple[int, ...]]:
    """The ``nodes`` most frequent rank prefixes (shorter first on ties): a tree."""
    best = sorted(counts.items(), key=lambda kv: (-kv[1], len(kv[0]), kv[0]))[:nodes]
    return sorted((p for p, _ in best), key=lambda p: (len(p), p))


def accepted(row: list[int], paths: set) -> int:
    """Draft tokens a tree of rank ``paths`` accepts at a position whose true ranks are ``row``."""
    a = 0
    while a < len(row) and row[a] >= 0 and tuple(row[: a + 1]) in paths:
        a += 1
    return a


def dynamic_paths(lp: torch.Tensor, topk: int, nodes: int) -> set:
    """The rank paths of the dynamic tree the proposer drafts from top log-probs ``lp``
    [depth, >= topk] (EAGLE-2, ``speculum.proposers.tree.dynamic_tree``, as
    :func:`speculum.testing.reference_tree_paths` draws it in plain Python): token ids are
    ranks, and Medusa's children do not depend on their parent, only on their depth
    (sequential heads': on the true path's; every node of a depth is given those, so for
    them this replay is an estimate, the static tree's figures exact)."""
    from speculum.testing import reference_tree_paths
    from speculum.tree import TreeSpec

    def children(path, width):  # deeper levels clamped at 0 as the proposer's cumulative score is
        v = lp[len(path), :width]
        return (v if not path else v.clamp_max(0)), range(width)
    return reference_tree_paths(TreeSpec.dynamic(topk, lp.shape[0], nodes + 1), children)


def fit_calibration(ranks: torch.Tensor, lp: torch.Tensor, steps: int = 300) -> list[list[float]]:
    """Per head ``d``, (a, b) such that ``sigmoid(a * lp + b)`` estimates the chance that
    the candidate of log-probability ``lp`` is the true token two-plus-``d`` places ahead,
    given that the true tokens before it were among the drafted candidates (ranks
    < width): logistic regression over every candidate of those positions. Medusa's later
    heads are underconfident in that event (the first head ranks the token two ahead first
    43% of the time, but a node at depth 4 is right 70% of the time when its prefix was),
    so their raw log-probabilities make a dynamic tree too wide and too shallow."""
    P, D, W = lp.shape
    out = []
    for d in range(D):
        keep = (ranks[:, :d] >= 0).all(dim=1) if d else torch.ones(P, dtype=torch.bool)
        x = lp[keep, d]  # [P', W]
        y = (torch.arange(W).view(1, W) == ranks[keep, d].view(-1, 1)).float()
        a = torch.ones((), requires_grad=True)
        b = torch.zeros((), requires_grad=True)
        opt = torch.optim.LBFGS([a, b], max_iter=steps, line_search_fn="strong_wolfe")

        def loss():
            opt.zero_grad()
            v = torch.nn.functional.binary_cross_entropy_with_logits(a * x + b, y)
            v.backward()
            return v
        opt.step(loss)
        out.append([round(float(a.detach()), 4), round(float(b.detach()), 4)])
    return out


def calibrated(lp: torch.Tensor, cal: list[list[float]]) -> torch.Tensor:
    """``lp`` [..., D, W] mapped by each head's (a, b): log sigmoid(a * lp + b)."""
    ab = torch.tensor(cal, dtype=lp.dtype)
    return torch.nn.functional.logsigmoid(ab[:, 0].view(-1, 1) * lp + ab[:, 1].view(-1, 1))


def best_paths(scores: torch.Tensor, nodes: int) -> set:
    """The ``nodes`` rank paths of highest summed score (``scores`` [D, W], <= 0, a node's
    score independent of its parent's ranks): best first from the root, so a tree."""
    import heapq
    D, W = scores.shape
    sc = scores.tolist()
    heap = [(-sc[0][r], (r,)) for r in range(W)]
    heapq.heapify(heap)
    out: set = set()
    while heap and len(out) < nodes:
        neg, p = heapq.heappop(heap)
        out.add(p)
        if len(p) < D:
            for r in range(W):
                heapq.heappush(heap, (neg - sc[len(p)][r], p + (r,)))
    return out


def mal(ranks: torch.Tensor, trees) -> float:
    """Mean acceptance length (accepted drafts + 1) over the positions of ``ranks``; ``trees``:
    one set of paths for all, or a function of the position's index giving its set."""
    if not len(ranks):
        return 1.0
    rows = ranks.tolist()
    get = trees if callable(trees) else (lambda i: trees)
    return 1 + sum(accepted(r, get(i)) for i, r in enumerate(rows)) / len(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target (default: the default model)")
    ap.add_argument("--heads", default=None, help="Medusa checkpoint (default: the shipped heads)")
    ap.add_argument("--prompts", default=None, help="JSONL with 'prompt' (default: the training prompts)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--nodes", type=int, default=32, help="tree nodes (num_draft_tokens - 1)")
    ap.add_argument("--depth", type=int, default=None, help="deepest level (default: every head)")
    ap.add_argument("--max-rank", type=int, default=16, help="ranks past this count as a miss")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="where the target answers and the heads rank (cpu, cuda)")
    ap.add_argument("--dtype", default="float32", help="the target's and the heads' dtype (float32, bfloat16)")
    ap.add_argument("--eval-prompts", default=None,
                    help="JSONL ('prompt', or MT-bench's 'turns'), or a shipped set by name (mt_bench, "
                         "other_tasks): report the trees on these answers too")
    ap.add_argument("--eval-num-prompts", type=int, default=80)
    ap.add_argument("--topk", default="8,16", help="dynamic trees compared on --eval-prompts (tree_topk values)")
    ap.add_argument("--json", default=None, help="write the config and the counts here")
    ap.add_argument("--cache", default=None,
                    help="keep the heads' ranks and top log-probs of both answer sets in this file (.pt) and "
                         "read them from there next time (same prompts and heads)")
    args = ap.parse_args()

    from speculum import LLM
    from speculum.datasets import train_prompts_path

    spec = {"method": "medusa", "num_speculative_tokens": 1}
    if args.heads:
        spec["model"] = args.heads
    llm = LLM(args.model, speculative_config=spec, device=args.device, dtype=args.dtype,
              max_num_seqs=16 if args.device == "cpu" else 256)
    heads = llm.proposer.heads
    D = min(args.depth or heads.num_heads, heads.num_heads)
    chats = read_chats(args.prompts or train_prompts_path(), args.num_prompts, args.seed)
    cache = torch.load(args.cache) if args.cache and Path(args.cache).exists() else {}
    if "calib" not in cache:
        cache["calib"] = head_ranks(llm, heads, chats, args.max_tokens, D, args.max_rank)
        if args.cache:  # kept at once: the evaluation answers below may fail or be stopped
            torch.save(cache, args.cache)
    ranks, calib_lp = cache["calib"]
    counts = prefix_counts(ranks)
    paths = best_static(counts, args.nodes)
    chain = {tuple([0] * d) for d in range(1, D + 1)}
    expected, chain_mal = mal(ranks, set(paths)), mal(ranks, chain)
    config = {"method": "medusa", "speculative_token_tree": [list(p) for p in paths]}
    if args.heads:
        config["model"] = args.heads
    print(f"{len(chats)} answers, {len(ranks)} positions; expected acceptance length on them: "
          f"chain k={D} {chain_mal:.3f}, this {len(paths)}-node tree {expected:.3f}")
    print("depths:", dict(sorted(Counter(len(p) for p in paths).items())))
    print(json.dumps(config))
    report = {"config": config, "positions": len(ranks), "expected": expected, "chain": chain_mal,
              "counts": {",".join(map(str, p)): c for p, c in counts.most_common(200)}}
    if args.eval_prompts:
        if "eval" not in cache:
            cache["eval"] = head_ranks(llm, heads, read_chats(args.eval_prompts, args.eval_num_prompts, None),
                                       args.max_tokens, D, args.max_rank)
        ev, lp = cache["eval"]
        own = set(best_static(prefix_counts(ev), len(paths)))
        got = {"positions": len(ev), "chain": mal(ev, chain), "static": mal(ev, set(paths)),
               "static_on_these_answers": mal(ev, own)}
        cal = fit_calibration(ranks, calib_lp)  # fitted on the calibration answers only
        report["calibration"] = cal
        clp = calibrated(lp, cal)
        got["calibrated_best"] = mal(ev, lambda i: best_paths(clp[i], len(paths)))
        for k in (int(x) for x in args.topk.split(",") if x):
            for name, scores in (("dynamic", lp), ("calibrated", clp)):
                if k <= args.max_rank:
                    got[f"{name}_top{k}"] = mal(ev, lambda i, k=k, sc=scores: dynamic_paths(sc[i], k, len(paths)))
        print("calibration (a, b) per head:", cal)
        print(f"on {args.eval_prompts} ({len(ev)} positions): " + ", ".join(
            f"{k} {v:.3f}" for k, v in got.items() if k != "positions"))
        report["eval"] = {"prompts": args.eval_prompts, **got}
    if args.cache:
        torch.save(cache, args.cache)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
