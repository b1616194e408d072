"""Built-in lossless verifiers, registered as a default plugin."""

from speculum.hooks import hookimpl
from speculum.verifiers.greedy import GreedyVerifier, greedy_verify
from speculum.verifiers.rejection import RejectionSampler, rejection_sample

__all__ = ["GreedyVerifier", "RejectionSampler", "greedy_verify", "rejection_sample"]


@hookimpl
def speculum_register_verifiers(register):
    register("rejection_sampler", RejectionSampler, lossless=True,
             description="exact rejection sampling; greedy rows use argmax matching")
    register("greedy", GreedyVerifier, lossless=True,
             description="exact argmax matching; temperature 0 only")
