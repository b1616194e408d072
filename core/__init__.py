"""speculum: speculative decoding with one plugin API for every method, proven lossless."""

from speculum.config import SpeculativeConfig
from speculum.errors import ConfigError, ModelLoadError, PluginError, RequestError
from speculum.hooks import hookimpl
from speculum.interfaces import Draft, KVAllocator, ProposeBatch, Proposer, StepFeedback, Verdict, Verifier
from speculum.metrics import SpecDecodeMetrics
from speculum.model_source import cache_root
from speculum.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM", "SamplingParams", "SpeculativeConfig", "RequestOutput", "hookimpl",
    "Proposer", "Verifier", "KVAllocator", "Draft", "Verdict", "ProposeBatch", "StepFeedback",
    "SpecDecodeMetrics", "ConfigError", "PluginError", "ModelLoadError", "RequestError", "cache_root",
]


def __getattr__(name):  # the engine pulls in torch models; import it lazily
    if name == "LLM":
        from speculum.engine import LLM
        return LLM
    if name == "RequestOutput":
        from speculum.outputs import RequestOutput
        return RequestOutput
    raise AttributeError(name)
