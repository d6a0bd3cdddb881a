"""Timing several pieces of work against each other on a machine other processes share.

Load from other processes comes in bursts. Timed one after the other, each piece of work
meets a different burst and their ratio measures the load as much as the work (``memkern
bench`` read 4.24x, 0.06x and 0.58x for one ratio in three runs on a 2-core machine with
another job on one core). So the pieces take turns: in **rounds**, each round one timed call
of every piece, the order rotated from round to round (ABC, BCA, CAB, ...) so that no piece
always runs first or after the same one; a burst then lands on the pieces of one or two rounds
alike. Each ratio is the **median of its per-round ratios**, and the spread of those ratios
says how far it can be trusted.

Oversubscription is the other source of noise: torch's intra-op threads, one per core by
default, fight other processes for cores and a step waits for its slowest thread.
:func:`choose_threads` takes the cores other processes are not using now (:func:`busy_cores`),
not by the load average, which decays over a minute: run right after ``scripts/install.sh``,
the finished compile still counted as a busy core and the bench chose 1 thread of 2.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Sequence


def rotated(names: Sequence[str], round_index: int) -> list[str]:
    """The order of round ``round_index``: ``names`` rotated left by the round's index."""
    shift = round_index % len(names) if names else 0
    return [*names[shift:], *names[:shift]]


def in_rounds(steps: dict[str, Callable[[], float]], rounds: int,
              after_each: Callable[[str], None] | None = None) -> dict[str, list[float]]:
    """``rounds`` rounds of one call of every ``steps[name]()`` (each returns the seconds it
    timed), in :func:`rotated` order; ``after_each(name)`` is called after each call. Returns
    each name's times, in round order (round *r*'s time at index *r*)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds):
        for name in rotated(list(steps), r):
            times[name].append(steps[name]())
            if after_each is not None:
                after_each(name)
    return times


@dataclasses.dataclass(frozen=True)
class Ratio:
    """The ratio of two pieces of work's times, over rounds."""

    median: float
    """The median of the per-round ratios."""
    low: float
    """Their first quartile."""
    high: float
    """Their third quartile."""
    rounds: int

    @property
    def spread(self) -> float:
        """(third quartile - first quartile) / median of the per-round ratios: 0.1 = the
        middle half of the rounds within 10% of each other."""
        return (self.high - self.low) / self.median


def ratio(times: Sequence[float], baseline: Sequence[float]) -> Ratio:
    """``times / baseline`` round by round (the two lists from the same :func:`in_rounds`),
    summarised by the median and quartiles of the per-round ratios."""
    if len(times) != len(baseline) or not times:
        raise ValueError(f"ratio: need the same number (>= 1) of rounds for both, got "
                         f"{len(times)} and {len(baseline)}")
    per_round = sorted(t / b for t, b in zip(times, baseline))
    if len(per_round) == 1:
        return Ratio(per_round[0], per_round[0], per_round[0], 1)
    low, _, high = statistics.quantiles(per_round, n=4, method="inclusive")
    return Ratio(statistics.median(per_round), low, high, len(per_round))


@dataclasses.dataclass(frozen=True)
class Threads:
    """The intra-op thread count chosen for a timed run, and why."""

    count: int
    reason: str


BUSY_SAMPLE_SECONDS = 0.25
"""How long :func:`busy_cores` watches the machine's CPU time."""


def busy_cores(seconds: float = BUSY_SAMPLE_SECONDS) -> float | None:
    """How many cores the machine's other processes keep busy now: its non-idle CPU time over
    ``seconds`` (``/proc/stat``, Linux) while this process sleeps, in cores. None where
    ``/proc/stat`` cannot be read."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            # cpu  user nice system idle iowait irq softirq steal (guest time is in user)
            ticks = [int(v) for v in f.readline().split()[1:9]]
        return sum(ticks), ticks[3] + ticks[4]

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    total = total1 - total0
    if total <= 0:
        return None
    return (total - (idle1 - idle0)) / total * (os.cpu_count() or 1)


def choose_threads(requested: int | None = None, *, default: int,
                   cores: int | None = None, load: float | None = None) -> Threads:
    """How many intra-op threads a timed run should use.

    ``requested`` (a flag) wins; then ``OMP_NUM_THREADS``, which torch has already applied
    (``default`` is torch's current count); else the cores this process may run on less those
    other processes keep busy, rounded, at least 1 and at most ``default``: ``load`` cores
    when given, else measured now (:func:`busy_cores`), else the 1-minute load average (read
    before the run starts). ``cores`` is read from the machine when not given."""
    if requested is not None:
        return Threads(requested, "--threads")
    if os.environ.get("OMP_NUM_THREADS"):
        return Threads(default, "OMP_NUM_THREADS")
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            (os.cpu_count() or 1)
    if load is None:
        busy = busy_cores()
        if busy is not None:
            free = max(1, min(default, cores - round(busy)))
            return Threads(free, f"{cores} cores, {busy:.1f} busy with other processes now "
                                 f"(measured over {BUSY_SAMPLE_SECONDS} s)")
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # not on every platform
            return Threads(default, "torch's default (no load average on this platform)")
    free = max(1, min(default, cores - round(load)))
    return Threads(free, f"{cores} cores, load average {load:.1f} from other processes")
