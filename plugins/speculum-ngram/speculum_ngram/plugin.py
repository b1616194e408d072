"""Entry point: registers the ``ngram`` method for the torch backend."""

from speculum import hookimpl
from speculum_ngram.proposer import NgramOptions, NgramProposer


@hookimpl
def speculum_register_proposers(register):
    register("ngram", NgramProposer.from_context, backends=("torch",), options=NgramOptions,
             description="prompt lookup: copy what followed the longest earlier match of the suffix")
