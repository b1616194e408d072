"""How many draft tokens a step proposes: fixed, by batch size, or chosen by a cost model.

``num_speculative_tokens_per_batch_size`` in the speculative config (vLLM's form) maps
inclusive batch-size ranges to ``k``::

    {"1-16": 3, "64-128": 2, "256-4096": 0}        # or [[1, 16, 3], [64, 128, 2], ...]

A batch size in a gap takes the ``k`` of the range before it (17-63 above: 3); below
the first range, ``num_speculative_tokens``. ``k`` is clamped to
``num_speculative_tokens``; ``k = 0`` runs the step without drafts.

``"auto"`` picks ``k`` every step to maximise expected tokens per second::

    rate(k) = sum_b E_b(k) / (T_target(B, k + 1) + T_draft(B, k) + T_other(B))
    E_b(k)  = (1 - a_b^(k+1)) / (1 - a_b)          (k + 1 when a_b = 1)

``T_target(B, q)``: the target's measured cost of verifying ``q`` tokens at batch size
``B`` (:mod:`speculum.cost_model`, profiled at engine start and cached on disk);
``T_draft``: the proposer's measured drafting time per draft token at this batch size;
``T_other``: what the rest of a step's cycle measurably costs (sampling, host work, and
what the engine and a server do between two steps: outputs, streaming), measured apart
for steps with and without drafts; ``a_b``:
request ``b``'s running acceptance, an exponential moving average of accepted drafts
per drafted position reached, and ``u_b`` the share of its steps that got any draft
(:class:`Acceptance`; a new request starts from the engine-wide averages), so that
``E_b(k) = 1 + u_b ((1 - a_b^(k+1)) / (1 - a_b) - 1)`` (the formula above when the
proposer always drafts). ``T_other`` of a step with drafts is never taken below the
plain step's per token emitted, ``T_other(B, 0) * E(k)``: that work (appends, stop
checks, detokenising, streaming) grows with the tokens a step emits, so behind a
host-bound server speculation pays only by the forwards it saves. ``k = 0`` wins ties
within a 5% margin, so the engine never speculates on a predicted gain smaller than the
model's error. When ``k = 0`` was chosen
although a high acceptance (0.9) would make speculation pay, one step in 32 drafts a
single token, so a request whose drafts became good is noticed again; while speculating,
one step in 128 drafts nothing, so the plain step's cost at that batch size is measured
and kept current. Where no k pays even at that high acceptance (a loaded server: the
verify cost grows with every token), the batch size stays off for ``off_for`` choices
that weigh nothing, so the policy costs a loaded host almost no interpreter time.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping, Sequence as Seq

import attrs

from speculum.errors import ConfigError

log = logging.getLogger(__name__)

AUTO = "auto"


def parse_schedule(value: Any, max_k: int) -> tuple[tuple[int, int, int], ...] | str | None:
    """``num_speculative_tokens_per_batch_size`` -> sorted ``((lo, hi, k), ...)`` or ``"auto"``.

    Raises ConfigError on malformed ranges (lo > hi, overlaps, negative k) with the
    expected form. ``k`` above ``max_k`` is clamped to it.
    """
    if value is None:
        return None
    if isinstance(value, str):
        if value == AUTO:
            return AUTO
        raise ConfigError(f"num_speculative_tokens_per_batch_size must be 'auto', a dict of batch-size ranges "
                          f"to k (e.g. {{\"1-16\": 3, \"64-128\": 2, \"256-4096\": 0}}) or a list of [lo, hi, k]; "
                          f"got {value!r}")
    items: list[tuple[int, int, int]] = []
    try:
        if isinstance(value, Mapping):
            for rng, k in value.items():
                text = str(rng).strip()
                lo, _, hi = text.partition("-")
                items.append((int(lo), int(hi) if hi else int(lo), _int(k)))
        else:
            for entry in value:
                lo, hi, k = entry
                items.append((_int(lo), _int(hi), _int(k)))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"num_speculative_tokens_per_batch_size: cannot read {value!r} ({exc}); write "
                          '{"1-16": 3, "64-128": 2} (inclusive batch-size ranges to k) or [[1, 16, 3], ...]') from None
    if not items:
        raise ConfigError("num_speculative_tokens_per_batch_size is empty; give at least one range or leave it unset")
    items.sort()
    for lo, hi, k in items:
        if lo < 1 or hi < lo:
            raise ConfigError(f"num_speculative_tokens_per_batch_size: range {lo}-{hi} is not a range of batch "
                              "sizes (1 <= lo <= hi)")
        if k < 0:
            raise ConfigError(f"num_speculative_tokens_per_batch_size: k must be >= 0 (0 = no speculation), "
                              f"got {k} for {lo}-{hi}")
    for (lo1, hi1, _), (lo2, hi2, _) in zip(items, items[1:]):
        if lo2 <= hi1:
            raise ConfigError(f"num_speculative_tokens_per_batch_size: ranges {lo1}-{hi1} and {lo2}-{hi2} overlap")
    return tuple((lo, hi, min(k, max_k)) for lo, hi, k in items)


def _int(v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)) or (isinstance(v, str) and not v.strip().isdigit()):
        raise ValueError(f"{v!r} is not a non-negative integer")
    return int(v)


def k_for_batch(schedule: Seq[tuple[int, int, int]], batch_size: int, max_k: int) -> int:
    """The ``k`` of ``batch_size``: its range's, a gap's previous range's, or ``max_k``
    below the first range."""
    k = max_k
    for lo, hi, rk in schedule:
        if batch_size < lo:
            break
        k = rk
    return k


@attrs.define(eq=False)
class Acceptance:
    """A request's running acceptance, as exponential moving averages (one update per
    step in which it was asked for drafts):

    - *availability* ``u``: the share of those steps in which the proposer drafted
      anything (n-gram lookup often finds nothing to copy; a model always drafts);
    - *acceptance* ``a``: accepted drafts per drafted position reached, over the steps
      that drafted. A step asked for ``k`` that accepted ``a`` reached ``a + 1`` positions
      when ``a < k`` (a rejection, or a draft shorter than asked: either ends the run) and
      ``k`` when all were accepted: the maximum-likelihood estimate of a per-token
      acceptance under the geometric model.

    Expected tokens per step with ``k`` drafts: ``1 + u ((1 - a^(k+1)) / (1 - a) - 1)``.
    """

    successes: float = 0.0
    trials: float = 0.0
    asked: float = 0.0
    offered: float = 0.0

    def update(self, asked: int, drafted: int, accepted: int, decay: float, availability_decay: float | None = None) -> None:
        if asked <= 0:
            return
        ad = decay if availability_decay is None else availability_decay
        self.asked = ad * self.asked + 1
        self.offered = ad * self.offered + (drafted > 0)
        if drafted > 0:
            self.successes = decay * self.successes + accepted
            self.trials = decay * self.trials + accepted + (1 if accepted < asked else 0)

    def forget(self, factor: float) -> None:
        """Age the evidence (steps without drafts teach nothing, so what was learned
        before weighs less and the estimates drift back to their priors)."""
        self.successes *= factor
        self.trials *= factor
        self.asked *= factor
        self.offered *= factor

    def estimate(self, prior: float, prior_weight: float = 2.0) -> float:
        """Per-token acceptance ``a`` (``prior`` weighs as ``prior_weight`` positions)."""
        return (self.successes + prior_weight * prior) / (self.trials + prior_weight)

    def availability(self, prior: float = 1.0, prior_weight: float = 2.0) -> float:
        """Share of asked steps that got a draft (``u``)."""
        return (self.offered + prior_weight * prior) / (self.asked + prior_weight)


def expected_tokens(a: float, k: int) -> float:
    """E[tokens per step] with ``k`` drafts each accepted with probability ``a``
    (independently, stopping at the first rejection): ``(1 - a^(k+1)) / (1 - a)``."""
    if k <= 0:
        return 1.0
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class FixedLength:
    """Every step proposes ``num_speculative_tokens`` (the default)."""

    kind = "fixed"
    #: whether the policy reads drafting times (the loop then times a step's drafting now
    #: and then, a device synchronisation each time): only ``"auto"`` does
    times_drafting = False
    decay = 0.8  # per drafting step, a request's acceptance EMA
    #: per drafting step, a request's availability EMA: slower, since whether a proposer
    #: finds anything (n-gram lookup) comes and goes within a text, and a run of misses
    #: at the start of an answer must not switch speculation off for the rest of it
    availability_decay = 0.97

    def __init__(self, max_k: int):
        self.max_k = max_k
        #: the schedule can change k between steps (then every q = 1..k+1 is captured)
        self.varies = False

    def choose(self, seqs) -> int:
        return self.max_k

    def observe_acceptance(self, seq, asked: int, drafted: int, accepted: int) -> None:
        """A step asked ``seq``'s proposer for ``asked`` drafts; it drafted ``drafted``,
        ``accepted`` of them were accepted."""
        seq.acceptance.update(asked, drafted, accepted, self.decay)

    def observe_step(self, batch_size: int, k: int, q: int, draft_seconds: float | None,
                     step_seconds: float | None) -> None:
        """A step's measured wall times (None when not measured this step)."""

    def needs_timing(self, batch_size: int) -> bool:
        """Whether this step's drafting should be timed now (besides every few steps)."""
        return False


class BatchSizeSchedule(FixedLength):
    """``k`` by the step's batch size (``num_speculative_tokens_per_batch_size`` ranges)."""

    kind = "batch_size"

    def __init__(self, max_k: int, schedule: Seq[tuple[int, int, int]]):
        super().__init__(max_k)
        self.schedule = tuple(schedule)
        self.varies = len({k_for_batch(self.schedule, b, max_k) for b in self._probe_sizes()}) > 1

    def _probe_sizes(self):
        edges = {1} | {lo for lo, _, _ in self.schedule} | {hi + 1 for _, hi, _ in self.schedule}
        return sorted(edges)

    def choose(self, seqs) -> int:
        return k_for_batch(self.schedule, len(seqs), self.max_k)


@attrs.define(eq=False)
class _Ema:
    value: float | None = None

    def add(self, x: float, w: float) -> None:
        self.value = x if self.value is None else (1 - w) * self.value + w * x


@attrs.define(eq=False)
class _Median:
    """The median of the last ``n`` samples: one stalled cycle (a first capture, a request
    tokenised by the server meanwhile) moves it not at all, where it would move a mean for
    dozens of steps, and, when it came first, decide against a kind of step for good."""

    n: int = 9
    samples: list[float] = attrs.field(factory=list)

    def add(self, x: float) -> None:
        self.samples.append(x)
        if len(self.samples) > self.n:
            del self.samples[0]

    @property
    def value(self) -> float | None:
        if not self.samples:
            return None
        s = sorted(self.samples)
        return s[len(s) // 2]


class AutoLength(FixedLength):
    """``k`` per step from the verify cost curve, drafting cost and acceptance (module doc).

    ``verify_cost(B, q)``: seconds of a target forward verifying ``q`` tokens for ``B``
    sequences (:class:`speculum.cost_model.VerifyCost`).
    """

    kind = "auto"
    times_drafting = True
    margin = 0.05          # k > 0 must beat no speculation by this much (a loaded server mispredicts by a few %)
    global_decay = 0.995   # per drafting row-step, the engine-wide acceptance EMA
    probe_every = 32
    probe_acceptance = 0.9
    every = 4              # steps between two choices at an unchanged batch size

    #: a step without drafts every this many steps at a batch size where speculation runs,
    #: so the plain steps' cost there is measured, and kept current, to compare against
    refresh_every = 128

    def __init__(self, max_k: int, verify_cost, prior_acceptance: float = 0.5):
        super().__init__(max_k)
        self.varies = True
        #: choices made, and the last one at each batch bucket that drafted nothing
        self._calls = 0
        self._plain_at: dict[int, int] = {}
        #: price speculative steps' cycles as plain ones' (:meth:`_could_pay`)
        self._plain_other = False
        self.verify_cost = verify_cost
        self.global_acceptance = Acceptance()
        self.prior = prior_acceptance
        #: measured drafting seconds per step, by (batch bucket, k): a proposer's cost may
        #: be per step (n-gram lookup) or per token (a model), so each k is its own figure
        self._draft: dict[tuple[int, int], _Ema] = {}
        #: the rest of a step's cycle, by (batch bucket, drafted or not): a speculative
        #: step's host work (drafts to build, several tokens per row to append, detokenise
        #: and stream) is not a plain one's
        self._other: dict[tuple[int, bool], _Median] = {}
        self._costs: dict[int, list[float]] = {}
        self._zero_steps = 0
        self._probe_gap = self.probe_every
        #: batch buckets where speculation cannot pay even at a high acceptance: choices left
        #: before it is weighed again (:meth:`_pick`); forgetting owed to rows meanwhile
        self._off: dict[int, int] = {}
        self._owed = 0
        self._since, self._last_batch, self._last_k = 0, -1, None
        #: the last choice's predicted tokens/s per k (for logs and tests)
        self.last_rates: list[float] = []
        self._choices = 0

    # -- what each step teaches -----------------------------------------------------------
    def observe_acceptance(self, seq, asked: int, drafted: int, accepted: int) -> None:
        seq.acceptance.update(asked, drafted, accepted, self.decay, self.availability_decay)
        self.global_acceptance.update(asked, drafted, accepted, self.global_decay)

    def observe_step(self, batch_size: int, k: int, q: int, draft_seconds: float | None,
                     step_seconds: float | None) -> None:
        key = _bucket(batch_size)
        if draft_seconds is not None and k > 0:
            self._draft.setdefault((key, k), _Ema()).add(draft_seconds, 0.2)
        if step_seconds is not None:
            drafting = draft_seconds if draft_seconds is not None else self.draft_seconds(batch_size, k)
            rest = step_seconds - self._verify(batch_size)[min(q, self.max_k + 1) - 1] - drafting
            self._other.setdefault((key, k > 0), _Median()).add(max(rest, 0.0))

    # -- the choice -----------------------------------------------------------------------------
    def acceptance_of(self, seq) -> float:
        return seq.acceptance.estimate(self.global_acceptance.estimate(self.prior))

    def _verify(self, batch_size: int) -> list[float]:
        """verify_cost(B, k + 1) for k = 0..max_k (cached per batch size: read every step)."""
        costs = self._costs.get(batch_size)
        if costs is None:
            costs = self._costs[batch_size] = [self.verify_cost(batch_size, k + 1) for k in range(self.max_k + 1)]
        return costs

    def draft_seconds(self, batch_size: int, k: int) -> float:
        """Predicted drafting time of a step at ``k``: measured at this k, else the
        nearest measured k's (unscaled: a cost per step, like n-gram lookup's, does not
        grow with k; a model's does, and is measured as soon as that k is chosen).

        Never more than ``max(1, k / k')`` times what another measured ``k'`` costs:
        drafting k tokens costs at most k/k' times drafting k' (a chain drafts one token
        per head step). One stalled measurement (a collection, a first call) then cannot
        make a k look dear for good: a k that is never chosen is never measured again."""
        if k <= 0:
            return 0.0
        key = _bucket(batch_size)
        buckets = {b for (b, _), e in self._draft.items() if e.value is not None}
        if key in buckets:
            return self._draft_in(key, k)
        # a batch size not measured yet (load rising at once): drafting for B rows costs at
        # most B / B' times drafting for B' < B rows (batching never costs more than running
        # them apart), and no more than for B' > B rows. Until this size is timed (its first
        # drafting step is), the larger of those bounds stands; nothing measured at all: free
        if not buckets:
            return 0.0
        return min(self._draft_in(b, k) * max(1.0, key / b) for b in buckets)

    def _draft_in(self, key: int, k: int) -> float:
        known = {kk: e.value for (b, kk), e in self._draft.items() if b == key and e.value is not None}
        own = known[k] if k in known else known[min(known, key=lambda kk: (abs(kk - k), kk))]
        return min([own] + [v * max(1.0, k / kk) for kk, v in known.items() if kk != k])

    def other_seconds(self, batch_size: int, k: int) -> float:
        """The measured rest of a step's cycle at this batch size, for a step with drafts
        (``k > 0``) or without; the other kind's while this kind is unmeasured; else 0."""
        key = _bucket(batch_size)
        spec = k > 0 and not self._plain_other
        for o in (self._other.get((key, spec)), self._other.get((key, not spec))):
            if o is not None and o.value is not None:
                return o.value
        return 0.0

    def step_seconds(self, batch_size: int, k: int) -> float:
        """Predicted wall time of a step drafting ``k`` tokens for ``batch_size`` rows."""
        return self._verify(batch_size)[k] + self.draft_seconds(batch_size, k) + self.other_seconds(batch_size, k)

    def rates(self, seqs, acceptance: Seq[float] | None = None) -> list[float]:
        """Predicted tokens/s for k = 0..max_k. Runs every step, so plain arithmetic:
        E_b(k) = E_b(k - 1) + a_b^k while k is within the row's cap."""
        B = len(seqs)
        K = self.max_k
        caps = [(K if s.max_k is None else min(s.max_k, K)) if s.speculative else 0 for s in seqs]
        g = self.global_acceptance
        if acceptance is None:
            prior = g.estimate(self.prior)
            acceptance = [s.acceptance.estimate(prior) if c else 0.0 for s, c in zip(seqs, caps)]
            avail_prior = g.availability()
            avail = [s.acceptance.availability(avail_prior) if c else 0.0 for s, c in zip(seqs, caps)]
        else:
            avail = [1.0] * B
        powers = [u * a for u, a in zip(avail, acceptance)]  # u a^k: the k-th draft's expected token
        # a step verifies k + 1 tokens only if some row got a draft (a proposer that often
        # finds nothing, like n-gram lookup, then mostly runs 1-token steps)
        none = 1.0
        for u, c in zip(avail, caps):
            if c:
                none *= 1.0 - min(max(u, 0.0), 1.0)
        wide = 1.0 - none
        tokens = float(B)
        base = self.step_seconds(B, 0)
        out = [tokens / max(base, 1e-9)]
        verify = self._verify(B)
        measured = self._other.get((_bucket(B), False))
        plain_other = (measured.value or 0.0) if measured is not None else 0.0  # not the other kind's stand-in
        for k in range(1, K + 1):
            for i, c in enumerate(caps):
                if c >= k:
                    tokens += powers[i]
                    powers[i] *= acceptance[i]
            # the rest of a cycle is mostly work per token emitted (appends, stop checks,
            # detokenising, streaming), so a step emitting more tokens is not priced below
            # a plain step's rest per token: speculation then pays only by what it saves
            # in forwards (behind a busy server a one-off plain step's cycle, which shares
            # the host with the event loop streaming the speculative steps' tokens, does not
            # tell the two apart)
            other = max(self.other_seconds(B, k), plain_other * tokens / B)
            seconds = verify[k] + self.draft_seconds(B, k) + other - (1.0 - wide) * (verify[k] - verify[0])
            out.append(tokens / max(seconds, 1e-9))
        return out

    def needs_timing(self, batch_size: int) -> bool:
        """Whether drafting at this batch size has never been timed (then time this step)."""
        key = _bucket(batch_size)
        return not any(b == key and e.value is not None for (b, _), e in self._draft.items())

    def choose(self, seqs) -> int:
        """The step's k: re-chosen every ``every`` steps, and at once when the batch size
        changes (acceptance moves slowly; the choice costs tens of microseconds). After
        ``probe_every`` steps at 0, one step drafts a single token if speculation could
        pay; each probe that changes nothing doubles the wait for the next (up to 1024).
        While speculating, one step in ``refresh_every`` at a batch size drafts nothing:
        the plain step's cycle there is what speculation is weighed against."""
        k = self._pick(seqs)
        key = _bucket(len(seqs))
        self._calls += 1
        if k == 0:
            self._plain_at[key] = self._calls
        elif (key, True) in self._other and self._calls - self._plain_at.get(key, -self.refresh_every) > \
                self.refresh_every:
            self._plain_at[key] = self._calls
            return 0  # measure (again) what a plain step costs at this batch size
        return k

    #: choices a batch bucket stays off once speculation could not pay there even at a high
    #: acceptance: meanwhile a choice costs nothing (at batch 64 weighing every k takes a
    #: few hundred microseconds of the interpreter, which a host-bound server shares)
    off_for = 64

    def _pick(self, seqs) -> int:
        B = len(seqs)
        key = _bucket(B)
        if self._off.get(key, 0) > 0:
            self._off[key] -= 1
            self._owed += 1  # the rows' forgetting, paid at the next choice weighed
            self.global_acceptance.forget(self.availability_decay)
            return 0
        self._since += 1
        fresh = B != self._last_batch or self._since >= self.every or self._last_k is None
        if fresh:
            self._since, self._last_batch = 0, B
            self._last_k = self._choose(seqs)
        k = self._last_k
        if k == 0:
            # a request's estimates age while it drafts nothing: a run of misses (n-gram
            # lookup at the start of an answer) does not switch it off for good
            factor = self.availability_decay ** (1 + self._owed)
            self._owed = 0
            for s in seqs:
                s.acceptance.forget(factor)
            # ... and so does the engine-wide estimate new requests start from: else one
            # poor stretch (every answer's first steps, for n-gram lookup) makes it the
            # prior of every later request, and k = 0 is never left again
            self.global_acceptance.forget(self.availability_decay)
            self._zero_steps += 1
            if fresh or self._zero_steps >= self._probe_gap:
                pays = self._could_pay(seqs) or (self._unsure(B) and self._could_pay(seqs, unsure=True))
                if fresh and not pays:  # nothing to weigh here for a while
                    self._off[key], self._last_k = self.off_for, None
                elif pays and self._zero_steps >= self._probe_gap:
                    # probe; if the drafts stay poor, wait twice as long for the next one
                    self._zero_steps, self._probe_gap = 0, min(2 * self._probe_gap, 1024)
                    return 1
        else:
            self._zero_steps, self._probe_gap = 0, self.probe_every
        return k

    #: every how many choices the policy logs what it sees (INFO; the server shows INFO)
    log_every = 256

    def _choose(self, seqs) -> int:
        if not any(s.speculative and s.max_k != 0 for s in seqs):
            return 0
        rates = self.rates(seqs)
        self.last_rates = rates
        best = max(range(len(rates)), key=lambda k: rates[k])
        if best > 0 and rates[best] < rates[0] * (1 + self.margin):
            best = 0
        self._choices += 1
        if self._choices % self.log_every == 1:
            self._log_choice(seqs, rates, best)
        return best

    def _log_choice(self, seqs, rates, best: int) -> None:
        """What a choice was made from: predicted tokens/s per k, the estimates behind them."""
        B, key = len(seqs), _bucket(len(seqs))
        prior = self.global_acceptance.estimate(self.prior)
        a = sum(s.acceptance.estimate(prior) for s in seqs) / B
        u = sum(s.acceptance.availability(self.global_acceptance.availability()) for s in seqs) / B
        drafting = {k: round(1e3 * e.value, 3) for (b, k), e in sorted(self._draft.items()) if b == key and e.value}
        log.info("auto (choice %d): batch %d -> k=%d; predicted tok/s by k %s; mean acceptance %.2f, availability "
                 "%.2f; verify ms by k %s; other ms %.3f without drafts, %.3f with; drafting ms by k %s",
                 self._choices, B, best, [round(r, 1) for r in rates], a, u,
                 [round(1e3 * v, 3) for v in self._verify(B)], 1e3 * self.other_seconds(B, 0),
                 1e3 * self.other_seconds(B, 1), drafting)

    #: a speculative step's cycle is known at a batch size once measured this many times
    sure_after = 3

    def _unsure(self, batch_size: int) -> bool:
        """Whether too few speculative cycles were measured at this batch size to rule
        speculation out there (then probes go on, whatever the estimate says)."""
        o = self._other.get((_bucket(batch_size), True))
        return o is None or len(o.samples) < self.sure_after

    def _could_pay(self, seqs, unsure: bool = False) -> bool:
        """Whether speculation would win at a high acceptance (then a probe is worth it);
        ``unsure``: were a speculative step's cycle to cost what a plain one's does (the
        speculative figure is not trusted yet)."""
        hi = [self.probe_acceptance if s.speculative and s.max_k != 0 else 0.0 for s in seqs]
        r = self._probe_rates(seqs, hi, unsure)
        return max(r[1:]) > r[0] * (1 + self.margin)

    def _probe_rates(self, seqs, acceptance: Seq[float], unsure: bool) -> list[float]:
        """:meth:`rates` at the given acceptance; ``unsure``: a speculative step's cycle
        priced as a plain one's."""
        self._plain_other = unsure
        try:
            return self.rates(seqs, acceptance)
        finally:
            self._plain_other = False


class TreeAutoLength(AutoLength):
    """``"auto"`` for token trees: each step drafts the whole tree (k = ``max_k`` nodes) or
    nothing. A tree's gain is not a chain's geometric series, so a request's expected
    tokens per tree step are measured directly: ``1 + m_b``, ``m_b`` the running mean of
    its accepted nodes per tree step (an exponential moving average; a new request
    starts from the engine-wide mean, and before any tree step from ``prior_accepted``).
    The tree runs when ``sum_b (1 + m_b) / T(B, tree)`` beats ``B / T(B, 0)`` by the margin.
    """

    kind = "auto_tree"
    prior_accepted = 1.0   # accepted nodes per tree step assumed before any was measured
    probe_accepted = 2.0   # what a probe step hopes for

    def observe_acceptance(self, seq, asked: int, drafted: int, accepted: int) -> None:
        # accepted nodes per tree step = successes / offered: one decay for both (the
        # chain policy averages availability more slowly than acceptance)
        seq.acceptance.update(asked, drafted, accepted, self.decay)
        self.global_acceptance.update(asked, drafted, accepted, self.global_decay)

    @staticmethod
    def _mean_accepted(acc: Acceptance, prior: float, weight: float = 2.0) -> float:
        return (acc.successes + weight * prior) / (acc.offered + weight)

    def rates(self, seqs, acceptance: Seq[float] | None = None) -> list[float]:
        """Predicted tokens/s for k = 0 (no drafts) and k = max_k (the tree); the k in
        between never run (-inf)."""
        B, K = len(seqs), self.max_k
        on = [s.speculative and s.max_k != 0 for s in seqs]
        if acceptance is None:
            prior = self._mean_accepted(self.global_acceptance, self.prior_accepted)
            acceptance = [self._mean_accepted(s.acceptance, prior) if o else 0.0 for s, o in zip(seqs, on)]
        tokens = B + sum(m for m, o in zip(acceptance, on) if o)
        out = [float("-inf")] * (K + 1)
        out[0] = B / max(self.step_seconds(B, 0), 1e-9)
        out[K] = tokens / max(self.step_seconds(B, K), 1e-9)
        return out

    def _could_pay(self, seqs, unsure: bool = False) -> bool:
        r = self._probe_rates(seqs, [self.probe_accepted] * len(seqs), unsure)
        return r[self.max_k] > r[0] * (1 + self.margin)

    def choose(self, seqs) -> int:
        k = super().choose(seqs)
        return self.max_k if k else 0  # a probe (k = 1) drafts the tree too


def _bucket(batch_size: int) -> int:
    """Batch sizes grouped by powers of two (what one EMA of measured costs covers)."""
    return 1 << max(0, batch_size - 1).bit_length()


def make_policy(schedule, max_k: int, verify_cost_factory=None, trees: bool = False):
    """The policy for a parsed schedule (None: fixed ``max_k``; ``"auto"``: cost model,
    built by ``verify_cost_factory()`` only then, since it profiles the target; with
    ``trees``, the tree of ``max_k`` nodes on or off)."""
    if schedule is None or max_k == 0:
        return FixedLength(max_k)
    if schedule == AUTO:
        t0 = time.perf_counter()
        cost = verify_cost_factory()
        policy = (TreeAutoLength if trees else AutoLength)(max_k, cost)
        policy.profile_seconds = time.perf_counter() - t0
        return policy
    return BatchSizeSchedule(max_k, schedule)
