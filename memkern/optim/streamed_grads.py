"""``gradients="host"``: the gradients of :class:`~memkern.optim.ShardedOptimizer` stream to host
memory bucket by bucket as backward makes them; no gradient buffer lives on the device.

The path of one bucket (a :class:`~memkern.optim.grad_placement.Unit`) in each backward pass::

    autograd thread   p.grad -> the unit's device staging buffer (a post-accumulate hook per
                      parameter; p.grad freed) ... the unit's last gradient: across W ranks
                      its reduce-scatter (async), as zero_stage=2 does; then this rank's
                      slice copied down into a free pinned staging slot (download stream)
    summing thread    waits for the copy's event; the window's sum += the slot (in the
                      gradient dtype); the slot is free again; the unit is final (the host
                      step of the window's last micro-batch may start: memkern.optim.offload;
                      in that backward also the sum's squared norm: the step reads no sum)

The device holds the 16-bit weights and the buckets in flight only: a unit's staging buffer
lives from its first gradient until its copy down has read it, and at most
:data:`COPIES_IN_FLIGHT` copies are in flight (the autograd thread waits for a free slot
beyond that). Units are launched in reverse layout order, the order backward makes them; a
unit one of whose parameters got no gradient holds itself and the later ones back until the
end of the pass (as stage 2 does), so their staging buffers live until then.

Exact: the host sum of a window is the sum a device buffer would hold. Autograd adds each
micro-batch's gradient into the buffer (``grad += g``, in the gradient dtype, from zero); here
each micro-batch's gradient first lands in a zeroed staging buffer (``0 + g == g``, bit for
bit, but for -0.0, which becomes +0.0 there as it does in a zero buffer) and is then added to
the host sum with the same ``add_`` in the same dtype (float32 arithmetic rounded to the
gradient dtype, on the CPU as on a GPU). The window's norm, the inf check, clipping and the
update then run on the host sums (:class:`~memkern.optim.zero.Shards` and
:class:`~memkern.optim.offload.HostStep`).

Memory per parameter, with AdamW, 16-bit weights and gradients and W ranks: on the device 2
(the weights) plus the buckets in flight; in host memory, per rank, 2/W for the window's sum,
4/W for the float32 master, 8/W for the moments (about 2/W with 8-bit state), 2/W for the
pinned copy of the weights the host steps write (one process; across ranks on a GPU), and,
in one process, the copies the speculative steps keep of the state they change (as much as
the master and the moments: :mod:`memkern.optim.offload`), plus the pinned staging slots.
"""
from __future__ import annotations

import collections
import queue
from concurrent.futures import Executor, Future
from typing import Any

import torch

from memkern import _fake, _host
from memkern._copies import Transfers
from memkern.optim.grad_buffer import GradBuffer
from memkern.optim.grad_placement import Unit
from memkern.optim.segment import Segment
from memkern.optim.zero import Shards, unit_square

COPIES_IN_FLIGHT = 2
"""Copies down a rank keeps in flight at once, each into a pinned staging slot as large as the
largest unit's slice: two let one bucket's copy run while the next bucket's is issued."""


class StreamedGrads(Shards):
    """The :class:`~memkern.optim.grad_placement.GradPlacement` of ``gradients="host"`` (see the
    module docstring): stage 2's reduction during backward, with this rank's gradient shard
    in host memory.

    Args:
        group, rank, world: the process group, this process's rank in it, its size.
        bucket_size_mb: the largest unit, in MiB of gradients.
    """

    label = "gradients='host'"
    on_host = True

    def __init__(self, group: Any, rank: int, world: int, bucket_size_mb: float) -> None:
        super().__init__(group, rank, world, 2, bucket_size_mb)
        self._free_slots: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self._summing: Executor | None = None  # made with the segments
        self._sums: collections.deque[Future] = collections.deque()
        # The window's last backward (units watched): each unit's squared norm, taken on the
        # summing thread right after its last sum, so that the step need not read the sums.
        self._squares: dict[int, torch.Tensor] = {}

    def make_segments(self, buffer: GradBuffer) -> list[Segment]:
        self._transfers = Transfers(buffer.device)
        segments = super().make_segments(buffer)
        largest = max(u.shard * u.bucket.grad_dtype.itemsize for u in self.units)
        # the slots are held here too, not only in the queue of free ones (which a walk of
        # the optimizer's references, as memkern.profile.memory takes, does not enter)
        self._slots = [_host.empty(largest, torch.uint8, pinned=self._transfers.pinned,
                                   holds="gradients") for _ in range(COPIES_IN_FLIGHT)]
        for slot in self._slots:
            self._free_slots.put(slot)
        # one host thread sums the buckets in the order they arrive (the planner's fake
        # tensors: on the submitting thread, memkern._fake.thread_pool)
        self._summing = _fake.thread_pool(segments[0].weights, 1,
                                          thread_name_prefix="memkern-grad-sum")
        return segments

    def _make_shard_grads(self, numel: int, dtype: torch.dtype,
                          device: torch.device) -> torch.Tensor:
        """The window's sum of one bucket's slices on this rank, zeroed, in host memory."""
        return _host.empty(numel, dtype, pinned=False, holds="gradients").zero_()

    def _take_reduced(self, unit: Unit, reduced: torch.Tensor) -> None:
        """On the autograd thread once ``unit``'s reduction completed: its slice copied down
        into a free slot (waiting for one), and its summing queued."""
        slot = self._free_slots.get()
        landed = slot[:reduced.numel() * reduced.dtype.itemsize].view(reduced.dtype)
        arrived = self._transfers.down(landed, reduced)
        self._sums.append(self._summing.submit(self._sum, unit, slot, landed, arrived, reduced))

    @torch.no_grad()
    def _sum(self, unit: Unit, slot: torch.Tensor, landed: torch.Tensor,
             arrived: torch.cuda.Event | None, reduced: torch.Tensor) -> None:
        """On the summing thread: the window's sum of ``unit`` += what landed in ``slot``;
        ``reduced`` (the device buffer the copy reads) is held until the copy is done."""
        self._transfers.wait(arrived)
        del reduced
        window_sum = self.shard_grads_of(unit)
        window_sum[:landed.numel()].add_(landed)
        self._free_slots.put(slot)
        if self._watch is not None:  # the window's last backward: this sum is final
            self._squares[unit.index] = unit_square(window_sum)
        self._unit_final(unit)

    def _unit_squares(self) -> list[torch.Tensor]:
        if len(self._squares) == len(self.units):
            return [self._squares[u.index] for u in self.units]
        return super()._unit_squares()

    def begin_backward(self) -> None:
        self._squares.clear()
        super().begin_backward()

    def zero_grads(self) -> None:
        self._squares.clear()
        super().zero_grads()

    def _wait_sums(self) -> None:
        """Waits for every queued sum (re-raising what the summing thread raised)."""
        while self._sums:
            self._sums.popleft().result()

    def end_backward(self) -> None:
        """The units still waiting launched, and every unit's sum done: the host sums then
        hold the window's gradient so far."""
        super().end_backward()
        self._wait_sums()

    def abandon_backward(self) -> None:
        super().abandon_backward()
        self._wait_sums()
