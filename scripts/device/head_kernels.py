"""``speculum`` with the heads' drafting on plain torch kernels, the "before" of 72e1646.

Since 72e1646 a head forward drafting on a GPU uses the fused kernels the target uses
(RMSNorm, rope + K/V write) and reads cos/sin from a table. With ``HEAD_KERNELS=torch``
this wrapper puts back the plain torch versions in-process and runs the ``speculum`` CLI
with the arguments given, so before and after run in the same device call:

    HEAD_KERNELS=torch python3 scripts/device/head_kernels.py bench offline ... --json before.json
    python3 scripts/device/head_kernels.py bench offline ... --json after.json
"""

from __future__ import annotations

import os
import sys


def plain_torch() -> None:
    from speculum.backends.torch.heads import cache, layers
    from speculum.backends.torch.native import kernels

    def rope_write_kv(qkv, nq, nkv, d, cos, sin, write_slots, k_pool, v_pool):
        B, t, _ = qkv.shape
        qh, kh, vh = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
        return kernels.rope_write_kv_torch(qh.reshape(B, t, nq, d), kh.reshape(B, t, nkv, d),
                                           vh.reshape(B, t, nkv, d), cos, sin, write_slots, k_pool, v_pool)

    layers.add_rmsnorm = kernels.add_rmsnorm_torch
    cache.rope_write_kv = rope_write_kv
    layers.Rope.forward = lambda self, positions, dtype: layers.rope_cos_sin(positions, self.inv_freq, dtype)


if __name__ == "__main__":
    if os.environ.get("HEAD_KERNELS") == "torch":
        plain_torch()
        print("head kernels: plain torch (the 'before' of 72e1646)", flush=True)
    from patched_cli import run_cli  # (scripts/device/ is the script's own folder: first on sys.path)
    run_cli(sys.argv[1:])
