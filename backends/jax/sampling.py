"""Temperature, top-k and top-p in jax.numpy: the twin of :func:`speculum.sampling.processed_probs`.

Also turns a step's torch generators into per-row JAX PRNG keys, so a request's
randomness comes from its own seed whatever batch it runs in.
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch

from speculum.backends.jax.convert import to_jax, to_torch

Generators = Sequence[torch.Generator | None] | torch.Generator | None


@partial(jax.jit, static_argnames=("flags",))
def processed_probs(logits, temperature, top_k, top_p, flags: tuple[bool, bool, bool] = (True, True, True)):
    """Turn logits into the distribution a request samples from.

    ``logits``: [B, T, V]; ``temperature``, ``top_k``, ``top_p``: [B]. Returns float32
    probabilities [B, T, V]; greedy rows (temperature 0) get a one-hot at the argmax.
    ``flags`` = (any top-k, any top-p, any greedy row), static: the filters not needed
    are not compiled in. Semantics of the torch twin: temperature first, then top-k,
    then top-p over the top-k survivors (keep tokens until the mass before them reaches
    ``top_p``; the most likely token always stays).
    """
    logits = logits.astype(jnp.float32)
    B, T, V = logits.shape
    greedy = temperature == 0
    t = jnp.where(greedy, 1.0, temperature).reshape(B, 1, 1)
    scaled = logits / t
    need_k, need_p, any_greedy = flags
    if need_k or need_p:
        order = jnp.argsort(-scaled, axis=-1, stable=True)  # descending
        sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
        remove = jnp.zeros(sorted_logits.shape, dtype=bool)
        if need_k:
            k = top_k.reshape(B, 1, 1)
            remove |= (k > 0) & (jnp.arange(V).reshape(1, 1, V) >= k)
        if need_p:
            sp = jax.nn.softmax(jnp.where(remove, -jnp.inf, sorted_logits), axis=-1)
            # mass strictly before each token; keep tokens until that mass reaches top_p
            before = jnp.cumsum(sp, axis=-1) - sp
            remove |= before >= top_p.reshape(B, 1, 1)
            remove = remove.at[..., 0].set(False)
        sorted_logits = jnp.where(remove, -jnp.inf, sorted_logits)
        scaled = jnp.take_along_axis(sorted_logits, jnp.argsort(order, axis=-1), axis=-1)
    probs = jax.nn.softmax(scaled, axis=-1)
    if any_greedy:
        onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), V, dtype=probs.dtype)
        probs = jnp.where(greedy.reshape(B, 1, 1), onehot, probs)
    return probs


def processed_probs_torch(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                          top_p: torch.Tensor, flags: tuple[bool, bool, bool] | None = None) -> torch.Tensor:
    """:func:`processed_probs` with torch tensors in and out (same signature as the torch twin)."""
    if flags is None:
        V = logits.shape[-1]
        flags = (bool(((top_k > 0) & (top_k < V)).any()), bool((top_p < 1).any()), bool((temperature == 0).any()))
    out = processed_probs(to_jax(logits.float()), jnp.asarray(temperature.float().cpu().numpy()),
                          jnp.asarray(top_k.cpu().numpy().astype(np.int32)), jnp.asarray(top_p.float().cpu().numpy()),
                          flags=tuple(bool(f) for f in flags))
    return to_torch(out, logits.device)


def row_key_data(generators: Generators, batch_size: int) -> np.ndarray:
    """[B, 2] uint32 threefry keys, one per row, drawn from the rows' torch generators.

    Each step, row ``b`` takes one 62-bit seed from its own generator (seeded with the
    request's seed), so its keys depend on that request alone: reproducible, and the same
    under any batching. A single generator (or None: torch's global one) gives every row
    its own draw in turn.
    """
    def draw(gen: torch.Generator | None, n: int) -> list[int]:
        device = gen.device if gen is not None else "cpu"
        return torch.randint(0, 2 ** 62, (n,), generator=gen, device=device).tolist()

    if generators is None or isinstance(generators, torch.Generator):
        seeds = draw(generators, batch_size)
    else:
        seeds = [s for g in generators for s in draw(g, 1)]
    s = np.asarray(seeds, dtype=np.uint64)
    # the key PRNGKey(seed) makes for a 64-bit seed: [high word, low word]
    return np.stack([(s >> np.uint64(32)).astype(np.uint32), (s & np.uint64(0xFFFFFFFF)).astype(np.uint32)], axis=1)
