"""Allocation accounting: the peak and the net bytes allocated while a function runs.

On CUDA this reads the caching allocator's statistics; on the CPU it replays the allocation
trace of ``torch.profiler`` (``profile_memory=True``), which records every allocation and free
of the CPU allocator with its size.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch


@dataclasses.dataclass
class AllocationStats:
    peak: int
    """Largest amount allocated at any moment above the level at the start."""
    retained: int
    """Bytes allocated while running and still allocated at the end (the result included)."""
    result: Any


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """The profiler's native layer prints a line on stderr when it starts and stops (no
    setting turns it off); those lines would break progress bars and tables."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _cpu_trace(fn: Callable[[], Any]) -> AllocationStats:
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _native_stderr_silenced():
        prof.start()
    try:
        result = fn()  # its own warnings and errors still reach stderr
    finally:
        with _native_stderr_silenced():
            prof.stop()
    # The profiler's raw records carry each allocation/free with its signed size and time;
    # the public FunctionEvent view aggregates them per op, losing the order needed for a peak.
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    return AllocationStats(peak, current, result)


def _cuda_trace(fn: Callable[[], Any], device: torch.device) -> AllocationStats:
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    return AllocationStats(torch.cuda.max_memory_allocated(device) - start,
                           torch.cuda.memory_allocated(device) - start, result)


def allocation_stats(fn: Callable[..., Any], *args: Any, device: torch.device | str = "cpu",
                     **kwargs: Any) -> AllocationStats:
    """Peak and retained bytes allocated on ``device`` while running ``fn(*args, **kwargs)``."""
    device = torch.device(device)
    call = lambda: fn(*args, **kwargs)  # noqa: E731
    if device.type == "cuda":
        return _cuda_trace(call, device)
    if device.type != "cpu":
        raise ValueError(f"memkern.profile.allocation_stats: device {device} is not supported "
                         "(cpu or cuda)")
    return _cpu_trace(call)


def peak_allocated_bytes(fn: Callable[..., Any], *args: Any, device: torch.device | str = "cpu",
                         **kwargs: Any) -> int:
    """The peak of bytes allocated on ``device`` above the starting level while ``fn`` runs."""
    return allocation_stats(fn, *args, device=device, **kwargs).peak
