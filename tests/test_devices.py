"""Host values reach the device without a synchronisation (speculum.devices.on_device)."""

from __future__ import annotations

import pytest
import torch

from speculum.devices import on_device


def test_on_device_values_and_dtype_on_the_cpu():
    t = on_device([[1, 2], [3, 4]], "cpu")
    assert t.dtype == torch.int64 and t.device.type == "cpu" and t.tolist() == [[1, 2], [3, 4]]
    assert on_device([0.5], "cpu", torch.float32).dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_device_does_not_synchronise():
    """With CUDA's sync debug mode set to error, a blocking copy (torch.tensor(..., device=))
    raises; on_device does not, and its values arrive behind the queued work."""
    x = torch.zeros(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            x = x @ x  # queued work the copy must not wait for
        t = on_device([5, 6, 7], "cuda")
        with pytest.raises(RuntimeError):
            torch.tensor([1, 2], device="cuda")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert t.tolist() == [5, 6, 7]
