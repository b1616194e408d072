"""EAGLE-1 and EAGLE-3 hidden-state draft heads: a speculum plugin."""

from speculum_eagle.model import Eagle1Head, Eagle3Head
from speculum_eagle.proposer import Eagle3Options, make_eagle, make_eagle3

__all__ = ["Eagle1Head", "Eagle3Head", "Eagle3Options", "make_eagle", "make_eagle3"]
