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
