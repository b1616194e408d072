"""Lossless verifiers in jax.numpy: the twins of :mod:`speculum.verifiers` (same semantics).

Notation of the papers (Leviathan et al. 2023; Chen et al. 2023): ``p`` is the target
distribution, ``q`` the draft distribution. Draft token ``x_i ~ q_i`` is accepted with
probability ``min(1, p_i(x) / q_i(x))``; on the first rejection the output is drawn from
the residual ``norm(max(0, p_i - q_i))``; when every draft is accepted a bonus token is
drawn from ``p_k``. With no draft probabilities the draft is one-hot (q(x) = 1).
Greedy verification accepts the longest prefix of drafts equal to the target argmax.

The pure functions (:func:`greedy_verify_jnp`, :func:`rejection_sample_jnp`) take JAX
arrays and per-row PRNG keys; the verifier classes and :func:`rejection_sample` /
:func:`greedy_verify` take and return torch tensors, like the torch verifiers.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import torch

from speculum.backends.jax.convert import host_ints, to_jax
from speculum.backends.jax.sampling import Generators, processed_probs, row_key_data
from speculum.interfaces import Draft, Verdict
from speculum.sampling import SamplingBatch


def _emitted(draft_ids, num_accepted, last):
    """[B, k+1]: the accepted drafts, then ``last``, then -1 padding."""
    B, k = draft_ids.shape
    pos = jnp.arange(k + 1).reshape(1, k + 1)
    drafted = jnp.concatenate([draft_ids, jnp.full((B, 1), -1, draft_ids.dtype)], axis=1)
    n = num_accepted.reshape(B, 1)
    tokens = jnp.where(pos < n, drafted, -1)
    return jnp.where(pos == n, last.reshape(B, 1).astype(tokens.dtype), tokens)


@jax.jit
def greedy_verify_jnp(target_logits, draft_ids):
    """Accept the longest prefix of ``draft_ids`` [B, k] (-1 padded) equal to the argmax
    of ``target_logits`` [B, k+1, V]; then the argmax at the first mismatch (or the bonus
    position). Returns (tokens [B, k+1], num_accepted [B])."""
    B, k1, _ = target_logits.shape
    k = k1 - 1
    argmax = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, k+1]
    match = (draft_ids == argmax[:, :k]) & (draft_ids >= 0)
    num_accepted = jnp.cumprod(match.astype(jnp.int32), axis=1).sum(axis=1)
    last = jnp.take_along_axis(argmax, num_accepted.reshape(B, 1), axis=1)
    return _emitted(draft_ids, num_accepted, last), num_accepted


@partial(jax.jit, static_argnames=("residual",))
def rejection_sample_jnp(p, q, draft_ids, key_data, residual: str = "max(0,p-q)"):
    """One verification step, vectorised over the batch, in the papers' notation.

    ``p``: [B, k+1, V] target probabilities; ``q``: [B, k, V] draft probabilities or None
    (one-hot drafts); ``draft_ids``: [B, k], -1 padded; ``key_data``: [B, 2] uint32, row
    ``b``'s threefry key (its own random stream). ``residual`` exists so tests can show
    that a wrong residual (``"p"``) is caught; production code never sets it.
    Returns (tokens [B, k+1], num_accepted [B]).
    """
    B, k1, V = p.shape
    k = k1 - 1
    keys = jax.random.wrap_key_data(key_data, impl="threefry2x32")
    # [B, k + V] uniforms in [0, 1) from each row's own key: k acceptance tests, then V
    # for the final draw (one generator call per row: XLA compiles one threefry, not three)
    uniforms = jax.vmap(lambda key: jax.random.uniform(key, (k + V,)))(keys)
    if k > 0:
        valid = jnp.cumprod((draft_ids >= 0).astype(jnp.int32), axis=1)  # [B, k]
        n_draft = valid.sum(axis=1)
        ids = jnp.maximum(draft_ids, 0)
        # [B, k] p_i(x_i) and q_i(x_i)
        p_x = jnp.take_along_axis(p[:, :k], ids[..., None], axis=-1)[..., 0]
        q_x = jnp.take_along_axis(q, ids[..., None], axis=-1)[..., 0] if q is not None else jnp.ones_like(p_x)
        u = uniforms[:, :k]
        accept = (u * q_x < p_x) & (valid > 0)  # u < p/q without dividing by zero
        num_accepted = jnp.cumprod(accept.astype(jnp.int32), axis=1).sum(axis=1)
    else:
        n_draft = num_accepted = jnp.zeros(B, jnp.int32)
    # [B, V] target distribution at the first non-accepted position
    p_i = jnp.take_along_axis(p, num_accepted.reshape(B, 1, 1), axis=1)[:, 0]
    dist = p_i
    if k > 0 and residual != "p":  # computed for every row: no data-dependent branch
        at = jnp.minimum(num_accepted, k - 1).reshape(B, 1)
        if q is not None:
            q_i = jnp.take_along_axis(q, at[..., None], axis=1)[:, 0]
        else:
            q_i = jax.nn.one_hot(jnp.take_along_axis(ids, at, axis=1)[:, 0], V, dtype=p.dtype)
        res = jnp.maximum(p_i - q_i, 0)
        # p == q exactly makes rejection impossible; guard the empty residual anyway
        res = jnp.where(res.sum(-1, keepdims=True) > 0, res, p_i)
        dist = jnp.where((num_accepted < n_draft).reshape(B, 1), res, p_i)
    # exponential race: argmax(dist / E), E = -log(U) ~ Exp(1) (> 0: U < 1), samples from
    # dist (unnormalised ok); a token of probability 0 is never chosen
    e = -jnp.log(jnp.maximum(uniforms[:, k:], jnp.finfo(jnp.float32).tiny))
    last = jnp.argmax(jnp.where(dist > 0, dist / e, -1.0), axis=-1)
    return _emitted(draft_ids, num_accepted, last), num_accepted


@partial(jax.jit, static_argnames=("flags", "residual"))
def _verify_sampled(logits, q, draft_ids, temperature, top_k, top_p, key_data, flags, residual="max(0,p-q)"):
    p = processed_probs(logits, temperature, top_k, top_p, flags=flags)
    tokens, num_accepted = rejection_sample_jnp(p, q, draft_ids, key_data, residual=residual)
    if flags[2]:  # greedy rows: exact argmax matching
        g_tokens, g_accepted = greedy_verify_jnp(logits, draft_ids)
        greedy = temperature == 0
        tokens = jnp.where(greedy[:, None], g_tokens, tokens)
        num_accepted = jnp.where(greedy, g_accepted, num_accepted)
    return tokens, num_accepted


def _verdict(tokens, num_accepted) -> Verdict:
    """A Verdict of host int64 torch tensors (the loop reads them on the host anyway)."""
    return Verdict(token_ids=torch.from_numpy(np.asarray(tokens).astype(np.int64)),
                   num_accepted=torch.from_numpy(np.asarray(num_accepted).astype(np.int64)))


def _draft_ids(draft_ids: torch.Tensor, batch_size: int) -> np.ndarray:
    ids = host_ints(draft_ids)
    return ids.reshape(batch_size, -1)


def _pad_rows(x, rows: int, value=0):
    """``x`` with rows appended up to ``rows`` (filled with ``value``): verify programs then
    compile per batch bucket, not per batch size."""
    extra = rows - x.shape[0]
    if extra == 0:
        return x
    pad = [(0, extra)] + [(0, 0)] * (x.ndim - 1)
    if isinstance(x, np.ndarray):
        return np.pad(x, pad, constant_values=value)
    return jnp.pad(x, pad, constant_values=value)


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# ------------------------------------------------------------------ torch in, torch out
def greedy_verify(target_logits: torch.Tensor, draft_ids: torch.Tensor) -> Verdict:
    """:func:`greedy_verify_jnp` with torch tensors (the twin of the torch ``greedy_verify``)."""
    B = target_logits.shape[0]
    Bb = _bucket(B)
    tokens, num_accepted = greedy_verify_jnp(_pad_rows(to_jax(target_logits), Bb),
                                             _pad_rows(_draft_ids(draft_ids, B), Bb, -1))
    return _verdict(tokens[:B], num_accepted[:B])


def rejection_sample(p: torch.Tensor, q: torch.Tensor | None, draft_ids: torch.Tensor, generators: Generators,
                     residual: str = "max(0,p-q)") -> Verdict:
    """:func:`rejection_sample_jnp` with torch tensors and torch generators (one per row, or one
    for all rows), which seed the rows' JAX keys (:func:`row_key_data`)."""
    B = p.shape[0]
    q_j = to_jax(q.float()) if q is not None else None
    return _verdict(*rejection_sample_jnp(to_jax(p.float()), q_j, _draft_ids(draft_ids, B),
                                          row_key_data(generators, B), residual=residual))


class JaxGreedyVerifier:
    """Exact argmax matching in jax.numpy. Lossless for temperature 0; refuses sampled requests."""

    lossless = True

    def verify(self, target_logits: torch.Tensor, draft: Draft, sampling: SamplingBatch) -> Verdict:
        if not sampling.all_greedy:
            raise ValueError(
                "the greedy verifier only serves temperature 0 requests; use "
                "acceptance_method='rejection_sampler_jax' for sampled requests"
            )
        return greedy_verify(target_logits, draft.token_ids)


class JaxRejectionSampler:
    """Verifies sampled and greedy requests losslessly, in jax.numpy.

    Temperature, top-k and top-p are applied to the target logits exactly as the torch
    sampler does (drafts arrive already processed as ``draft.probs``). Greedy rows use
    exact argmax matching. Row ``b``'s randomness is a JAX key drawn from its request's
    generator each step.
    """

    lossless = True

    def verify(self, target_logits: torch.Tensor, draft: Draft, sampling: SamplingBatch) -> Verdict:
        if sampling.all_greedy:
            return greedy_verify(target_logits, draft.token_ids)
        B, _, V = target_logits.shape
        flags = sampling.flags(V)
        if flags is None:
            t = sampling.temperature
            flags = (bool(((sampling.top_k > 0) & (sampling.top_k < V)).any()), bool((sampling.top_p < 1).any()),
                     bool((t == 0).any()))
        Bb = _bucket(B)
        q = _pad_rows(to_jax(draft.probs.float()), Bb) if draft.probs is not None else None
        # padding rows: no drafts, temperature 1, no filters
        tokens, num_accepted = _verify_sampled(
            _pad_rows(to_jax(target_logits.float()), Bb), q, _pad_rows(_draft_ids(draft.token_ids, B), Bb, -1),
            _pad_rows(np.asarray(sampling.temperature.float().cpu()), Bb, 1.0),
            _pad_rows(host_ints(sampling.top_k), Bb), _pad_rows(np.asarray(sampling.top_p.float().cpu()), Bb, 1.0),
            _pad_rows(row_key_data(sampling.generators, B), Bb), flags=tuple(bool(f) for f in flags))
        return _verdict(tokens[:B], num_accepted[:B])
