"""The torch backend (a default plugin), and its public API.

Public (what core tools and plugins may import from here): :class:`TorchBackend`,
:class:`HFRunner`, ``resolve_device``, ``resolve_dtype``, ``read_state_dict`` (a
checkpoint's tensors), and the native Llama runner's ``NativeRunner``, ``LlamaArch``
(a Llama-family config) and ``random_native`` (a random model of a shape, for
benchmarks). The draft-head building blocks are the public module
:mod:`speculum.backends.torch.heads` (for plugins); what core's trainer needs of them is
re-exported here: ``TargetParts``, ``TrainContext``, ``arch_from_config`` and
``load_layer``; what a verifier needs to replay its own work as a CUDA graph:
``GraphPool`` and ``bucket``; and the fused greedy acceptance of a token tree that
:mod:`speculum.verifiers.tree` runs on CUDA: ``greedy_tree_path``, and of a chain
(:mod:`speculum.verifiers.greedy`): ``greedy_chain_verdict``. Everything else under
this package (``native/``, ``graphs``...) is internal.
"""

from speculum.backends.torch.backend import TorchBackend, resolve_device, resolve_dtype
from speculum.backends.torch.hf_runner import HFRunner
from speculum.hooks import hookimpl

__all__ = ["TorchBackend", "HFRunner", "resolve_device", "resolve_dtype", "read_state_dict", "NativeRunner",
           "LlamaArch", "random_native", "TargetParts", "TrainContext", "arch_from_config", "load_layer",
           "GraphPool", "bucket", "greedy_tree_path", "greedy_chain_verdict"]

_LAZY = {"read_state_dict": "speculum.backends.torch.native.weights",
         "random_native": "speculum.backends.torch.native.weights",
         "NativeRunner": "speculum.backends.torch.native.runner",
         "LlamaArch": "speculum.backends.torch.native.arch",
         "TargetParts": "speculum.backends.torch.heads",
         "TrainContext": "speculum.backends.torch.heads",
         "arch_from_config": "speculum.backends.torch.heads",
         "load_layer": "speculum.backends.torch.heads",
         "GraphPool": "speculum.backends.torch.graphs",
         "bucket": "speculum.backends.torch.graphs",
         "greedy_tree_path": "speculum.backends.torch.native.kernels",
         "greedy_chain_verdict": "speculum.backends.torch.native.kernels"}


def __getattr__(name):  # the native model (and Triton on CUDA) load only when asked for
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)


@hookimpl
def speculum_register_backends(register):
    register("torch", TorchBackend, description="PyTorch on CPU/CUDA; runs any transformers causal LM")
