"""Peak memory of the trainers' whole-vocabulary loss, in one shot against in row chunks.

Four unrolled steps (as EAGLE and MTP train), each scored by soft cross-entropy over the
whole vocabulary against the target's probabilities (``speculum.train.base.scored_ce``),
then one backward pass; each setting in a process of its own (peak RSS, CPU, fp32):

    python scripts/ce_memory.py [--rows 4096] [--vocab 49152] [--json out.json]

On the GPU the same loss at 32 x 640 tokens took 74 GB for one trainer (2026-12-05), which
is why rows above ``CE_CHUNK_ELEMENTS`` logits go in chunks recomputed in backward.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def one(rows: int, hidden: int, vocab: int, steps: int, chunk: int) -> dict:
    import resource
    import time

    import torch
    import torch.nn.functional as F

    from speculum.train.base import scored_ce
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(vocab, hidden, generator=g) * 0.02
    probs = torch.softmax(torch.randn(rows, vocab, generator=g), -1)
    x = torch.randn(rows, hidden, generator=g, requires_grad=True)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    total, o = 0.0, x
    for j in range(steps):
        o = torch.tanh(o)
        ce, _ = scored_ce(lambda z: F.linear(z, w), o, probs, torch.arange(rows), chunk_elements=chunk)
        total = total + 0.8 ** j * ce
    total.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"chunk_elements": chunk, "loss": float(total.detach()), "peak_rss_gb": peak / 1e6,
            "inputs_rss_gb": base / 1e6, "loss_rss_gb": (peak - base) / 1e6, "seconds": time.perf_counter() - t}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--chunks", default="0,67108864", help="chunk_elements to compare (0: one shot)")
    p.add_argument("--json", default=None)
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one is not None:
        print(json.dumps(one(a.rows, a.hidden, a.vocab, a.steps, a.one)))
        return 0
    out = []
    for c in (int(x) for x in a.chunks.split(",")):
        c = c or 1 << 62
        r = subprocess.run([sys.executable, __file__, "--one", str(c), "--rows", str(a.rows), "--hidden",
                            str(a.hidden), "--vocab", str(a.vocab), "--steps", str(a.steps)],
                           capture_output=True, text=True, check=True)
        out.append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(f"{a.rows} rows x {a.vocab} tokens, {a.steps} steps, fp32, CPU, one thread")
    print(f"{'chunk':>14} {'rows/chunk':>10} {'loss':>12} {'loss GB':>8} {'peak GB':>8} {'s':>6}")
    for r in out:
        one_shot = r["chunk_elements"] >= a.rows * a.vocab
        print(f"{'one shot' if one_shot else r['chunk_elements']:>14} "
              f"{a.rows if one_shot else r['chunk_elements'] // a.vocab:>10} {r['loss']:>12.6f} "
              f"{r['loss_rss_gb']:>8.2f} {r['peak_rss_gb']:>8.2f} {r['seconds']:>6.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": a.rows, "hidden": a.hidden, "vocab": a.vocab, "steps": a.steps, "runs": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
