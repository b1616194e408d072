"""Small host values onto a device without stopping the host.

``torch.tensor(values, device="cuda")`` and ``cpu_tensor.to("cuda")`` copy with
``non_blocking=False``, which makes the host wait until every kernel queued before the
copy has run: inside a step that is a full synchronisation, and the GPU then idles while
the host does the rest of its work. From pageable memory CUDA stages the values before
the asynchronous copy returns, so the source may go away at once; the copy is ordered on
the stream like any kernel.
"""

from __future__ import annotations

from typing import Sequence

import torch


def on_device(values: Sequence, device: torch.device | str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``values`` (numbers or nested lists of them) as a tensor on ``device``, copied asynchronously."""
    t = torch.tensor(values, dtype=dtype)
    return t if torch.device(device).type == "cpu" else t.to(device, non_blocking=True)
