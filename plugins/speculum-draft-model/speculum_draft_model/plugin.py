"""Entry point: registers the ``draft_model`` method for the torch and JAX backends (it drives
the backend's runner through ``speculum.proposers.draft_loop``)."""

from speculum import hookimpl
from speculum_draft_model.proposer import DraftModelOptions, DraftModelProposer


@hookimpl
def speculum_register_proposers(register):
    register("draft_model", DraftModelProposer.from_context, backends=("torch", "jax"), options=DraftModelOptions,
             description="a separate smaller model with the same vocabulary drafts k tokens")
