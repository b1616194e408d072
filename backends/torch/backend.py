"""The torch backend: native Llama-family runner over paged KV, transformers as fallback.

Models are loaded first (target, then any draft), then :meth:`TorchBackend.plan_memory`
splits the KV budget into equally many blocks for every paged cache group and allocates
the pools. The plan is logged; a budget too small for one sequence is a clear error.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from speculum.backends.torch.hf_runner import HFRunner
from speculum.errors import ConfigError, ModelLoadError
from speculum.interfaces import CacheGroup
from speculum.kv import PagedKVAllocator, SimpleKVAllocator, blocks_for, plan_kv_memory

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
RUNNERS = ("auto", "native", "hf")
CPU_DEFAULT_KV_BYTES = 2 << 30


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for, but torch sees no CUDA device; use device='cpu'")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


class TorchBackend:
    """Runs models with PyTorch on CPU or CUDA.

    ``runner``: ``auto`` (native for the Llama family, transformers otherwise), ``native``
    or ``hf``. ``cuda_graphs``: capture decode/verify steps (CUDA only).
    ``batch_invariant``: the target computes every token's row the same way whatever the
    batch and the number of query tokens (:mod:`speculum.backends.torch.native.invariant`),
    so greedy output with speculation equals output without it bit for bit, in any dtype.
    Drafts keep the fast kernels: the target decides every token.
    """

    name = "torch"

    def __init__(self, device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                 runner: str | None = None, cuda_graphs: bool = True, block_size: int = 16,
                 kv_cache_memory: int | None = None, gpu_memory_utilization: float = 0.9,
                 batch_invariant: bool = False, prefill_chunk: int = 512):
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.runner_kind = runner or os.environ.get("SPECULUM_RUNNER", "auto")
        if self.runner_kind not in RUNNERS:
            raise ConfigError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner_kind!r}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        self.cuda_graphs = cuda_graphs
        if not isinstance(batch_invariant, bool):
            raise ConfigError(f"batch_invariant must be True or False, got {batch_invariant!r}")
        self.batch_invariant = batch_invariant
        if batch_invariant and self.runner_kind == "hf":
            raise ConfigError("batch_invariant needs the native runner (its kernels are the invariant ones); "
                              "use runner='auto' or 'native'")
        self.block_size = block_size
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be an integer >= 1 (prompt tokens per prefill forward), "
                              f"got {prefill_chunk!r}")
        #: prompt tokens per prefill forward of the native runner (a longer prompt takes several)
        self.prefill_chunk = prefill_chunk
        self.kv_cache_memory = kv_cache_memory
        self.gpu_memory_utilization = gpu_memory_utilization
        #: every loaded runner; the paged ones and the registered caches are the cache groups
        self.runners: list = []
        self.caches: list = []
        self.plan = None
        self._allocators: list[PagedKVAllocator] = []

    def load_model(self, path: Path, role: str = "target", max_model_len: int | None = None,
                   num_layers: int | None = None):
        """Load the checkpoint at ``path`` as a runner for ``role`` ("target", "draft", ...).

        ``num_layers`` keeps only the first layers (a cheap self-draft for experiments).
        """
        from speculum.backends.torch.native.arch import read_arch

        arch, why = (None, "runner=hf asked for") if self.runner_kind == "hf" else read_arch(path, num_layers, max_model_len)
        if arch is None and self.runner_kind == "native":
            raise ConfigError(f"runner='native' cannot serve {path}: {why}; use runner='auto' or 'hf'")
        invariant = self.batch_invariant and role == "target"
        if arch is None and invariant:
            raise ConfigError(f"batch_invariant needs the native runner, which cannot serve {path}: {why}; "
                              "leave batch_invariant off for this model")
        if arch is not None:
            from speculum.backends.torch.native.runner import NativeRunner
            from speculum.backends.torch.native.weights import build_native
            try:
                model = build_native(path, arch, self.dtype, self.device).set_batch_invariant(invariant)
            except ModelLoadError:
                raise
            except Exception as exc:
                raise ModelLoadError(f"could not load {role} model from {path}: {type(exc).__name__}: {exc}") from exc
            limit = arch.context_limit(role, max_model_len)
            runner = NativeRunner(model, name=role, max_model_len=limit, cuda_graphs=self.cuda_graphs,
                                  prefill_chunk=self.prefill_chunk)
            log.info("%s model %s: native %s runner (paged KV%s%s%s), %s on %s", role, Path(path).name,
                     arch.model_type, ", CUDA graphs" if runner.cuda_graphs else "",
                     ", batch-invariant kernels" if invariant else "",
                     ", oneDNN-packed GEMMs" if runner.packed_bytes else "", str(self.dtype).replace("torch.", ""),
                     self.device)
        else:
            runner = self._load_hf(path, role, max_model_len, num_layers)
            log.info("%s model %s: transformers runner (%s: %s), %s on %s", role, Path(path).name,
                     type(runner.model).__name__, why, str(self.dtype).replace("torch.", ""), self.device)
        self.runners.append(runner)
        return runner

    def _load_hf(self, path, role, max_model_len, num_layers) -> HFRunner:
        from transformers import AutoConfig, AutoModelForCausalLM
        try:
            cfg = AutoConfig.from_pretrained(str(path))
            if num_layers is not None:
                cfg.num_hidden_layers = num_layers
                if getattr(cfg, "layer_types", None):
                    cfg.layer_types = cfg.layer_types[:num_layers]
            model = AutoModelForCausalLM.from_pretrained(str(path), config=cfg, dtype=self.dtype)
        except Exception as exc:
            raise ModelLoadError(f"could not load {role} model from {path}: {type(exc).__name__}: {exc}") from exc
        model.to(self.device)
        limit = max_model_len or getattr(model.config, "max_position_embeddings", None)
        return HFRunner(model, SimpleKVAllocator(group=role, max_model_len=limit), name=role)

    # -- memory ---------------------------------------------------------------------------
    def kv_budget_bytes(self, cap: int | None = None) -> int:
        """Bytes for KV: ``kv_cache_memory`` if set, else what the device allows (CUDA:
        ``gpu_memory_utilization`` of the card minus what is in use and an activation
        reserve; CPU: 2 GiB), never more than ``cap`` (what the engine can ever use)."""
        if self.kv_cache_memory is not None:
            return int(self.kv_cache_memory)
        if self.device.type != "cuda":
            return min(CPU_DEFAULT_KV_BYTES, cap or CPU_DEFAULT_KV_BYTES)
        # weights are loaded by now, so they are already out of ``free``
        free, total = torch.cuda.mem_get_info(self.device)
        activation_reserve = 2 << 30
        avail = int(free - total * (1 - self.gpu_memory_utilization) - activation_reserve)
        return min(avail, cap) if cap else avail

    def plan_memory(self, max_model_len: int, max_num_seqs: int | None = None, lookahead: int = 0) -> None:
        """Give every paged runner an allocator with the same number of blocks.

        ``lookahead``: draft tokens per step (k). A draft cache runs up to k positions
        ahead of its sequence, so with draft caches one sequence needs ``max_model_len +
        k`` tokens of blocks; the target never holds more than ``max_model_len``. Without
        an explicit ``kv_cache_memory`` the budget is capped at what ``max_num_seqs``
        sequences can use (plus slack), so several engines can share a device.
        """
        paged = [r for r in self.runners if isinstance(r, CacheGroup)] + self.caches
        if not paged:
            return
        overshoot = lookahead if len(paged) > 1 else 0
        cap = None
        if max_num_seqs:
            blocks = max_num_seqs * (blocks_for(max_model_len + overshoot, self.block_size) + 1) + 2
            cap = blocks * self.block_size * sum(r.kv_bytes_per_token for r in paged)
        plan = plan_kv_memory(
            self.kv_budget_bytes(cap),
            {f"{r.name}#{i}": r.kv_bytes_per_token for i, r in enumerate(paged)},
            self.block_size,
            {f"{r.name}#{i}": r.weight_bytes for i, r in enumerate(paged)},
            max_model_len, overshoot,
        )
        self.plan = plan
        log.info(plan.describe())
        self._allocators = []
        for r in paged:
            limit = max_model_len if r.name == "target" else max_model_len + lookahead
            alloc = PagedKVAllocator(group=r.name, num_blocks=plan.num_blocks, block_size=self.block_size,
                                     max_model_len=min(r.max_model_len, limit))
            r.attach_cache(alloc)
            self._allocators.append(alloc)

    def kv_allocators(self) -> list[PagedKVAllocator]:
        """The planned allocators of every paged cache group (target first), for the scheduler."""
        return list(self._allocators)

    def register_cache(self, group: CacheGroup) -> None:
        """Plan ``group`` (a draft head's KV cache) with the runners' caches."""
        self.caches.append(group)

    def capture(self, runner, batch_sizes, query_lens, hidden_layers=(), tree_query_lens=()) -> int:
        """CUDA graphs of the native runner's decode/verify shapes (none elsewhere);
        ``tree_query_lens``: token-tree verify shapes (root + nodes)."""
        from speculum.backends.torch.native.runner import NativeRunner
        if not isinstance(runner, NativeRunner) or not runner.cuda_graphs:
            return 0
        return runner.capture(batch_sizes, query_lens, max_block_buckets=1, hidden_layers=hidden_layers,
                              tree_query_lens=tree_query_lens)
