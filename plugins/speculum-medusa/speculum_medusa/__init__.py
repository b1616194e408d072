"""Medusa-1 draft heads: a speculum plugin."""

from speculum_medusa.model import MedusaHeads, ResBlock
from speculum_medusa.proposer import MedusaProposer

__all__ = ["MedusaHeads", "MedusaProposer", "ResBlock"]
