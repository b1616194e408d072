"""Entry point: registers the ``ngram`` method (model-free: any backend's runner serves it)."""

from speculum import hookimpl
from speculum_ngram.proposer import NgramOptions, NgramProposer


@hookimpl
def speculum_register_proposers(register):
    register("ngram", NgramProposer.from_context, backends=("torch", "jax"), options=NgramOptions,
             description="prompt lookup: copy what followed the longest earlier match of the suffix")
