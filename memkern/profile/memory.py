"""Where the bytes of a training set-up go: model/optimizer breakdown and per-step measurement.

:func:`memory_breakdown` walks the storages behind a model's parameters, their gradients and
an optimizer's state, counting each storage once (flat buffers whose views are ``p.grad`` or
``state[p]["master_param"]`` count whole, padding included). :func:`measure` runs a function
and reports its peak allocation, the bytes it saved for backward, and its wall time.
"""
from __future__ import annotations

import collections
import dataclasses
import time
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from memkern import _fake
from memkern.profile.allocations import allocation_stats
from memkern.profile.saved import SavedTensorsRecorder

MASTER_KEYS = ("master_param",)
"""Optimizer-state keys that hold float32 master weights (memkern's fused optimizers)."""


@dataclasses.dataclass
class MemoryBreakdown:
    """Bytes held on this rank, each storage counted once."""

    params: int
    grads: int
    master_weights: int
    """Explicit float32 master copies kept by the optimizer (``state[p]["master_param"]``)."""
    optimizer_state: int
    num_params: int
    params_as_master: int = 0
    """Bytes of float32 parameters that have no master copy: the optimizer updates them in
    place, so they are the full-precision weights (a subset of ``params``)."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master_weights + self.optimizer_state

    @property
    def optimizer_side_per_param(self) -> float:
        """Bytes per parameter held for the optimizer: gradients, the float32 weights it
        updates (master copies, or float32 parameters updated in place) and its state."""
        side = self.grads + self.master_weights + self.params_as_master + self.optimizer_state
        return side / max(self.num_params, 1)


class _StorageCounter:
    def __init__(self) -> None:
        self.seen: set[tuple[torch.device, int]] = set()

    def add(self, tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            t = _fake.local_tensor(t)  # a DTensor's memory on this rank: its shard
            storage = t.untyped_storage()
            key = (t.device, storage.data_ptr())
            if storage.nbytes() == 0 or key in self.seen:
                continue
            self.seen.add(key)
            total += storage.nbytes()
        return total


def _state_tensors(optimizer: Any) -> Iterable[tuple[str, torch.Tensor]]:
    # memkern's optimizers keep their (possibly sharded) state flat in segments; a rank's
    # shard of a sharded optimizer is listed there and not in ``optimizer.state``.
    segments = getattr(optimizer, "segments", None)
    if segments is not None:
        for seg in segments:
            yield from seg.stored_tensors().items()
            if seg.step is not None:
                yield "step", seg.step
        return
    for state in getattr(optimizer, "state", {}).values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                yield key, value


def memory_breakdown(model: nn.Module, optimizer: Any = None) -> MemoryBreakdown:
    """Bytes of parameters, gradients, master weights and optimizer state on this rank.

    ``optimizer`` is any ``torch.optim.Optimizer`` (memkern's included) or None. Tensors that
    share a storage are counted once, in the first category that reaches them; a DTensor
    (FSDP2) counts its local shard.
    """
    params = [p for p in model.parameters()]
    counter = _StorageCounter()
    param_bytes = counter.add(params)
    grad_bytes = counter.add(p.grad for p in params if p.grad is not None)
    state = list(_state_tensors(optimizer)) if optimizer is not None else []
    master_bytes = counter.add(t for k, t in state if k in MASTER_KEYS)
    state_bytes = counter.add(t for k, t in state if k not in MASTER_KEYS)
    has_master = {id(p) for seg in getattr(optimizer, "segments", ()) if seg.low_precision
                  for p in seg.params}
    has_master |= {id(p) for p, s in getattr(optimizer, "state", {}).items()
                   if any(k in s for k in MASTER_KEYS)}
    params_as_master = _StorageCounter().add(
        p for p in params if p.dtype == torch.float32 and id(p) not in has_master)
    return MemoryBreakdown(param_bytes, grad_bytes, master_bytes, state_bytes,
                           sum(p.numel() for p in params), params_as_master)


@dataclasses.dataclass
class Measurement:
    peak_bytes: int
    """Peak bytes allocated above the level at the start (CUDA allocator statistics on a
    GPU; the profiler's allocation trace on the CPU)."""
    saved_bytes: int
    """Bytes saved for backward by the autograd graphs built while running."""
    seconds: float
    result: Any


def measure(fn: Callable[[], Any], device: torch.device | str = "cpu") -> Measurement:
    """Runs ``fn()`` once and measures its peak allocation, saved bytes and wall time."""
    device = torch.device(device)

    def timed() -> tuple[Any, float, int]:
        with SavedTensorsRecorder() as recorder:
            start = time.perf_counter()
            result = fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return result, time.perf_counter() - start, recorder.bytes

    stats = allocation_stats(timed, device=device)
    result, seconds, saved = stats.result
    return Measurement(stats.peak, saved, seconds, result)


def reachable_bytes(*roots: Any) -> int:
    """Bytes of the distinct storages of every tensor that ``roots`` keep alive: reached
    through attributes, containers and ``.grad``, whatever kept them (the flat buffers, the
    segments' state, the scaler, anything left behind), each storage counted once, whole."""
    seen, storages, stack, total = set(), set(), list(roots), 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType,
                                               types.MethodType, str, bytes, int, float)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if (obj.device, storage.data_ptr()) not in storages:
                storages.add((obj.device, storage.data_ptr()))
                total += storage.nbytes()
            if obj.grad is not None:
                stack.append(obj.grad)
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return total
