"""Whether work on a GPU is host- or device-bound: its GPU time beside its host time.

* **GPU time**: the summed durations of the kernels (and copies) the work ran, from torch's
  profiler (``torch.profiler``, CUDA activity only). What the GPU had to do, without the gaps
  in which it waited for the host.
* **host time**: the wall time the calls take to return, from a synchronised start and without
  a synchronisation at the end: the time the host needs to issue the work (Python, autograd,
  the dispatcher, the launches). If the work itself synchronises, or fills the launch queue,
  the wait counts too — then the GPU time is the larger one anyway.

The larger of the two bounds the wall time: a configuration whose host time exceeds its GPU
time is host-bound (the GPU waits; fewer or cheaper calls help, faster kernels do not).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch


@dataclasses.dataclass(frozen=True)
class HostDeviceTime:
    """Seconds per call of one piece of work on a GPU (medians, except ``gpu_seconds``)."""

    wall_seconds: float
    """From a synchronised start until the GPU finished (synchronised end)."""
    host_seconds: float
    """From a synchronised start until the calls returned."""
    gpu_seconds: float
    """The kernels' summed durations (one profiled repetition)."""

    @property
    def bound(self) -> str:
        """``"host"`` when issuing the work takes longer than the GPU needs to run it."""
        return "host" if self.host_seconds > self.gpu_seconds else "device"


def gpu_seconds(fn: Callable[[], object], calls: int = 1) -> float:
    """Summed kernel and copy durations per call of ``calls`` calls of ``fn``, from the
    profiler's device events (their ``device_time_total``, in microseconds)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    device_us = sum(e.device_time_total for e in prof.events()
                    if e.device_type == DeviceType.CUDA)
    return device_us * 1e-6 / calls


def measure(fn: Callable[[], object], *, reps: int = 3, calls: int = 1) -> HostDeviceTime:
    """Host, wall and GPU time per call of ``fn`` on the current CUDA device: ``reps``
    repetitions of ``calls`` calls each (medians), then one profiled repetition."""
    host, wall = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        host.append((issued - start) / calls)
        wall.append((done - start) / calls)
    return HostDeviceTime(statistics.median(wall), statistics.median(host),
                          gpu_seconds(fn, calls))


def describe(t: HostDeviceTime) -> str:
    """``host 1.23 ms, GPU 0.98 ms (host-bound)``."""
    return (f"host {t.host_seconds * 1e3:.3f} ms, GPU {t.gpu_seconds * 1e3:.3f} ms "
            f"({t.bound}-bound)")


def table(rows: list[tuple[str, HostDeviceTime]], unit: str = "ms") -> list[str]:
    """The lines of a table of (name, time) rows: wall, host and GPU time per call in ``unit``
    (``"ms"`` or ``"µs"``) and which one bounds it."""
    scale = 1e3 if unit == "ms" else 1e6
    width = max(len("configuration"), *(len(name) for name, _ in rows))
    lines = [f"{'configuration':<{width}} {'wall ' + unit:>9} {'host ' + unit:>9} "
             f"{'GPU ' + unit:>9} {'bound':>7}"]
    for name, t in rows:
        lines.append(f"{name:<{width}} {t.wall_seconds * scale:>9.2f} "
                     f"{t.host_seconds * scale:>9.2f} {t.gpu_seconds * scale:>9.2f} "
                     f"{t.bound:>7}")
    return lines
