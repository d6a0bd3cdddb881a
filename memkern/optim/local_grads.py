"""One process's gradients in one flat buffer on the model's device: the
:class:`~memkern.optim.grad_placement.GradPlacement` of :class:`~memkern.optim.FusedAdamW`,
:class:`~memkern.optim.FusedSGD` and of :class:`~memkern.optim.ShardedOptimizer` in one
process with the step on the device.

The parameters are packed one after the other (:func:`~memkern.optim.grad_buffer.packed_layout`,
param group after param group); a unit, and its segment, is a whole run of one param group,
one dtype and one state precision (one kernel call each), and ``p.grad`` are views of the
buffer. Nothing is reduced: the window's gradient is the buffer.
"""
from __future__ import annotations

import itertools
from typing import Any

import torch

from memkern import ops
from memkern.optim.grad_buffer import GradBuffer, aligned
from memkern.optim.grad_placement import GradPlacement, Unit
from memkern.optim.segment import Segment


class LocalGrads(GradPlacement):
    """The whole flat gradient buffer of one process (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._group_of: dict[int, int] = {}
        self._quantized_ids: set[int] = set()
        self._buffer: GradBuffer | None = None

    def make_grad_buffer(self, groups: list[dict[str, Any]], grad_dtype: torch.dtype | None,
                         quantized_ids: set[int]) -> GradBuffer:
        self._group_of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
        self._quantized_ids = quantized_ids
        return GradBuffer([p for g in groups for p in g["params"]], dtype=grad_dtype)

    def make_segments(self, buffer: GradBuffer) -> list[Segment]:
        """One segment per run of one param group and one state precision in each dtype's
        bucket: its whole run of the flat layout."""
        self._buffer = buffer
        for bucket in buffer.buckets:
            placed = list(zip(bucket.params, bucket.offsets))
            runs = itertools.groupby(placed, key=lambda po: (self._group_of[id(po[0])],
                                                             id(po[0]) in self._quantized_ids))
            for (group, quantized), run in runs:
                run = list(run)
                start, end = run[0][1], run[-1][1] + aligned(run[-1][0].numel())
                params, offsets = [p for p, _ in run], [o - start for _, o in run]
                unit = Unit(len(self.units), group, bucket, start, end - start, params, offsets,
                            end - start, 0, quantized)
                unit.segment = Segment(group, bucket.grads[start:end], bucket.weights[start:end],
                                       params, offsets, quantized=quantized)
                self._add_unit(unit)
        return [u.segment for u in self.units]

    def window_norm(self, num_items: torch.Tensor, gradless: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One read-only pass per flat buffer. Non-finite exactly when some gradient is (or
        when the squares overflow float32, i.e. scaled gradients above ~1e19)."""
        norms = [ops.l2_norm(b.grads) for b in self._buffer.buckets]
        norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
        return norm, num_items, gradless

    def shard_grads_of(self, unit: Unit) -> torch.Tensor:
        return unit.bucket.grads[unit.whole]
