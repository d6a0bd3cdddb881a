"""Where the optimizer step runs: the interface of that part of
:class:`~memkern.optim.ShardedOptimizer`, and :class:`DeviceStep`, the step on the model's
device.

The parts: :class:`DeviceStep` (the segments are slices of the device's flat buffers, updated
in place) and :class:`~memkern.optim.offload.HostStep` (``offload="cpu"``, ``gradients="host"``:
the segments are built on host memory, stepped by the C++ CPU kernels, in one process during
the window's last backward pass). The state's precision (32-bit or 8-bit) is the segments'
(:class:`~memkern.optim.segment.Segment`'s ``quantized``), whichever part steps them.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from memkern.optim.grad_placement import GradPlacement
from memkern.optim.segment import Segment

Update = Callable[[Segment, torch.Tensor | None, torch.Tensor | None], None]
"""``update(segment, grad_multiplier, found_inf)``: one optimizer kernel call on a segment."""


class StepPlacement:
    """Where the step runs (see the module docstring): the interface."""

    copies_weights = False
    """The segments' weights are copies of the model's (a float32 parameter's master then
    lives twice: in the model and in its segment)."""
    overlap = None
    """The host steps overlapped with backward (:class:`~memkern.optim.offload.OverlappedHostStep`),
    when this part runs them."""

    def home(self, segments: list[Segment], grads_on_host: bool) -> None:
        """Puts the segments' gradients and weights where the kernels read and write them
        (``grads_on_host``: the gradients' part keeps them in host memory already)."""
        raise NotImplementedError

    def allocating(self, holds: str) -> contextlib.AbstractContextManager:
        """The context the optimizer state holding ``holds`` (a :data:`memkern._host.HOLDS`
        entry) is made in: host memory is made inside :func:`memkern._host.allocating`."""
        raise NotImplementedError

    def pull_weights(self) -> None:
        """Before masters are made from the segments' weights: the model's weights into any
        copy of them."""

    def run(self, segments: list[Segment], update: Update, grad_multiplier: torch.Tensor,
            found_inf: torch.Tensor) -> None:
        """The update of every segment, with the window's multiplier and inf flag (0-dim
        device tensors)."""
        raise NotImplementedError

    def begin_last_backward(self, prepare: Callable[[], torch.Tensor],
                            grads: GradPlacement) -> None:
        """Before a window's last backward pass. A part that steps segments during it calls
        ``prepare()`` (the state made, the window's unclipped multiplier returned) and watches
        ``grads``' units."""

    def end_last_backward(self) -> None:
        """After it (the window's verdict is not known yet)."""

    def settle(self) -> None:
        """Undoes any step taken before the window's verdict (a backward after the window's
        last one, a state dict read or written mid-window)."""


class DeviceStep(StepPlacement):
    """The step on the model's device: one kernel call per segment, in place."""

    def home(self, segments: list[Segment], grads_on_host: bool) -> None:
        """The segments stay slices of the device's flat buffers."""

    def allocating(self, holds: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def run(self, segments: list[Segment], update: Update, grad_multiplier: torch.Tensor,
            found_inf: torch.Tensor) -> None:
        for seg in segments:
            update(seg, grad_multiplier, found_inf)
