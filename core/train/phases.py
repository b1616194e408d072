"""``speculum train --profile-steps N``: where a training step's time goes.

A step has four phases: ``batch`` (gathering the batch; with ``--states online`` the target's
prefill of it), ``forward`` (the head's forward and loss, with its scoring), ``backward`` and
``optimizer`` (clipping and the optimizer step); ``other`` is the rest of the step (reading
the loss for the progress bar, the checkpoint, the time checks). While profiling, each phase
ends with a device synchronisation, so a phase's time is its own and nothing overlaps the
next (the steps profiled can run a little slower than the others). The first ``SKIP`` steps
(first shapes, the allocator's growth) are not counted; the next N are, and their median
per phase goes to the log and to ``training.json`` (``step_phases_ms``).
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time

import torch

log = logging.getLogger(__name__)

PHASES = ("batch", "forward", "backward", "optimizer")
SKIP = 2  # steps before the profiled ones


class StepPhases:
    """Times the phases of ``steps`` training steps after :data:`SKIP` on ``device``
    (nothing, at no cost, when ``steps`` is 0)."""

    def __init__(self, steps: int, device):
        self.steps = max(0, int(steps or 0))
        self.cuda = torch.device(device).type == "cuda"
        self.seen = 0
        self.times: dict[str, list[float]] = {p: [] for p in (*PHASES, "step")}
        self._start = None
        self.result: dict | None = None

    def _on(self) -> bool:
        return self.steps > 0 and self.seen < SKIP + self.steps

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str):
        if not self._on():
            yield
            return
        t0 = self._now()
        if self._start is None:  # the step starts with its first phase
            self._start = t0
        yield
        if self.seen >= SKIP:
            self.times[name].append(self._now() - t0)

    def end_step(self) -> None:
        """Close a step; after the last profiled one, log the table."""
        if not self._on():
            return
        end = self._now()
        if self.seen >= SKIP and self._start is not None:
            self.times["step"].append(end - self._start)
        self._start = None
        self.seen += 1
        if self.seen == SKIP + self.steps:
            self.finish()

    def finish(self) -> None:
        """Log and keep the summary (at the end of training too, where it ended before N steps
        were profiled: the steps that were)."""
        if self.result is not None or not self.times["step"]:
            return
        self.result = self.summary()
        log.info("a training step, median of %d: %s", self.result["steps"], ", ".join(
            f"{k} {v:.1f} ms" for k, v in self.result.items() if k != "steps"))

    def summary(self) -> dict:
        """Median ms per phase, ``other`` (the step less its phases) and ``step``, over the steps profiled."""
        med = {p: 1e3 * statistics.median(t) for p, t in self.times.items() if t}
        if "step" in med:
            med["other"] = max(0.0, med["step"] - sum(med.get(p, 0.0) for p in PHASES))
            med["step"] = med.pop("step")  # last, after the phases
        return {"steps": len(self.times["step"]), **{k: round(v, 2) for k, v in med.items()}}
