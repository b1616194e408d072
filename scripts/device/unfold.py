"""``speculum`` with the nineteenth session's host cuts undone, the "before" of an A/B run.

Three cuts took eager launches out of every step (docs/benchmarks.md, nineteenth and
twentieth sessions): greedy chain verification as one Triton kernel (``greedy_chain_verdict``),
the native runner taking each row's last token on the host (``last_tokens``), and the
verdict's count and tokens made side by side (``Verdict.rows``), so the copy to the host and
a head's drafting from the verdict need no launch to join them. With ``UNFOLD=1`` this
wrapper puts back the eager verification, the [B, k+1] inputs built on the device and the
joins (for trees only the joins: the tree kernel still writes one tensor), in-process, and runs the ``speculum`` CLI with the arguments given, so before and after run
in one device call on one machine:

    UNFOLD=1 python3 scripts/device/unfold.py bench offline ... --json before.json
    python3 scripts/device/unfold.py bench offline ... --json after.json

(``scripts/device/fold_ab.sh`` runs them in turns.)
"""

from __future__ import annotations

import os
import sys


def unfold() -> None:
    import torch

    from speculum.backends.torch.native.runner import NativeRunner
    from speculum.interfaces import Verdict
    from speculum.verifiers import greedy, sampled

    NativeRunner.takes_last_tokens = False  # the loop builds [last | drafts] on the device again
    Verdict.packed = lambda self: None  # the loop and the heads join count and tokens themselves

    def eager(target_logits, draft_ids):  # the five eager ops after the argmax; no packed rows
        B, k1, _ = target_logits.shape
        argmax = target_logits.argmax(dim=-1)
        if k1 == 1:
            return Verdict(token_ids=argmax, num_accepted=torch.zeros(B, dtype=torch.int64, device=argmax.device))
        drafts = draft_ids.to(argmax.device, torch.int64, non_blocking=True)
        accepted = (drafts == argmax[:, :k1 - 1]).cumprod(dim=1).sum(dim=1)
        return Verdict(token_ids=argmax.masked_fill(greedy._columns(k1, argmax.device) > accepted.view(B, 1), -1),
                       num_accepted=accepted)
    greedy.greedy_verify = sampled.greedy_verify = eager  # (the default verifier's greedy steps: sampled)


if __name__ == "__main__":
    if os.environ.get("UNFOLD") == "1":
        unfold()
        print("host cuts undone: eager chain verification, inputs built on the device", flush=True)
    from speculum.cli import main
    sys.argv = ["speculum", *sys.argv[1:]]
    sys.exit(main())
