"""Per-row random noise of a verification step: acceptance uniforms, then sampling noise.

A verifier draws its randomness through :class:`RowNoise`, from the generators of the
step's rows (one ``torch.Generator`` per request, or one for the whole batch), in a fixed
order: first the acceptance uniforms ``[B, k]``, then the exponentials ``[B, V]`` of the
token it samples (the replacement after a rejection, or the bonus token).

Why the two are independent. A ``torch.Generator`` is a stream with state: every draw
consumes fresh values and advances the state past them. On the CPU the Mersenne Twister
state steps forward by the values drawn; on CUDA each kernel reads Philox counters
``(seed, offset ..)`` and then moves the generator's offset past every counter it may
have read, so the next kernel starts on counters nobody used. The uniforms and the
exponentials of one step are therefore disjoint segments of one stream, which a PRNG
makes independent; so are the draft tokens a proposer sampled from the same generator
earlier in the step, and the noise of the next step. (Counts drawn never depend on
outcomes: ``k`` uniforms and ``V`` exponentials per row, whatever was accepted, so a
seeded request reproduces under any batching.)

What breaks it is two consumers reading the same counters: vLLM keyed the draft's Gumbel
noise, the acceptance uniform and the recovery noise by the token position (one Philox
offset for all three), so the recovered token reused the noise that had picked the
rejected draft and favoured draft-preferred tokens. Here that would mean drawing the
exponentials from a copy of the generator taken before the uniforms (or a CUDA graph that
replays a captured offset without registering the generator). ``tests/test_verifier_noise.py``
shows the token a verifier samples is independent of the uniforms that decided
acceptance, and that the same test rejects a shared-offset variant.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from speculum.devices import on_device

Generators = Sequence[torch.Generator | None] | torch.Generator | None


@attrs.define(eq=False)
class RowNoise:
    """Draws ``[B, n]`` noise where row ``b`` comes from its own generator.

    ``generators``: one per row (None rows use torch's default generator), a single
    generator for every row (tests), or None (the default generator).
    """

    generators: Generators

    def _draw(self, B: int, n: int, device, kind: str) -> torch.Tensor:
        def one(shape, gen):
            t = torch.empty(shape, device=device)
            return t.uniform_(generator=gen) if kind == "uniform" else t.exponential_(generator=gen)

        gens = self.generators
        if gens is None or isinstance(gens, torch.Generator):
            return one((B, n), gens)
        if not B or not n:  # nothing to draw (no drafts: no acceptance uniforms); no stream moves
            return torch.empty((B, n), device=device)
        shared = [b for b, g in enumerate(gens) if g is None]
        if len(shared) == B:
            return one((B, n), None)
        if len(shared) < 2:
            return torch.stack([one((n,), g) for g in gens])
        # rows without a generator of their own (greedy requests in a mixed batch) draw from
        # the default generator in one call, in row order: one launch instead of one each
        own = [b for b, g in enumerate(gens) if g is not None]
        drawn = torch.cat([one((len(shared), n), None)] + [one((1, n), gens[b]) for b in own])
        return torch.empty((B, n), device=device).index_copy_(0, on_device(shared + own, device), drawn)

    def uniforms(self, B: int, n: int, device) -> torch.Tensor:
        """[B, n] U[0, 1): the acceptance noise (drawn first)."""
        return self._draw(B, n, device, "uniform")

    def exponentials(self, B: int, n: int, device) -> torch.Tensor:
        """[B, n] Exp(1), bounded away from 0: the sampling noise (drawn second)."""
        # an exact 0 would turn 0 / 0 into NaN, which argmax takes for the maximum
        return self._draw(B, n, device, "exponential").clamp_min_(torch.finfo(torch.float32).tiny)


def as_noise(generators: "Generators | RowNoise") -> RowNoise:
    """Generators (per row, one, or None) as a :class:`RowNoise`; a RowNoise as is."""
    return generators if isinstance(generators, RowNoise) else RowNoise(generators)


def race(dist: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """[B] one token per row of ``dist`` [B, V] (unnormalised is fine) with Exp(1) noise ``e``.

    The exponential race: ``argmax(dist / e)`` is distributed as ``dist / dist.sum()``.
    """
    return (dist / e).argmax(dim=-1)


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser on int64 tensors holding values < 2**32 (multipliers
    below 2**31, so no product leaves int64)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x297A2D39) & _M32
    return x ^ (x >> 15)


def keyed_exponentials(seeds: torch.Tensor, positions: torch.Tensor, n: int, V: int) -> torch.Tensor:
    """[B, n, V] Exp(1) noise where entry (b, j, v) depends on (seeds[b], positions[b] + j, v) only.

    Noise keyed by position instead of drawn from a stream: the token sampled at a
    position does not depend on how many draws came before it (how many drafts were
    verified, whether speculation was on), so with batch-invariant logits a seeded
    request samples the same tokens with and without speculation when drafts are
    checked by exact match (:mod:`speculum.verifiers.exact`). Counter-based, like
    Philox: a hash of (seed, position, token id), 24 bits to a uniform in (0, 1).
    """
    dev = positions.device
    seeds = seeds.to(dev, torch.int64)
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    pos = positions.to(torch.int64).view(-1, 1) + torch.arange(n, device=dev).view(1, n)  # [B, n]
    row = _mix32(_mix32(lo) ^ hi)
    row = _mix32(row.view(-1, 1) ^ (pos & _M32))  # [B, n]
    v = torch.arange(V, device=dev, dtype=torch.int64)
    h = _mix32((row.unsqueeze(-1) * 0x01000193 + v) & _M32)  # [B, n, V]
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(u)
