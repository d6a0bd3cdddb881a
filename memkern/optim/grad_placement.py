"""Where the gradients live: the interface of the part of a flat-buffer optimizer that lays the
parameters out, holds the accumulation window's gradients, reduces them across ranks, and says
where each parameter's state lies on this rank.

The parts (each in its own module):

==========================================  ================================================
:class:`~memkern.optim.local_grads.LocalGrads`    one process, the whole flat gradient buffer
                                            on the model's device (the fused optimizers'
                                            and ``ShardedOptimizer``'s default in one
                                            process)
:class:`~memkern.optim.zero.Shards`          ZeRO-1/2 across ranks: the device buffer,
                                            reduce-scattered at the window's end (stage 1)
                                            or bucket by bucket during backward into this
                                            rank's shard (stage 2)
:class:`~memkern.optim.streamed_grads.StreamedGrads`  ``gradients="host"``: each bucket
                                            reduced during backward, then this rank's slice
                                            streamed to host memory, where the window sums
==========================================  ================================================

(FSDP2's DTensor parameters carry their own gradient shards: :mod:`memkern.optim.dtensor_params`.)

Every part cuts the flat layout into :class:`Unit` s: runs of parameters of one param group, one
dtype and one state precision, whose slice on this rank is one optimizer kernel call (a
:class:`~memkern.optim.flat_state.Segment`). In per-parameter coordinates, which do not depend
on the world size, a rank's part of a parameter is a *piece* (:meth:`GradPlacement.owned_piece`);
that is how state dicts and checkpoints address state.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from memkern.optim.grad_buffer import Bucket, GradBuffer
from memkern.optim.process_group import WeakGroup
from memkern.optim.segment import Segment


@dataclasses.dataclass(eq=False)
class Unit:
    """A run of parameters of one param group, one dtype and one state precision: one
    collective per step across ranks (its communication bucket) and, on each rank, one
    optimizer kernel call over its slice.

    ``[start, start + numel)`` of ``bucket``'s flat layout; ``numel`` is a multiple of
    ``W * ALIGN``. ``params`` lie at ``offsets`` (relative to ``start``). Each rank owns
    ``shard`` elements from ``start + rank * shard``; ``shard_start`` is where this unit's
    slice lies in the rank's gradient shard of ``bucket`` (stage 2, streamed gradients).
    """

    index: int
    group: int
    bucket: Bucket
    start: int
    numel: int
    params: list[torch.Tensor]
    offsets: list[int]
    shard: int
    shard_start: int
    quantized: bool = False  # its parameters' moments are stored in 8 bits
    segment: Segment | None = None

    def owned(self, rank: int) -> slice:
        """This rank's slice of the unit, in the bucket's flat layout."""
        return slice(self.start + rank * self.shard, self.start + (rank + 1) * self.shard)

    @property
    def whole(self) -> slice:
        return slice(self.start, self.start + self.numel)


class GradPlacement:
    """Where the gradients live (see the module docstring): the interface, with the unit
    bookkeeping every part shares and the defaults of one process (no collective).
    :attr:`on_host`: the window's gradients are in host memory (the step reads them there).

    Built by the optimizer in three calls: :meth:`make_grad_buffer`, :meth:`make_segments`
    (the segments on this rank's device slices; the step part may then re-home them, see
    :mod:`memkern.optim.offload`), :meth:`broadcast_weights`.
    """

    on_host = False
    group = WeakGroup("memkern.ShardedOptimizer")
    """The process group, held weakly (:mod:`memkern.optim.process_group`)."""

    def __init__(self, group: Any = None, rank: int = 0, world: int = 1) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.units: list[Unit] = []
        self._place: dict[int, tuple[Unit, int]] = {}  # id(param) -> (unit, offset in unit)

    # ------------------------------------------------------------------------ construction
    def check_consistent(self, groups: list[dict[str, Any]], settings: dict[str, Any]) -> None:
        """Raises ValueError when the ranks disagree on the parameters or settings (one
        process: nothing to compare)."""

    def make_grad_buffer(self, groups: list[dict[str, Any]], grad_dtype: torch.dtype | None,
                         quantized_ids: set[int]) -> GradBuffer:
        """The flat layout of ``groups``' parameters (``quantized_ids``: those with 8-bit
        state, kept in units of their own)."""
        raise NotImplementedError

    def make_segments(self, buffer: GradBuffer) -> list[Segment]:
        """Builds the units and returns, per unit, the segment of this rank's slice: its
        reduced gradients and the model's weights there."""
        raise NotImplementedError

    def _add_unit(self, unit: Unit) -> None:
        self.units.append(unit)
        for p, o in zip(unit.params, unit.offsets):
            self._place[id(p)] = (unit, o)

    def broadcast_weights(self, buffer: GradBuffer) -> None:
        """Makes every rank's weights rank 0's (one process: nothing to do)."""

    # ---------------------------------------------------------------------------- backward
    def begin_backward(self) -> None:
        """A backward pass of ``ShardedOptimizer.backward`` starts."""

    def end_backward(self) -> None:
        """It ended: the micro-batch's gradients are where the window sums them."""

    def abandon_backward(self) -> None:
        """It raised: forget what is in flight (the window is lost)."""

    def watch_units(self, callback: Callable[[int], None] | None) -> None:
        """While set, ``callback(unit.index)`` runs once each unit's gradients are final in
        the current backward pass (the window's last); None stops it. Parts that cannot tell
        call nothing, and :meth:`end_backward` makes every unit final."""

    # -------------------------------------------------------------------------------- step
    def reduce_window(self) -> None:
        """At the window's end, before the norm: the reduction across ranks still to do."""

    def window_norm(self, num_items: torch.Tensor, gradless: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """L2 norm of the window's accumulated (scaled, un-normalised) gradient over all ranks,
        and the window's ``num_items`` and ``gradless`` totals over all ranks, as 0-dim tensors
        on ``num_items``' device (the model's)."""
        raise NotImplementedError

    def gather_weights(self) -> None:
        """After the update: every rank's updated weights to every rank."""

    def zero_grads(self) -> None:
        """Zeroes the window's gradients held outside the flat buffer (which the optimizer
        zeroes itself)."""

    # ------------------------------------------------------------------------ state pieces
    def unit_of(self, p: torch.Tensor) -> Unit:
        return self._place[id(p)][0]

    def owned_piece(self, p: torch.Tensor, flat: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """The part of parameter ``p`` this rank owns, as ``(view, start)``: ``view`` is the
        slice of ``flat`` (a tensor laid out like ``p``'s unit slice on this rank: a segment's
        state or gradients) holding ``p``'s flattened elements ``[start, start + numel)``.
        None when this rank owns none of ``p``."""
        unit, offset = self._place[id(p)]
        lo = self.rank * unit.shard
        a, b = max(lo, offset), min(lo + unit.shard, offset + p.numel())
        if a >= b:
            return None
        return flat[a - lo:b - lo], a - offset

    def shard_grads_of(self, unit: Unit) -> torch.Tensor:
        """This rank's reduced window gradient of ``unit`` (after :meth:`reduce_window`), laid
        out like its segment."""
        raise NotImplementedError

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums ``tensor`` over the ranks in place (one process: nothing to do)."""
        return tensor

    def gather_unit(self, unit: Unit, local: torch.Tensor) -> list[torch.Tensor]:
        """All ranks' slices of a unit-laid-out tensor (``local``: this rank's slice, on any
        device) as per-parameter CPU tensors of ``unit.params`` (collective). One process:
        views of ``local`` itself."""
        return [local[o:o + p.numel()].view_as(p) for p, o in zip(unit.params, unit.offsets)]

    def reduced_window_grads(self) -> list[torch.Tensor]:
        """Per unit, this rank's slice of the open window's gradient summed over ranks,
        without changing the window (collective)."""
        return [self.shard_grads_of(u) for u in self.units]

    def window_grad_targets(self) -> list[torch.Tensor]:
        """Per unit, where a loaded window's summed gradient goes on this rank, once the flat
        buffer was zeroed: its own slices, zeroed too (the other ranks' slices stay zero here,
        so the window's reduction at ``step`` sums to exactly the loaded values plus what
        comes after)."""
        self.zero_grads()
        return [self.shard_grads_of(u) for u in self.units]
