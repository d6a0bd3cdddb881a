"""Bytes saved for backward: what a forward pass leaves in the autograd graph.

:func:`saved_bytes` runs a function under ``torch.autograd.graph.saved_tensors_hooks`` and adds
up the storages of the tensors that autograd saves, counting each storage once (views and
tensors saved by several ops share one). Parameters (and views of them) are left out by default:
they are alive anyway, so saving a reference to them costs nothing; an autocast copy of a
weight is a new storage and is counted.

Some memkern code keeps tensors for backward outside autograd's saving mechanism (the linear
cross-entropy keeps its precomputed gradients; :func:`memkern.checkpoint` keeps its region's
inputs and, with the "selective" policy, the matmul outputs). It reports them to active
recorders through :func:`note_saved` (:mod:`memkern._saved_notes`), so they are counted too.
(Tensors that ``torch.utils.checkpoint`` used directly keeps for itself are invisible to this
measure.)
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

# the channel itself is below memkern.nn, which reports to it; re-exported here for the users
from memkern._saved_notes import (  # noqa: F401
    is_parameter,
    note_saved,
    recorders,
    recording,
    reporting,
)


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
        recorders().append(self)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        recorders().remove(self)


def saved_bytes(fn: Callable[..., Any], *args: Any, include_parameters: bool = False,
                **kwargs: Any) -> int:
    """Bytes saved for backward while running ``fn(*args, **kwargs)``, each storage once
    (counted as tensors are saved; the result of ``fn`` is discarded)."""
    with SavedTensorsRecorder(include_parameters=include_parameters) as rec:
        fn(*args, **kwargs)
    return rec.bytes
