"""Entry point: registers ``mtp`` and detects checkpoints with MTP layers."""

from speculum import hookimpl
from speculum_mtp.formats import detect
from speculum_mtp.proposer import MTPOptions, make_mtp


@hookimpl
def speculum_register_proposers(register):
    register("mtp", make_mtp, backends=("torch",), options=MTPOptions,
             description="DeepSeek-V3-style MTP module over the target's hidden state, reused for k > 1")


@hookimpl
def speculum_detect_method(model_path, config):
    return detect(model_path, config)


@hookimpl
def speculum_register_trainers(register):
    """``speculum train mtp`` (the training code is imported only when used)."""
    register("mtp", "speculum_mtp.train:MTPTrainer",
             description="DeepSeek-V3-style MTP module (enorm/hnorm, eh_proj, one decoder layer, shared head)")
