"""The torch backend: loads transformers causal LMs as roll-back-able runners."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from speculum.backends.torch.hf_runner import HFRunner
from speculum.errors import ConfigError, ModelLoadError
from speculum.kv import SimpleKVAllocator

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


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
    """Runs transformers models with PyTorch on CPU or CUDA."""

    name = "torch"

    def __init__(self, device: str | torch.device | None = None, dtype: str | torch.dtype | None = None):
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)

    def load_model(self, path: Path, role: str = "target", max_model_len: int | None = None,
                   num_layers: int | None = None) -> HFRunner:
        """Load the transformers checkpoint at ``path`` as a runner for ``role``.

        ``num_layers`` keeps only the first layers (a cheap self-draft for experiments).
        """
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            cfg = AutoConfig.from_pretrained(str(path))
            if num_layers is not None:
                cfg.num_hidden_layers = num_layers
                if hasattr(cfg, "layer_types") and cfg.layer_types:
                    cfg.layer_types = cfg.layer_types[:num_layers]
            model = AutoModelForCausalLM.from_pretrained(str(path), config=cfg, dtype=self.dtype)
        except Exception as exc:
            raise ModelLoadError(f"could not load {role} model from {path}: {type(exc).__name__}: {exc}") from exc
        model.to(self.device)
        log.info("%s model %s: transformers runner (%s), %s on %s", role, Path(path).name,
                 type(model).__name__, str(self.dtype).replace("torch.", ""), self.device)
        limit = max_model_len or getattr(model.config, "max_position_embeddings", None)
        return HFRunner(model, SimpleKVAllocator(group=role, max_model_len=limit), name=role)
