"""Trains one configuration for a number of steps and measures it."""
from __future__ import annotations

import dataclasses
import gc
import statistics
import sys
import time

import torch

from memkern.bench import host_device
from memkern.bench.configs import CONFIGS, MAX_GRAD_NORM, build
from memkern.bench.data import Batches
from memkern.bench.model import GPTConfig
from memkern.profile import memory_breakdown, saved_bytes
from memkern.profile.allocations import allocation_stats


EXTRA_WARMUP_STEPS = 3
"""Untimed steps after the profiled one, when ``steps`` leaves room for them. On the 2-core CPU
machine a compiled configuration's steps 1-3 took 1.4-2.9 s in three runs of the default
bench, against 0.07-0.6 s for its later steps: timed, they made a first ``memkern bench`` after
install report noise."""


@dataclasses.dataclass
class Row:
    config: str
    peak_bytes: int
    """Persistent bytes (params, grads, master weights, optimizer state) at the start of a
    step plus the step's own peak allocation above that (GPU: the allocator's peak)."""
    saved_activation_bytes: int
    """Bytes one micro-batch's forward saves for backward."""
    params_bytes: int
    grads_bytes: int
    master_bytes: int
    optimizer_state_bytes: int
    num_params: int
    optimizer_side_bytes_per_param: float
    step_seconds: float
    """Median of the timed steps."""
    tokens_per_second: float
    losses: list[float]
    step_seconds_min: float = 0.0
    step_seconds_max: float = 0.0
    host_seconds: float | None = None
    """On a GPU: the time to issue one step (memkern.bench.host_device), median of steps
    after the timed ones; None on the CPU."""
    gpu_seconds: float | None = None
    """On a GPU: one step's kernels' summed time (memkern.bench.host_device); None on the CPU."""
    held_bytes: int = 0
    """Bytes held between steps, after the last one (gradients zeroed): on a GPU, what the
    configuration keeps allocated on the device (state in host memory not counted); on the
    CPU, the persistent bytes (params, grads, master weights, optimizer state)."""

    @property
    def host_device(self) -> host_device.HostDeviceTime | None:
        if self.host_seconds is None or self.gpu_seconds is None:
            return None
        return host_device.HostDeviceTime(self.step_seconds, self.host_seconds,
                                          self.gpu_seconds)

    @property
    def final_loss(self) -> float:
        return self.losses[-1]

    @property
    def step_spread(self) -> float:
        """(slowest - fastest) / median timed step: how far the step time can be trusted."""
        return (self.step_seconds_max - self.step_seconds_min) / self.step_seconds


class Progress:
    """One line per configuration on stderr, redrawn in place on a terminal; the bars line up
    whatever the configuration (the longest name, compiled, sets the label's width)."""

    LABEL_WIDTH = max(len(name) for name in CONFIGS) + len("+compile")

    def __init__(self, label: str, total: int, enabled: bool = True) -> None:
        self.label, self.total, self.enabled = label, total, enabled
        self.tty = sys.stderr.isatty()

    def update(self, done: int, loss: float) -> None:
        if not self.enabled or not (self.tty or done == self.total):
            return
        filled = int(24 * done / self.total)
        bar = "#" * filled + "." * (24 - filled)
        end = "\n" if done == self.total else ""
        print(f"\r  {self.label:<{self.LABEL_WIDTH}} [{bar}] {done:>4}/{self.total} "
              f"loss {loss:.4f}", end=end, file=sys.stderr, flush=True)


# Steps timed for the host/GPU split on a GPU, after the timed steps (one more is profiled).
SPLIT_REPS = 3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(name: str, cfg: GPTConfig, corpus: torch.Tensor, *, steps: int, batch: int,
        device: torch.device, seed: int = 0, progress: bool = True, compile: bool = False,
        memory_budget: int | str | None = None, max_grad_norm: float = MAX_GRAD_NORM) -> Row:
    """Trains configuration ``name`` for ``steps`` steps (batch × cfg.seq tokens each);
    ``compile``: the memkern configurations compiled (their rows are named ``<name>+compile``);
    ``memory_budget``: memkern-fit's; ``max_grad_norm``: the clipping threshold.

    Step 0 warms up (first allocations, lazy initialisation, compilation); step 1 is measured
    for memory (under the profiler on CPU, so it is left out of the timing); up to
    ``EXTRA_WARMUP_STEPS`` more warm up, leaving at least one step; the median time of the
    rest is reported.
    """
    first_timed = 2 + max(0, min(EXTRA_WARMUP_STEPS, steps - 3))
    # The previous configuration's model and optimizer sit in reference cycles until a
    # garbage collection: collected here, not in the middle of this run, where the memory
    # they free would lower this configuration's peak above its starting level.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    setup = build(name, cfg, device, seed, compile=compile, batch=batch,
                  memory_budget=memory_budget, max_grad_norm=max_grad_norm)
    if compile and name.startswith("memkern"):
        name = f"{name}+compile"
    batches = Batches(corpus, batch, cfg.seq, seed=seed, device=device)
    bar = Progress(name, steps, progress)
    losses, times = [], []
    persistent = step_peak = 0
    breakdowns = []
    for i in range(steps):
        x, y = batches.next()
        if i == 1:
            persistent = memory_breakdown(setup.model, setup.optimizer).total
            stats = allocation_stats(
                setup.train_step, x, y, device=device,
                after_backward=lambda: breakdowns.append(
                    memory_breakdown(setup.model, setup.optimizer)))
            step_peak, loss = stats.peak, stats.result
        else:
            _sync(device)
            start = time.perf_counter()
            loss = setup.train_step(x, y)
            _sync(device)
            if i >= first_timed:
                times.append(time.perf_counter() - start)
        losses.append(loss.item())
        bar.update(i + 1, losses[-1])

    if device.type == "cuda":
        _sync(device)
        held = torch.cuda.memory_allocated(device) - base
    else:
        held = persistent

    split = None
    if device.type == "cuda":  # a fresh batch per step, fetched before the clock starts
        pending = iter([batches.next() for _ in range(SPLIT_REPS + 1)])
        split = host_device.measure(lambda: setup.train_step(*next(pending)), reps=SPLIT_REPS)

    x, y = batches.next()
    with setup.autocast():
        saved = saved_bytes(setup.model, x, y)
    breakdown = breakdowns[0]  # after backward: the gradients exist in every configuration
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        peak = persistent + step_peak
    step_seconds = statistics.median(times)
    return Row(name, peak, saved, breakdown.params, breakdown.grads, breakdown.master_weights,
               breakdown.optimizer_state, breakdown.num_params,
               breakdown.optimizer_side_per_param, step_seconds,
               batch * cfg.seq / step_seconds, losses, step_seconds_min=min(times),
               step_seconds_max=max(times),
               host_seconds=split.host_seconds if split else None,
               gpu_seconds=split.gpu_seconds if split else None,
               held_bytes=held)
