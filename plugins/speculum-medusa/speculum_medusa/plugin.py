"""Entry point: registers ``medusa`` and detects Medusa checkpoints (``medusa_num_heads``)."""

from speculum import hookimpl
from speculum_medusa.formats import detect
from speculum_medusa.proposer import MedusaProposer


@hookimpl
def speculum_register_proposers(register):
    register("medusa", MedusaProposer.from_context, backends=("torch",),
             description="Medusa-1 heads: head i drafts token t+i+1 from the target's last hidden state")


@hookimpl
def speculum_detect_method(model_path, config):
    return detect(model_path, config)


@hookimpl
def speculum_register_trainers(register):
    """``speculum train medusa`` (the training code is imported only when used)."""
    register("medusa", "speculum_medusa.train:MedusaTrainer",
             description="Medusa-1 heads (ResBlocks + shared or own LM head), one per draft position")
