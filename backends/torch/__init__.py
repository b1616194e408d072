"""The torch backend (default plugin)."""

from speculum.backends.torch.backend import TorchBackend
from speculum.backends.torch.hf_runner import HFRunner
from speculum.hooks import hookimpl

__all__ = ["TorchBackend", "HFRunner"]


@hookimpl
def speculum_register_backends(register):
    register("torch", TorchBackend, description="PyTorch on CPU/CUDA; runs any transformers causal LM")
