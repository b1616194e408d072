"""Moving arrays between JAX and torch: zero-copy through DLPack where both sit on one device.

The engine, the loop and the proposer plugins speak torch tensors; the JAX backend
hands its outputs over as torch views of JAX buffers (no copy on the CPU, nor on a GPU
when torch has CUDA) and reads torch inputs the same way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch


GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def is_gpu(device: jax.Device) -> bool:
    return device.platform in GPU_PLATFORMS


def torch_device_of(device: jax.Device) -> torch.device:
    """The torch device that can view ``device``'s buffers (CPU when torch lacks CUDA)."""
    if is_gpu(device) and torch.cuda.is_available():
        return torch.device("cuda", device.id)
    return torch.device("cpu")


def torch_dtype(dtype) -> torch.dtype:
    """The torch dtype of a JAX (numpy-style) dtype."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[jnp.dtype(dtype).name]


def to_torch(x: jax.Array, device: torch.device) -> torch.Tensor:
    """A torch view of ``x`` (a copy only when ``x`` lives where ``device`` cannot see it)."""
    on_gpu = is_gpu(next(iter(x.devices())))
    if on_gpu == (device.type == "cuda"):
        return torch.from_dlpack(x)
    return torch.from_numpy(np.asarray(x)).to(device)


def to_jax(t: torch.Tensor) -> jax.Array:
    """A JAX array of a float torch tensor, zero-copy through DLPack."""
    return jnp.from_dlpack(t.detach().contiguous())


def host_ints(t: torch.Tensor | np.ndarray | list) -> np.ndarray:
    """Integer data as host int32 (JAX's default integer width)."""
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu().numpy()
    return np.asarray(t).astype(np.int32, copy=False)
