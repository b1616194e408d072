"""How many CPU threads torch may use: never more than the cores that are free.

torch sizes its thread pool to the machine's cores. When another process keeps a core
busy, the pool's threads spin against it and a step can take 30 times longer (measured
on 2 cores: one chat prompt took 108 s at 2 threads and 3.6 s at 1, docs/benchmarks.md).
The default here is the CPUs this process may run on, less the cores other processes
kept busy during a short sample at start, and at least 1. ``SPECULUM_THREADS=N`` in the
environment sets the default for every engine of a process (a test suite, a service).
"""

from __future__ import annotations

import logging
import os
import time

import attrs

log = logging.getLogger(__name__)


@attrs.frozen
class ThreadChoice:
    threads: int
    usable_cpus: int
    #: cores other processes kept busy while sampled (None: not measurable here)
    busy_cpus: float | None
    source: str  # "asked" or "default"

    def describe(self) -> str:
        if self.source == "asked":
            return f"threads: {self.threads} (asked for; {self.usable_cpus} CPUs usable)"
        busy = "unknown" if self.busy_cpus is None else f"{self.busy_cpus:.1f}"
        return (f"threads: {self.threads} ({self.usable_cpus} CPUs usable, {busy} busy with other processes; "
                "set threads= / --threads to override)")


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies of the whole machine from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _own_jiffies() -> int | None:
    try:
        with open("/proc/self/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return int(rest[11]) + int(rest[12])  # utime + stime
    except (OSError, ValueError, IndexError):
        return None


#: the machine's (busy, total) jiffies and this process's own, at one moment
CpuSnapshot = tuple[tuple[int, int], int]


def cpu_snapshot() -> CpuSnapshot | None:
    """Where the machine's and this process's CPU time stand now (None off Linux)."""
    machine, own = _cpu_jiffies(), _own_jiffies()
    return None if machine is None or own is None else (machine, own)


def others_busy(since: CpuSnapshot | None) -> float | None:
    """Cores other processes kept busy, on average, from ``since`` (a :func:`cpu_snapshot`)
    to now: the machine's busy time less this process's own (None if not measurable)."""
    now = cpu_snapshot()
    if since is None or now is None or now[0][1] == since[0][1]:
        return None
    (busy_a, total_a), own_a = since
    (busy_b, total_b), own_b = now
    busy = (busy_b - busy_a) - (own_b - own_a)
    return max(0.0, busy / (total_b - total_a) * (os.cpu_count() or 1))


def busy_cpus(sample_s: float = 0.25) -> float | None:
    """Cores kept busy by other processes over ``sample_s`` seconds (None off Linux)."""
    since = cpu_snapshot()
    if since is None:
        return None
    time.sleep(sample_s)
    return others_busy(since)


def choose_threads(threads: int | None = None) -> ThreadChoice:
    """``threads`` if given, else the usable CPUs minus the busy ones (at least 1)."""
    n = usable_cpus()
    env = os.environ.get("SPECULUM_THREADS")
    if threads is None and env:
        try:
            threads = int(env)
        except ValueError:
            raise ValueError(f"SPECULUM_THREADS must be an integer >= 1, got {env!r}") from None
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        return ThreadChoice(int(threads), n, None, "asked")
    busy = busy_cpus()
    free = n if busy is None else int(n - busy + 0.5)
    return ThreadChoice(max(1, min(n, free)), n, busy, "default")


_applied: ThreadChoice | None = None


def apply_threads(threads: int | None = None) -> ThreadChoice:
    """Choose and set torch's intra-op thread count (process wide); logs the choice.

    The default is measured once per process; later engines reuse it, so two engines in
    one process (a baseline and a speculative run) run with the same threads.
    """
    global _applied
    import torch
    if threads is None and _applied is not None and _applied.source == "default":
        choice = _applied
    else:
        choice = choose_threads(threads)
    torch.set_num_threads(choice.threads)
    if choice != _applied:
        log.info("%s", choice.describe())
    _applied = choice
    return choice
