"""How many tokens per target forward n-gram lookup can give on a prompt set, whatever the
step costs: greedy outputs are made once without speculation (batched), then each lookup
variant is replayed over them (lossless greedy speculation emits exactly these tokens, so
a draft's accepted length is its agreement with them). Prints a table, writes JSON.

    python scripts/ngram_ceiling.py --max-tokens 256 --json ngram_ceiling.json
    python scripts/ngram_ceiling.py --outputs ngram_ceiling.json     # replay saved outputs

The ratio of n-gram speculation to autoregressive decoding is at most this figure times
(plain step / speculative step).

``--trees M:N ...`` also replays lookup that drafts a token tree: up to M distinct
continuations (the longest matching suffix first, most recent occurrence first, among each
n-gram's latest M occurrences; ``--keep 0``: all of them), merged into a trie of at most N
nodes; a step accepts the longest path the answer follows. The rule is the n-gram
proposer's own (``speculum_ngram.proposer``: ``TreeSuffixIndex``, ``continuation_trie``). The
lossless loop verifies such a tree in one forward (docs/trees.md), so this is what
several candidates per step would add over one.

``--corpus FILE`` also replays chains that fall back on a corpus of the target's answers where
the request has no match (``options.corpus``; ``python -m speculum_ngram.corpus build``), and
``--answers-cache DIR`` replays the greedy first-turn answers of an answers cache (``speculum
train --eval-prompts``: the H200's bf16 answers to MT-bench) instead of generating.
"""

from __future__ import annotations

import argparse
import json
import sys
import time



def generate(args) -> list[dict]:
    from speculum.datasets import first_turn, mt_bench
    from speculum.engine import LLM
    from speculum.sampling import SamplingParams

    rows = mt_bench(path=args.mt_bench)
    prompts = [[{"role": "user", "content": first_turn(r)}] for r in rows]
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=len(prompts), threads=args.threads)
    t0 = time.perf_counter()
    outs = llm.chat(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens))
    print(f"{len(outs)} answers in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return [dict(category=r["category"], prompt=o.prompt_token_ids, output=list(o.outputs[0].token_ids))
            for r, o in zip(rows, outs)]


def from_cache(folder: str, max_tokens: int) -> list[dict]:
    """The first-turn answers of a self-distillation answers cache (``speculum train
    --eval-prompts``: the target's greedy answers to an evaluation set), as ``generate`` gives."""
    from pathlib import Path

    from speculum.train.data import DistillData
    d = DistillData.load(Path(folder), layers=())  # token ids only
    off, out = d.offsets.tolist(), []
    for i, (pl, kind, temp) in enumerate(zip(d.prompt_lens.tolist(), d.kind.tolist(), d.temperature.tolist())):
        if kind == 0 and temp == 0:  # first turns, greedy
            seq = d.tokens[off[i]: off[i + 1]].tolist()
            out.append(dict(category=None, prompt=seq[:pl], output=seq[pl: pl + max_tokens]))
    return out


def replay(data: list[dict], n_min: int, n_max: int, k: int, corpus=None) -> dict:
    """Steps, tokens and drafting steps of lookup (n_min..n_max, k drafts) over the answers;
    with ``corpus`` (``speculum_ngram.corpus.Corpus``), looked up there where the request has
    no match, as ``options.corpus`` does."""
    from speculum_ngram.proposer import SuffixIndex

    steps = tokens = drafted = 0
    for r in data:
        ctx, out = list(r["prompt"]), r["output"]
        index = SuffixIndex(ctx, n_min, n_max)
        i = 0
        while i < len(out):
            d = index.draft(k)
            if not d and corpus is not None:
                d = corpus.draft(ctx, k)
            a = 0
            while a < len(d) and i + a < len(out) and d[a] == out[i + a]:
                a += 1
            n = min(a + 1, len(out) - i)
            ctx.extend(out[i: i + n])
            i += n
            tokens += n
            steps += 1
            drafted += bool(d)
    return dict(n_min=n_min, n_max=n_max, k=k, corpus=corpus is not None, steps=steps, tokens=tokens,
                tokens_per_forward=tokens / steps, drafting_share=drafted / steps)


def continuations(ctx: list[int], n_min: int, n_max: int, depth: int, m: int, keep: int | None = None
                  ) -> list[tuple[int, ...]]:
    """Up to ``m`` distinct continuations (at most ``depth`` tokens) of ``ctx``'s suffix: for n
    from ``n_max`` down to ``n_min``, the tokens after each earlier occurrence of the last n
    tokens, the most recent first, among each n-gram's latest ``keep`` occurrences (None:
    ``m``, what the proposer keeps; 0: all). The proposer's own rule (TreeSuffixIndex)."""
    from speculum_ngram.proposer import TreeSuffixIndex
    return TreeSuffixIndex(list(ctx), n_min, n_max, m if keep is None else keep).continuations(depth, m)


def trie_nodes(paths: list[tuple[int, ...]]) -> int:
    """Nodes of the trie of ``paths`` (distinct non-empty prefixes)."""
    return len({p[:i] for p in paths for i in range(1, len(p) + 1)})


def replay_tree(data: list[dict], n_min: int, n_max: int, depth: int, m: int, budget: int,
                keep: int | None = None) -> dict:
    """:func:`replay` for a tree of up to ``m`` continuations, at most ``budget`` nodes, drafted
    by the n-gram proposer's own rule (``TreeSuffixIndex``, ``continuation_trie``; ``keep``
    as :func:`continuations`); a step accepts the longest candidate prefix the answer follows."""
    from speculum_ngram.proposer import TreeSuffixIndex, continuation_trie

    steps = tokens = nodes = 0
    for r in data:
        ctx, out = list(r["prompt"]), r["output"]
        index = TreeSuffixIndex(ctx, n_min, n_max, m if keep is None else keep)
        i = 0
        while i < len(out):
            toks, parents = continuation_trie(index.continuations(depth, m), budget)
            nodes += len(toks)
            a, at = 0, -1  # the deepest node whose path the answer follows
            for d in range(len(out) - i):
                nxt = [j for j in range(len(toks)) if parents[j] == at and toks[j] == out[i + d]]
                if not nxt:
                    break
                at, a = nxt[0], d + 1
            n = min(a + 1, len(out) - i)
            ctx.extend(out[i: i + n])
            i += n
            tokens += n
            steps += 1
    return dict(n_min=n_min, n_max=n_max, depth=depth, candidates=m, budget=budget,
                keep=m if keep is None else keep, steps=steps, tokens=tokens,
                tokens_per_forward=tokens / steps, mean_nodes=nodes / steps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--mt-bench", default=None, help="MT-bench style JSONL (default: the 80 shipped questions)")
    p.add_argument("--max-tokens", type=int, default=256, help="new tokens per answer")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--outputs", default=None, help="replay the answers saved in this JSON instead of generating")
    p.add_argument("--answers-cache", default=None,
                   help="or replay the first-turn greedy answers of this answers cache (speculum train --eval-prompts)")
    p.add_argument("--corpus", default=None,
                   help="also replay lookup that falls back on this corpus (python -m speculum_ngram.corpus build; "
                        "\"shipped\": the default model's)")
    p.add_argument("-k", type=int, nargs="+", default=[2, 4], help="draft lengths to replay")
    p.add_argument("--trees", nargs="*", default=[], metavar="M:N",
                   help="also replay token trees of up to M continuations and N nodes, at each -k as depth")
    p.add_argument("--keep", type=int, default=None,
                   help="tree occurrences kept per n-gram (default M, as the proposer; 0 = all)")
    p.add_argument("--json", default="results/ngram_ceiling.json", help="where answers and figures go")
    args = p.parse_args(argv)
    data = (json.load(open(args.outputs))["answers"] if args.outputs
            else from_cache(args.answers_cache, args.max_tokens) if args.answers_cache else generate(args))
    rows = [replay(data, lo, hi, k) for k in args.k for lo, hi in ((2, 5), (1, 5), (3, 5), (2, 8))]
    if args.corpus:
        from speculum_ngram.corpus import SHIPPED, load_corpus
        path = SHIPPED / "smollm2-135m-instruct.npy" if args.corpus == "shipped" else args.corpus
        corpus = load_corpus(str(path), 2, 5, depth=max(args.k))  # (int32 or compact files; tables cached)
        rows += [replay(data, lo, hi, k, corpus) for k in args.k for lo, hi in ((2, 5), (1, 5))]
    print(f"{'k':>2} {'n':>5} {'corpus':>6} {'tokens/forward':>15} {'drafting share':>15}")
    for r in rows:
        print(f"{r['k']:>2} {r['n_min']}-{r['n_max']:<3} {'yes' if r['corpus'] else 'no':>6} "
              f"{r['tokens_per_forward']:>15.3f} {r['drafting_share']:>15.2f}")
    trees = []
    for spec in args.trees:
        m, budget = (int(v) for v in spec.split(":"))
        trees += [replay_tree(data, lo, hi, k, m, budget, args.keep) for k in args.k for lo, hi in ((2, 5), (1, 5))]
    if trees:
        print(f"\n{'depth':>5} {'n':>5} {'M:N':>6} {'tokens/forward':>15} {'nodes/step':>11}")
        for r in trees:
            print(f"{r['depth']:>5} {r['n_min']}-{r['n_max']:<3} {r['candidates']:>3}:{r['budget']:<2} "
                  f"{r['tokens_per_forward']:>15.3f} {r['mean_nodes']:>11.2f}")
    from pathlib import Path
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"answers": data, "corpus": args.corpus, "replay": rows, "trees": trees}))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
