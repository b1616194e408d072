"""Typical acceptance (Medusa-2): a lossy verifier for speculum."""

from speculum_typical_acceptance.rule import typical_accept
from speculum_typical_acceptance.verifier import TypicalAcceptanceOptions, TypicalAcceptanceVerifier

__all__ = ["TypicalAcceptanceOptions", "TypicalAcceptanceVerifier", "typical_accept"]
