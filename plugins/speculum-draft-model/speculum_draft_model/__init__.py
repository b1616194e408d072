"""Draft-model speculation: a speculum plugin."""

from speculum_draft_model.proposer import DraftModelOptions, DraftModelProposer

__all__ = ["DraftModelProposer", "DraftModelOptions"]
