"""Bytes saved for backward: what a forward pass leaves in the autograd graph.

:func:`saved_bytes` runs a function under ``torch.autograd.graph.saved_tensors_hooks`` and adds
up the storages of the tensors that autograd saves, counting each storage once (views and
tensors saved by several ops share one). Parameters (and views of them) are left out by default:
they are alive anyway, so saving a reference to them costs nothing; an autocast copy of a
weight is a new storage and is counted.

Some memkern code keeps tensors for backward outside autograd's saving mechanism (the linear
cross-entropy keeps its precomputed gradients; :func:`memkern.checkpoint` keeps its region's
inputs and, with the "selective" policy, the matmul outputs). It reports them to active
recorders through :func:`note_saved`, so they are counted too. (Tensors that
``torch.utils.checkpoint`` used directly keeps for itself are invisible to this measure.)
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import torch

_local = threading.local()


def _stack() -> list[SavedTensorsRecorder]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def is_parameter(t: torch.Tensor) -> bool:
    """``t`` is an ``nn.Parameter`` or a view of one."""
    base = t._base if t._base is not None else t
    return isinstance(base, torch.nn.Parameter)


@dataclasses.dataclass
class SavedEntry:
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


class SavedTensorsRecorder:
    """Context manager recording the storages saved for backward inside it.

    ``recorder.bytes`` is the total; ``recorder.entries`` maps each storage to its size and
    the shape/dtype of the first tensor seen on it.
    """

    def __init__(self, include_parameters: bool = False) -> None:
        self.include_parameters = include_parameters
        self.entries: dict[tuple, SavedEntry] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    @property
    def bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def record(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or (not self.include_parameters and is_parameter(t)):
            return
        try:
            storage = t.untyped_storage()
            key = (t.device, storage.data_ptr(), storage.nbytes())
        except (RuntimeError, NotImplementedError):  # tensors without a storage
            return
        if key not in self.entries:
            self.entries[key] = SavedEntry(storage.nbytes(), tuple(t.shape), t.dtype, t.device)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.record(t)
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> SavedTensorsRecorder:
        _stack().append(self)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        _stack().remove(self)


_observers: list[Callable[[torch.Tensor], None]] = []
"""Called with every tensor :func:`note_saved` reports, without making :func:`recording` true
(the planner, :mod:`memkern.profile.plan`, which must see the code paths of a plain run)."""


def note_saved(*tensors: torch.Tensor | None) -> None:
    """Report tensors kept for backward outside autograd's saved-tensor mechanism."""
    for rec in _stack():
        for t in tensors:
            if t is not None:
                rec.record(t)
    for observe in _observers:
        for t in tensors:
            if t is not None:
                observe(t)


def recording() -> bool:
    """Whether a :class:`SavedTensorsRecorder` is active (lets callers skip the bookkeeping)."""
    return bool(_stack())


def reporting() -> bool:
    """Whether anything listens to :func:`note_saved`: a recorder, or an observer."""
    return bool(_stack()) or bool(_observers)


def saved_bytes(fn: Callable[..., Any], *args: Any, include_parameters: bool = False,
                **kwargs: Any) -> int:
    """Bytes saved for backward while running ``fn(*args, **kwargs)``, each storage once
    (counted as tensors are saved; the result of ``fn`` is discarded)."""
    with SavedTensorsRecorder(include_parameters=include_parameters) as rec:
        fn(*args, **kwargs)
    return rec.bytes
