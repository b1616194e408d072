"""The JAX backend: Llama-family models in jax.numpy over paged KV, on CPU or GPU.

Same contract as the torch backend: models load first (target, then any draft), then
:meth:`JaxBackend.plan_memory` splits the KV budget into equally many blocks for every
runner (:func:`speculum.kv.plan_kv_memory`) and gives each a
:class:`speculum.kv.PagedKVAllocator` and its pools. The scheduler reads
``target.allocator`` as it does for the torch backend.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import torch

from speculum.backends.jax.checkpoint import read_arch
from speculum.backends.jax.convert import is_gpu, torch_device_of, torch_dtype
from speculum.backends.jax.model import load_params
from speculum.backends.jax.runner import JaxRunner
from speculum.errors import ConfigError, ModelLoadError
from speculum.kv import PagedKVAllocator, blocks_for, plan_kv_memory

log = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "float": jnp.float32,
          "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
          "float16": jnp.float16, "fp16": jnp.float16, "half": jnp.float16}
CPU_DEFAULT_KV_BYTES = 2 << 30
ACTIVATION_RESERVE = 2 << 30


def resolve_device(device) -> jax.Device:
    """``auto``/None: JAX's default device (a GPU when jax has CUDA); ``cpu``; ``cuda[:i]``/``gpu[:i]``."""
    if device in (None, "auto"):
        return jax.devices()[0]
    text = str(device)
    kind, _, index = text.partition(":")
    if kind == "cpu":
        return jax.devices("cpu")[0]
    if kind in ("cuda", "gpu"):
        try:
            gpus = jax.devices("gpu")
        except RuntimeError:
            gpus = []
        if not gpus:
            raise ConfigError(f"device {text!r} asked for, but JAX sees no GPU (jax {jax.__version__}, backend "
                              f"{jax.default_backend()}); install jax[cuda12] or use device='cpu'")
        i = int(index or 0)
        if i >= len(gpus):
            raise ConfigError(f"device {text!r}: JAX sees {len(gpus)} GPU(s)")
        return gpus[i]
    raise ConfigError(f"unknown device {text!r} for backend 'jax'; use auto, cpu or cuda[:i]")


def resolve_dtype(dtype, device: jax.Device):
    if dtype in (None, "auto"):
        return jnp.bfloat16 if is_gpu(device) else jnp.float32
    name = str(dtype).replace("torch.", "")
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(sorted(DTYPES))}")
    return DTYPES[name]


class JaxBackend:
    """Runs Llama-family models with JAX (``jax.jit`` over a few static shapes).

    ``block_size``: KV block size in tokens. ``kv_cache_memory``: KV budget in bytes;
    default: 2 GiB on the CPU, ``gpu_memory_utilization`` of what JAX may use on a GPU
    minus what is in use and an activation reserve. ``prefill_chunk``: prompt tokens per
    prefill forward.
    """

    name = "jax"

    def __init__(self, device=None, dtype=None, block_size: int = 16, kv_cache_memory: int | None = None,
                 gpu_memory_utilization: float = 0.9, prefill_chunk: int = 512):
        self.jax_device = resolve_device(device)
        self.jax_dtype = resolve_dtype(dtype, self.jax_device)
        if not 0 < gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.kv_cache_memory = kv_cache_memory
        self.gpu_memory_utilization = gpu_memory_utilization
        self.prefill_chunk = prefill_chunk
        self.runners: list[JaxRunner] = []
        self.plan = None
        self._allocators: list[PagedKVAllocator] = []

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype matching the weights' JAX dtype."""
        return torch_dtype(self.jax_dtype)

    @property
    def device(self) -> torch.device:
        """The torch device that output tensors live on."""
        return torch_device_of(self.jax_device)

    def load_model(self, path: Path, role: str = "target", max_model_len: int | None = None,
                   num_layers: int | None = None) -> JaxRunner:
        """Load the checkpoint at ``path`` as a runner for ``role`` ("target", "draft", ...).

        ``num_layers`` keeps only the first layers (a cheap self-draft for experiments).
        """
        arch, why = read_arch(Path(path), num_layers, max_model_len)
        if arch is None:
            raise ConfigError(f"backend 'jax' runs the Llama family only and cannot serve {path}: {why}; "
                              "use backend='torch' for this model")
        try:
            params = load_params(path, arch, self.jax_dtype, self.jax_device)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"could not load {role} model from {path}: {type(exc).__name__}: {exc}") from exc
        limit = arch.context_limit(role, max_model_len)
        runner = JaxRunner(params, arch, self.jax_device, self.jax_dtype, name=role, max_model_len=limit,
                           prefill_chunk=self.prefill_chunk)
        log.info("%s model %s: jax %s runner (paged KV), %s on %s", role, Path(path).name, arch.model_type,
                 jnp.dtype(self.jax_dtype).name, self.jax_device)
        self.runners.append(runner)
        return runner

    # -- memory ---------------------------------------------------------------------------
    def kv_budget_bytes(self, cap: int | None = None) -> int:
        """Bytes for KV: ``kv_cache_memory`` if set, else what the device allows, capped at ``cap``."""
        if self.kv_cache_memory is not None:
            return int(self.kv_cache_memory)
        stats = self.jax_device.memory_stats() if is_gpu(self.jax_device) else None
        if not stats:
            return min(CPU_DEFAULT_KV_BYTES, cap or CPU_DEFAULT_KV_BYTES)
        # weights are loaded by now, so they are in ``bytes_in_use``
        avail = int(stats["bytes_limit"] * self.gpu_memory_utilization - stats["bytes_in_use"] - ACTIVATION_RESERVE)
        return min(avail, cap) if cap else avail

    def plan_memory(self, max_model_len: int, max_num_seqs: int | None = None, lookahead: int = 0) -> None:
        """Give every runner an allocator with the same number of blocks, and its pools.

        As :meth:`speculum.backends.torch.TorchBackend.plan_memory`: a draft runs up to
        ``lookahead`` positions past its sequence, so with a draft one sequence needs
        ``max_model_len + lookahead`` tokens of blocks. Without an explicit
        ``kv_cache_memory`` the budget is capped at what ``max_num_seqs`` sequences can use.
        """
        if not self.runners:
            return
        overshoot = lookahead if len(self.runners) > 1 else 0
        cap = None
        if max_num_seqs:
            blocks = max_num_seqs * (blocks_for(max_model_len + overshoot, self.block_size) + 1) + 2
            cap = blocks * self.block_size * sum(r.kv_bytes_per_token for r in self.runners)
        plan = plan_kv_memory(
            self.kv_budget_bytes(cap),
            {f"{r.name}#{i}": r.kv_bytes_per_token for i, r in enumerate(self.runners)},
            self.block_size,
            {f"{r.name}#{i}": r.weight_bytes for i, r in enumerate(self.runners)},
            max_model_len, overshoot,
        )
        self.plan = plan
        log.info(plan.describe())
        self._allocators = []
        for r in self.runners:
            limit = max_model_len if r.name == "target" else max_model_len + lookahead
            alloc = PagedKVAllocator(group=r.name, num_blocks=plan.num_blocks, block_size=self.block_size,
                                     max_model_len=min(r.max_model_len, limit))
            r.attach_cache(alloc)
            self._allocators.append(alloc)

    def kv_allocators(self) -> list[PagedKVAllocator]:
        """The planned allocators of every runner (target first), for the scheduler."""
        return list(self._allocators)

    def register_cache(self, group) -> None:
        """No JAX method keeps a cache of its own yet (heads are torch-only)."""
        raise ConfigError("the jax backend plans its runners' caches only; this method needs backend='torch'")

    def capture(self, runner, batch_sizes, query_lens, hidden_layers=(), tree_query_lens=()) -> int:
        """Compile the decode / verify shapes ahead of time (JAX's counterpart of CUDA graphs)."""
        if tree_query_lens:
            return 0  # trees are a torch-backend feature
        return runner.capture(batch_sizes, query_lens, max_block_buckets=1, hidden_layers=hidden_layers)
