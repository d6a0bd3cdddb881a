"""Trains the configurations for a number of steps, timed in rounds, and measures them."""
from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from memkern import output
from memkern.bench import host_device, timing
from memkern.bench.configs import MAX_GRAD_NORM, MIN_STEPS, build
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
    """Bytes held between steps, after the warm-up (gradients zeroed): on a GPU, what the
    configuration keeps allocated on the device (state in host memory not counted); on the
    CPU, the persistent bytes (params, grads, master weights, optimizer state)."""
    step_times: list[float] = dataclasses.field(default_factory=list)
    """Seconds of each timed step, round by round (:func:`run`): index *r* ran in the same
    round as every other configuration's index *r*."""

    @property
    def host_device(self) -> host_device.HostDeviceTime | None:
        if self.host_seconds is None or self.gpu_seconds is None:
            return None
        return host_device.HostDeviceTime(self.step_seconds, self.host_seconds,
                                          self.gpu_seconds)

    @property
    def final_loss(self) -> float:
        return self.losses[-1]


# Steps timed for the host/GPU split on a GPU, after the timed steps (one more is profiled).
SPLIT_REPS = 3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trial:
    """One configuration being measured: built, warmed up and measured for memory by
    :meth:`prepare`, timed one step at a time by :meth:`timed_step`, summed up by
    :meth:`row`."""

    def __init__(self, name: str, cfg: GPTConfig, corpus: torch.Tensor, *, batch: int,
                 device: torch.device, seed: int = 0, compile: bool = False,
                 memory_budget: int | str | None = None,
                 max_grad_norm: float = MAX_GRAD_NORM) -> None:
        self.cfg, self.batch, self.device = cfg, batch, device
        # The previous configuration's garbage (reference cycles) is collected here, not in
        # the middle of this one's profiled step, where the memory it frees would lower this
        # configuration's peak below its starting level.
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        self.base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        self.setup = build(name, cfg, device, seed, compile=compile, batch=batch,
                           memory_budget=memory_budget, max_grad_norm=max_grad_norm)
        self.name = f"{name}+compile" if compile and name.startswith("memkern") else name
        self.batches = Batches(corpus, batch, cfg.seq, seed=seed, device=device)
        self.losses: list[float] = []
        self.times: list[float] = []

    def _step(self) -> float:
        x, y = self.batches.next()
        _sync(self.device)
        start = time.perf_counter()
        loss = self.setup.train_step(x, y)
        _sync(self.device)
        seconds = time.perf_counter() - start
        self.losses.append(loss.item())
        return seconds

    def prepare(self, untimed: int, after_each: Callable[[], None] = lambda: None) -> None:
        """The ``untimed`` (>= 2) steps before the timed ones: the first (first allocations,
        lazy initialisation, compilation), the second measured for memory (under the profiler
        on the CPU), the rest warm-up; ``after_each()`` after each."""
        self._step()
        after_each()
        x, y = self.batches.next()
        persistent = memory_breakdown(self.setup.model, self.setup.optimizer).total
        after_backward = []
        stats = allocation_stats(
            self.setup.train_step, x, y, device=self.device,
            after_backward=lambda: after_backward.append(
                memory_breakdown(self.setup.model, self.setup.optimizer)))
        self.losses.append(stats.result.item())
        self.breakdown = after_backward[0]  # after backward: every configuration's grads exist
        after_each()
        for _ in range(untimed - 2):
            self._step()
            after_each()
        # measured now, while this configuration's are the last allocations on the device
        if self.device.type == "cuda":
            _sync(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
            self.held = torch.cuda.memory_allocated(self.device) - self.base
        else:
            self.peak, self.held = persistent + stats.peak, persistent

    def timed_step(self) -> float:
        """One step, timed (seconds, synchronised on a GPU)."""
        seconds = self._step()
        self.times.append(seconds)
        return seconds

    def row(self) -> Row:
        """The measurements, with the saved activations (and on a GPU the host/GPU split)
        measured now."""
        split = None
        if self.device.type == "cuda":  # a fresh batch per step, fetched before the clock
            pending = iter([self.batches.next() for _ in range(SPLIT_REPS + 1)])
            split = host_device.measure(lambda: self.setup.train_step(*next(pending)),
                                        reps=SPLIT_REPS)
        x, y = self.batches.next()
        with self.setup.autocast():
            saved = saved_bytes(self.setup.model, x, y)
        b, step_seconds = self.breakdown, statistics.median(self.times)
        return Row(self.name, self.peak, saved, b.params, b.grads, b.master_weights,
                   b.optimizer_state, b.num_params, b.optimizer_side_per_param, step_seconds,
                   self.batch * self.cfg.seq / step_seconds, self.losses,
                   step_seconds_min=min(self.times), step_seconds_max=max(self.times),
                   host_seconds=split.host_seconds if split else None,
                   gpu_seconds=split.gpu_seconds if split else None,
                   held_bytes=self.held, step_times=list(self.times))


def untimed_steps(steps: int) -> int:
    """Steps before the timed ones: the first, the profiled one and up to
    ``EXTRA_WARMUP_STEPS`` more, leaving at least one timed."""
    return 2 + max(0, min(EXTRA_WARMUP_STEPS, steps - 3))


def run(names: Sequence[str], cfg: GPTConfig, corpus: torch.Tensor, *, steps: int, batch: int,
        device: torch.device, seed: int = 0, progress: bool = True, compile: bool = False,
        memory_budget: int | str | None = None, max_grad_norm: float = MAX_GRAD_NORM
        ) -> list[Row]:
    """Trains each configuration of ``names`` for ``steps`` steps (batch × cfg.seq tokens
    each) and measures it; ``compile``: the memkern configurations compiled (their rows are
    named ``<name>+compile``); ``memory_budget``: memkern-fit's; ``max_grad_norm``: the
    clipping threshold.

    Each configuration is built and runs its :func:`untimed_steps` in turn (warm-up, the
    memory measurement); then all of them stay built and take the remaining steps in rounds
    (:func:`memkern.bench.timing.in_rounds`): one timed step of each configuration per round,
    the order rotated, so that load from other processes falls on all of them alike. A row's
    ``step_times`` are its times round by round; its step time is their median.
    """
    if isinstance(names, str):
        raise TypeError(f"names must be a sequence of configuration names, got the string "
                        f"{names!r}: pass [{names!r}]")
    if steps < MIN_STEPS:
        raise ValueError(f"steps={steps} must be >= {MIN_STEPS}: the first step warms up, the "
                         "second is measured for memory, and at least one is timed")
    repeated = sorted({n for n in names if list(names).count(n) > 1})
    if repeated:
        raise ValueError(f"names repeats {', '.join(repeated)}: give each configuration once")
    untimed = untimed_steps(steps)
    trials: list[Trial] = []
    with output.progress(progress) as bars:
        tasks = {}
        for name in names:
            trial = Trial(name, cfg, corpus, batch=batch, device=device, seed=seed,
                          compile=compile, memory_budget=memory_budget,
                          max_grad_norm=max_grad_norm)
            trials.append(trial)
            task = tasks[trial.name] = bars.add_task(trial.name, total=steps, loss="")
            trial.prepare(untimed, lambda task=task, trial=trial: bars.update(
                task, advance=1, loss=f"{trial.losses[-1]:.4f}"))
        by_name = {t.name: t for t in trials}
        timing.in_rounds({t.name: t.timed_step for t in trials}, steps - untimed,
                         after_each=lambda name: bars.update(
                             tasks[name], advance=1, loss=f"{by_name[name].losses[-1]:.4f}"))
    return [t.row() for t in trials]
