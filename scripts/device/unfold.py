"""``speculum`` with the nineteenth session's host cuts undone, the "before" of an A/B run.

Four cuts took eager launches out of every step (docs/benchmarks.md, nineteenth and
twentieth sessions): greedy chain verification as one Triton kernel (``greedy_chain_verdict``),
the native runner taking each row's last token on the host (``last_tokens``), the verdict's
count and tokens made side by side (``Verdict.rows``), so the copy to the host and a head's
drafting from the verdict need no launch to join them, and the argmax of the logits made
inside the runner's graph (``ForwardOutput.argmax``, the verifier's ``argmax=``). With ``UNFOLD=1`` this
wrapper puts back the eager verification and argmax, the [B, k+1] inputs built on the device
and the joins (for trees only the joins and the argmax: the tree kernel still writes one
tensor), in-process, and runs the ``speculum`` CLI with the arguments given, so before and after run
in one device call on one machine:

    UNFOLD=1 python3 scripts/device/unfold.py bench offline ... --json before.json
    python3 scripts/device/unfold.py bench offline ... --json after.json

(``scripts/device/fold_ab.sh`` runs them in turns.)
"""

from __future__ import annotations

import json
import os
import sys


def _eager_verify(target_logits, draft_ids, argmax=None):
    """Greedy chain verification as before the cuts: the argmax, the five eager ops after it
    (the zeros of a step without drafts), count and tokens apart (a runner's ``argmax`` is
    not used)."""
    import torch

    from speculum.interfaces import Verdict
    from speculum.verifiers import greedy
    B, k1, _ = target_logits.shape
    argmax = target_logits.argmax(dim=-1)
    if k1 == 1:
        return Verdict(token_ids=argmax, num_accepted=torch.zeros(B, dtype=torch.int64, device=argmax.device))
    drafts = draft_ids.to(argmax.device, torch.int64, non_blocking=True)
    accepted = (drafts == argmax[:, :k1 - 1]).cumprod(dim=1).sum(dim=1)
    return Verdict(token_ids=argmax.masked_fill(greedy._columns(k1, argmax.device) > accepted.view(B, 1), -1),
                   num_accepted=accepted)


def _set(unfolded: bool) -> None:
    """The module-wide cuts off (``unfolded``) or on: the verifier's kernel, the packed verdict."""
    from speculum.interfaces import Verdict
    from speculum.verifiers import greedy, sampled
    Verdict.packed = (lambda self: None) if unfolded else _PACKED  # the loop and the heads join count and tokens
    greedy.greedy_verify = sampled.greedy_verify = _eager_verify if unfolded else _VERIFY


def _unfold_engine(llm) -> None:
    """One engine's own cuts off: its loop builds [last | drafts] on the device again, and its
    verifier computes the argmax itself (the runner's, made in its graph, goes unused)."""
    llm._unfolded = True
    llm.loop.last_on_host = False
    llm.loop.use_runner_argmax = False


def unfold() -> None:
    """Every engine of the process without the cuts."""
    from speculum.engine import LLM
    init = LLM.__init__

    def unfolded_init(self, *a, **kw):
        init(self, *a, **kw)
        _unfold_engine(self)
    LLM.__init__ = unfolded_init
    _set(True)


def alternate() -> None:
    """``UNFOLD=alt``: in a bench run, the first engine of each configuration (and the
    repeated baseline, ``--baseline-again``) runs without the cuts, the second with them;
    with ``--interleave`` every category then runs through both in turn, so the machine's
    drift (runs of the same code differed by up to 20% a config on the H200) slows both
    alike. Give each ``--method`` twice; the unfolded engines' names end in ``[unfolded]``."""
    from speculum.bench import methods
    from speculum.engine import LLM
    seen: dict[str, int] = {}
    start, generate = methods._start, LLM.generate

    def tagged_start(make_llm, cfg, *a, again: bool = False, **kw):
        key = json.dumps(cfg, sort_keys=True)
        seen[key] = seen.get(key, 0) + 1
        unfolded = again if cfg is None else seen[key] == 1

        def make(c):
            llm = make_llm(c)
            if unfolded:
                _unfold_engine(llm)
            return llm
        llm, name = start(make, cfg, *a, again=again, **kw)
        return llm, name + (" [unfolded]" if unfolded else "")

    def switched_generate(self, *a, **kw):
        _set(getattr(self, "_unfolded", False))
        return generate(self, *a, **kw)
    methods._start, LLM.generate = tagged_start, switched_generate


if __name__ == "__main__":
    from speculum.interfaces import Verdict
    from speculum.verifiers import greedy
    _PACKED, _VERIFY = Verdict.packed, greedy.greedy_verify
    mode = os.environ.get("UNFOLD")
    if mode == "1":
        unfold()
        print("host cuts undone: eager chain verification, inputs built on the device", flush=True)
    elif mode == "alt":
        alternate()
        print("host cuts undone in the first engine of each configuration", flush=True)
    from patched_cli import run_cli  # (scripts/device/ is the script's own folder: first on sys.path)
    run_cli(sys.argv[1:])
