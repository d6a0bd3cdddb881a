"""Allocation accounting: the peak and the net bytes allocated while a function runs.

On CUDA this reads the caching allocator's statistics; on the CPU it replays the allocation
trace of ``torch.profiler`` (``profile_memory=True``), which records every allocation and free
of the CPU allocator with its size.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
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


# torch's native log lines: c10's "[W1122 22:54:23.803449707 CPUAllocator.cpp:245] ..." (e.g.
# "Memory block of unknown size was allocated before the profiling started") and kineto's
# "USDT:2026-11-22 23:00:57 17736:17736 SyncActivityProfilerHandler.cpp:52] profiler_start".
_NATIVE_LOG = re.compile(r"^(\[?[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+|[A-Z]+:\d{4}-\d\d-\d\d "
                         r"\d\d:\d\d:\d\d) .*\]")


@contextlib.contextmanager
def _native_log_lines_dropped() -> Iterator[None]:
    """Captures stderr at the file-descriptor level (where torch's native layer writes) while
    the trace runs, then writes back everything but torch's native log lines: the profiler
    logs when it starts and stops and for every freed block it did not see allocated (no
    setting turns these off), and they would land inside progress bars and tables. Anything
    else written meanwhile (Python warnings, the function's own output) still reaches stderr,
    after the trace."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode(errors="replace")
            kept = [line for line in text.splitlines(keepends=True)
                    if not _NATIVE_LOG.match(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def _cpu_trace(fn: Callable[[], Any]) -> AllocationStats:
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _native_log_lines_dropped():
        prof.start()
        try:
            result = fn()
        finally:
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
