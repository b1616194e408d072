"""``speculum`` with the nineteenth session's host cuts undone, the "before" of an A/B run.

Two cuts took eager launches out of every speculative step (docs/benchmarks.md, nineteenth
session): greedy chain verification as one Triton kernel (``greedy_chain_verdict``) and the
native runner taking each row's last token on the host (``last_tokens``). With ``UNFOLD=1``
this wrapper puts back the eager verification and the [B, k+1] inputs built on the device,
in-process, and runs the ``speculum`` CLI with the arguments given, so before and after run
in one device call on one machine:

    UNFOLD=1 python3 scripts/device/unfold.py bench offline ... --json before.json
    python3 scripts/device/unfold.py bench offline ... --json after.json

(``scripts/device/fold_ab.sh`` runs them in turns.)
"""

from __future__ import annotations

import os
import sys


def unfold() -> None:
    from speculum.backends.torch.native.runner import NativeRunner
    from speculum.verifiers import greedy

    NativeRunner.takes_last_tokens = False  # the loop builds [last | drafts] on the device again
    greedy._fused = lambda argmax, drafts: None  # the five eager ops after the argmax


if __name__ == "__main__":
    if os.environ.get("UNFOLD") == "1":
        unfold()
        print("host cuts undone: eager chain verification, inputs built on the device", flush=True)
    from speculum.cli import main
    sys.argv = ["speculum", *sys.argv[1:]]
    sys.exit(main())
