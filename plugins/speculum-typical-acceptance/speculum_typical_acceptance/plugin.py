"""Entry point: registers the lossy ``typical_acceptance`` verifier."""

from speculum import hookimpl
from speculum_typical_acceptance.verifier import TypicalAcceptanceOptions, TypicalAcceptanceVerifier


@hookimpl
def speculum_register_verifiers(register):
    register("typical_acceptance", TypicalAcceptanceVerifier, lossless=False, options=TypicalAcceptanceOptions,
             description="typical acceptance (Medusa-2): accepts x when p(x) > min(threshold, alpha * exp(-H(p))); "
                         "output does NOT follow the target distribution")
