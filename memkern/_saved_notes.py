"""The channel for tensors kept for backward outside autograd's saved-tensor mechanism.

Some memkern code keeps such tensors itself (:func:`memkern.checkpoint` keeps its region's
inputs and, with the "selective" policy, the matmul outputs) and reports them through
:func:`note_saved` to whoever listens: the active recorders (:class:`memkern.profile.saved.
SavedTensorsRecorder`, one stack per thread) and the observers (the planner,
:mod:`memkern.profile.plan`). It sits below both the layers that report and the tools that
listen, so that ``memkern.nn`` does not import ``memkern.profile``.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

_local = threading.local()

observers: list[Callable[[torch.Tensor], None]] = []
"""Called with every tensor :func:`note_saved` reports, without making :func:`recording` true
(the planner, which must see the code paths of a plain run)."""


def recorders() -> list[Any]:
    """This thread's active recorders, innermost last: objects with a ``record(tensor)``
    method (:class:`memkern.profile.saved.SavedTensorsRecorder` pushes and pops itself)."""
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def is_parameter(t: torch.Tensor) -> bool:
    """``t`` is an ``nn.Parameter`` or a view of one."""
    base = t._base if t._base is not None else t
    return isinstance(base, torch.nn.Parameter)


def note_saved(*tensors: torch.Tensor | None) -> None:
    """Report tensors kept for backward outside autograd's saved-tensor mechanism."""
    for rec in recorders():
        for t in tensors:
            if t is not None:
                rec.record(t)
    for observe in observers:
        for t in tensors:
            if t is not None:
                observe(t)


def recording() -> bool:
    """Whether a recorder is active (lets callers skip the bookkeeping)."""
    return bool(recorders())


def reporting() -> bool:
    """Whether anything listens to :func:`note_saved`: a recorder, or an observer."""
    return bool(recorders()) or bool(observers)
