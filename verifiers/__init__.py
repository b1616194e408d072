"""Built-in lossless verifiers, registered as a default plugin.

Building blocks for verifier plugins: :func:`verify_sampled` (run a rule on the processed
target distribution, greedy rows by argmax), :class:`RowNoise` (per-row acceptance and
sampling noise), :func:`keyed_exponentials` (noise keyed by seed and position), :func:`greedy_verify`, :func:`rejection_sample`, :func:`block_verify`;
for token trees :func:`verify_tree_sampled` (the same for a tree rule),
:func:`tree_greedy_verify`, :func:`tree_rejection_sample` and :func:`path_verdict` (a tree rule's accepted path as a :class:`~speculum.Verdict`).
"""

from speculum.hooks import hookimpl
from speculum.verifiers.block import BlockVerifier, block_verify, block_weights
from speculum.verifiers.exact import ExactMatchVerifier, exact_match_sample, exact_match_tree
from speculum.verifiers.greedy import GreedyVerifier, greedy_verify
from speculum.verifiers.noise import RowNoise, keyed_exponentials, race
from speculum.verifiers.rejection import RejectionSampler, rejection_sample
from speculum.verifiers.sampled import verify_sampled
from speculum.verifiers.tree import path_verdict, tree_greedy_verify, tree_rejection_sample, verify_tree_sampled

__all__ = ["BlockVerifier", "ExactMatchVerifier", "GreedyVerifier", "RejectionSampler", "RowNoise", "block_verify",
           "block_weights", "exact_match_sample", "exact_match_tree", "greedy_verify", "keyed_exponentials", "path_verdict", "race", "rejection_sample", "tree_greedy_verify", "tree_rejection_sample",
           "verify_sampled", "verify_tree_sampled"]


@hookimpl
def speculum_register_verifiers(register):
    register("rejection_sampler", RejectionSampler, lossless=True,
             description="exact rejection sampling, token by token; greedy rows use argmax matching")
    register("block", BlockVerifier, lossless=True,
             description="exact block verification (Sun et al. 2025): accepts the draft block jointly, "
                         "never fewer tokens in expectation; one-hot drafts token-wise")
    register("exact_match", ExactMatchVerifier, lossless=True,
             description="exact: the target samples each position with noise keyed by (seed, position) and a "
                         "draft token stays when it equals that sample; with batch_invariant=True a seeded "
                         "request samples the same tokens with and without speculation")
    register("greedy", GreedyVerifier, lossless=True,
             description="exact argmax matching; temperature 0 only")
