"""Multi-token-prediction (MTP) draft module, DeepSeek-V3 style: a speculum plugin."""

from speculum_mtp.model import MTPHead
from speculum_mtp.proposer import MTPOptions, make_mtp

__all__ = ["MTPHead", "MTPOptions", "make_mtp"]
