"""Timing and reporting shared by the benchmark scripts.

Times are medians of several repetitions after warm-up, measured in the same process as the
torch baseline they are compared with; on CUDA each repetition is bracketed by synchronises
(``median_seconds``: what a caller waiting for the result sees, host launch time included), or
timed by CUDA events over calls that follow each other with the queue kept full
(``device_seconds``: what the work costs the GPU, as in a training loop whose host runs ahead).
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from memkern.bench import timing


def median_seconds(fn: Callable[[], object], *, warmup: int = 2, reps: int = 7,
                   device: torch.device | None = None,
                   clock: Callable[[], float] = time.perf_counter) -> float:
    """Median time of ``fn()`` over ``reps`` runs after ``warmup`` runs: wall time, or
    ``clock=time.process_time`` for the process's CPU time."""
    on_cuda = device is not None and device.type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        start = clock()
        fn()
        sync()
        times.append(clock() - start)
    return statistics.median(times)


def device_seconds(fn: Callable[[], object], *, device: torch.device, calls: int = 20,
                   warmup: int = 2, reps: int = 7) -> float:
    """Seconds per call of ``fn()`` as the device spends them: on CUDA, the median over ``reps``
    batches of ``calls`` back-to-back calls timed by CUDA events, so the host's launch time
    hides behind the GPU work as it does in a training loop (a host slower than the GPU shows
    as the host's time); elsewhere ``median_seconds`` (a CPU has no queue to fill)."""
    if device.type != "cuda":
        return median_seconds(fn, warmup=warmup, reps=reps, device=device)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def interleaved_times(cases: dict[str, tuple[Callable[[], None], Callable[[], object]]], *,
                      warmup: int, reps: int, device: torch.device,
                      cpu_times: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """Seconds of each case's step in every timed repetition, each run after its untimed
    prepare; ``cpu_times``, when given, receives each repetition's process CPU time (all
    threads) per case as well.

    The cases take turns within every repetition, in an order rotated from one repetition to
    the next (:func:`memkern.bench.timing.rotated`), so that load from other processes on a
    shared machine falls on all of them alike rather than on whichever ran last; compare two
    cases with :func:`ratio`.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(warmup + reps):
        for name in timing.rotated(list(cases), i):
            prepare, step = cases[name]
            prepare()
            sync()
            start, cpu_start = time.perf_counter(), time.process_time()
            step()
            sync()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
                if cpu_times is not None:
                    cpu_times.setdefault(name, []).append(time.process_time() - cpu_start)
    return times


def ratio(times: dict[str, list[float]], case: str, baseline: str) -> dict[str, float]:
    """``case``'s time over ``baseline``'s, repetition by repetition (both from one
    :func:`interleaved_times`): the median of the per-repetition ratios, their quartiles and
    their range."""
    r = timing.ratio(times[case], times[baseline])
    per_rep = [c / b for c, b in zip(times[case], times[baseline])]
    return {"median": r.median, "first_quartile": r.low, "third_quartile": r.high,
            "min": min(per_rep), "max": max(per_rep)}


class TorchSwiGLU(torch.nn.Module):
    """The SwiGLU MLP as torch composes it: down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(d, h, bias=False)
        self.up_proj = torch.nn.Linear(d, h, bias=False)
        self.down_proj = torch.nn.Linear(h, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def nothing() -> None:
    """The prepare step of a case that needs none."""


def odd_sizes(n: int) -> list[int]:
    """Four odd tensor sizes adding up to n."""
    sizes = [n // 2 + 1, n // 4 - 3, n // 8 + 7]
    return sizes + [n - sum(sizes)]


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 29) -> float:
    """Measured bytes/s of a large copy on ``device`` (read + write counted).

    The best of three ways torch copies memory: ``copy_`` alone is not always the fastest
    (on CPU it can be slower than an out-of-place multiply by one), and a kernel should be
    compared with what the memory system can actually do. Timed as ``device_seconds``.
    """
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ways = (lambda: dst.copy_(src), lambda: torch.mul(src, 1.0, out=dst), lambda: src.mul_(1.0))
    return 2 * nbytes / min(device_seconds(way, device=device, calls=5) for way in ways)


def machine() -> dict[str, object]:
    """What ran the benchmark: CPU/GPU model, thread count, library versions."""
    info: dict[str, object] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": _cpu_model(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def command_line() -> str:
    return " ".join(["python"] + [os.path.relpath(sys.argv[0])] + sys.argv[1:])


def save(path: str, results: dict[str, object]) -> None:
    """Writes results with the machine and the command that produced them."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    payload = {"command": command_line(), "machine": machine(), **results}
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=2)
        fh.write("\n")
    print(f"wrote {path}")


def on_gloo_ranks(run: Callable[[int, int, object], dict | None], world: int, args: object,
                  timeout: float = 600) -> dict:
    """Runs ``run(rank, world, args)`` in ``world`` spawned processes joined by gloo on
    127.0.0.1 (collectives time out after ``timeout`` seconds); returns what the rank whose
    ``run`` returned a result (rank 0) returned. ``run`` must be a module-level function."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_gloo_rank, args=(run, world, port, args, timeout, queue), nprocs=world)
    return queue.get()


def _gloo_rank(rank: int, run, world: int, port: int, args, timeout: float, queue) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout))
    try:
        result = run(rank, world, args)
        if result is not None:
            queue.put(result)
    finally:
        dist.destroy_process_group()


def print_and_save(result: dict, path: str | None) -> None:
    """Prints ``result`` as JSON, and writes it to ``path`` when one is given."""
    text = json.dumps(result, indent=2)
    print(text)
    if path:
        with open(path, "w") as fh:
            fh.write(text + "\n")
