"""ZeRO-1/2 for :class:`~memkern.optim.ShardedOptimizer`: the sharded layout, this rank's
shards, and the collectives over them (``torch.distributed``: nccl on GPUs, gloo on CPU).

Layout. The flat layout of :class:`~memkern.GradBuffer` (one buffer per dtype, parameters in
slots aligned to ``ALIGN`` = 256 elements, param group after param group) is cut into *units*:
runs of parameters of one param group and one dtype, of at most ``bucket_size_mb`` of
gradients (a larger parameter is a unit of its own). Each unit is padded to a multiple of
``W * ALIGN`` elements, so rank ``r`` of ``W`` owns the equal, ALIGN-aligned, contiguous slice
``[r * numel / W, (r + 1) * numel / W)`` of every unit, whatever W is (odd W, parameters
smaller than W or than ALIGN included: the padding is zero and stays zero). A unit is the
communication bucket (one collective each) and a rank's slice of it is one optimizer kernel
call (a :class:`~memkern.optim.flat_state.Segment`). The units do not depend on W: only their
padding does, which is why checkpoints move between world sizes.

What lives where, per rank (``P`` = bytes of a parameter, ``G`` = of a gradient):

==============================  ============================  ===============================
                                zero_stage=1                  zero_stage=2
==============================  ============================  ===============================
model weights (flat)            all: P                        all: P
gradients                       all (flat buffer): G          this rank's slices only: G / W,
                                                              plus units in flight
float32 master (16-bit P only)  this rank's slices: 4 / W     same
optimizer state                 this rank's slices: 8 / W     same
==============================  ============================  ===============================

With Adam and 16-bit weights and gradients that is 4 + 12/W bytes per parameter for stage 1
and 2 + 14/W for stage 2 (docs/memory.md). With ``offload="cpu"`` the master, the
optimizer state and the step counters are in host memory (see :mod:`memkern.optim.offload`).

Stage 1. Micro-batches accumulate locally in the full gradient buffer with no communication
(as in one process). At the window's end every unit is reduce-scattered *in place*: rank r's
slice of the buffer receives the sum over ranks of that slice, which is all its optimizer
step reads. Reduce-scatter rather than all-reduce: an all-reduce is a reduce-scatter followed
by an all-gather, and the all-gather half would deliver summed gradients that no rank uses
(the updated weights are all-gathered instead, in the weights' dtype). NCCL runs it as one
ring reduce-scatter, ``(W-1)/W`` of the unit per rank. Gloo (torch 2.13) implements
``reduce_scatter_tensor`` as an all-reduce of a copy of the input followed by a local slice:
the same algorithm and result here, at twice the traffic and with one unit-sized copy.

Stage 2. The full gradient never exists: the buffer holds no gradients
(:class:`~memkern.GradBuffer` with ``on_grad``), and a post-accumulate hook copies each
parameter's gradient into its unit's staging buffer as soon as autograd produced it, then
frees it. A complete unit is reduce-scattered asynchronously while backward goes on, and the
result is added into this rank's gradient slices. Units are launched in one fixed order
(reverse layout order, the order backward produces them), so every rank issues the same
collectives in the same order; a unit with a parameter that got no gradient holds itself and
the later ones back until the end of the backward pass. At most :data:`IN_FLIGHT` collectives
run at a time, bounding the staging memory to a few units.

Accumulation under stage 2 reduce-scatters *every* micro-batch into the shard (the standard
ZeRO-2 choice, DeepSpeed's): the alternative, accumulating full gradients locally and
reducing on the window's last micro-batch only, keeps the full gradient alive for the whole
window, which is exactly what stage 2 exists to avoid. The price is ``accumulation_steps``
times the gradient traffic, overlapped with backward. It is the one exception to "no
communication until the window's last micro-batch" (docs/api.md); stage 1 keeps it.

Every rank runs the same windows: the same number of ``backward()`` calls per window and the
same ``step()`` calls, or the collectives do not match (and time out).
"""
from __future__ import annotations

import collections
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from memkern import _fake, ops
from memkern.optim.grad_buffer import ALIGN, GradBuffer, aligned, check_params
from memkern.optim.grad_placement import GradPlacement, Unit
from memkern.optim.segment import Segment

IN_FLIGHT = 2
"""Asynchronous collectives a rank keeps running at once. Each holds unit-sized buffers (the
stage-2 staging buffer, gloo's copies) until it completes: two let one transfer while the next
is prepared."""

# torch 2.13 renamed the tensor collectives and deprecated the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class UnitLayout:
    """The :data:`~memkern.optim.grad_buffer.Layout` of a sharded optimizer: cuts each
    bucket's parameters into units and pads every unit to a multiple of ``world * ALIGN``.
    Records the units it placed, per dtype, for :meth:`Shards.make_segments`."""

    def __init__(self, group_of: dict[int, int], world: int, unit_bytes: float,
                 grad_dtype: torch.dtype | None, quantized_ids: set[int] = frozenset()) -> None:
        self.group_of, self.world = group_of, world
        self.unit_bytes, self.grad_dtype = unit_bytes, grad_dtype
        self.quantized_ids = quantized_ids  # parameters with 8-bit state: units of their own
        # dtype -> [(group, first param index, param count, start, numel, quantized)]
        self.placed: dict[torch.dtype, list[tuple[int, int, int, int, int, bool]]] = {}

    def __call__(self, params: list[torch.Tensor]) -> tuple[list[int], int]:
        item = (self.grad_dtype or params[0].dtype).itemsize
        limit = max(int(self.unit_bytes) // item, 1)
        runs: list[list[int]] = []  # indices into params, one list per unit
        size = 0
        for i, p in enumerate(params):
            n = aligned(p.numel())
            last = params[runs[-1][0]] if runs else None
            same_group = last is not None and self._key(last) == self._key(p)
            if same_group and size + n <= limit:
                runs[-1].append(i)
                size += n
            else:
                runs.append([i])
                size = n
        offsets, end, placed = [], 0, []
        for run in runs:
            start = end
            for i in run:
                offsets.append(end)
                end += aligned(params[i].numel())
            end = aligned(end, self.world * ALIGN)
            group, quantized = self._key(params[run[0]])
            placed.append((group, run[0], len(run), start, end - start, quantized))
        self.placed[params[0].dtype] = placed
        return offsets, end

    def _key(self, p: torch.Tensor) -> tuple[int, bool]:
        """Parameters share a unit only when they share this: param group, 8-bit state."""
        return self.group_of[id(p)], id(p) in self.quantized_ids


def _describe(groups: list[dict[str, Any]], settings: dict[str, Any]) -> dict[str, Any]:
    """What every rank must agree on: the settings and, per param group, its options and its
    parameters' shapes and dtypes; or why this rank's parameters are unusable."""
    try:
        check_params(p for g in groups for p in g["params"])
    except (TypeError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {
        "error": None,
        "settings": settings,
        "groups": [{
            "options": {k: repr(v) for k, v in g.items() if k not in ("params", "param_names")},
            "params": [(tuple(p.shape), str(p.dtype).removeprefix("torch.")) for p in g["params"]],
        } for g in groups],
    }


def _first_difference(a: dict[str, Any], b: dict[str, Any]) -> str:
    if a["settings"] != b["settings"]:
        key = next(k for k in a["settings"] if a["settings"][k] != b["settings"].get(k))
        return f"{key}={a['settings'][key]!r} on rank 0 but {b['settings'].get(key)!r}"
    if len(a["groups"]) != len(b["groups"]):
        return f"{len(a['groups'])} param groups on rank 0 but {len(b['groups'])}"
    for gi, (ga, gb) in enumerate(zip(a["groups"], b["groups"])):
        if len(ga["params"]) != len(gb["params"]):
            return (f"param group {gi} has {len(ga['params'])} parameters on rank 0 but "
                    f"{len(gb['params'])}")
        for pi, (pa, pb) in enumerate(zip(ga["params"], gb["params"])):
            if pa != pb:
                return (f"param group {gi}, parameter {pi} is {pa[1]} of shape {pa[0]} on rank 0 "
                        f"but {pb[1]} of shape {pb[0]}")
        if ga["options"] != gb["options"]:
            return f"param group {gi} has options {ga['options']} on rank 0 but {gb['options']}"
    return "the descriptions differ"


def unit_square(grads: torch.Tensor) -> torch.Tensor:
    """The squared L2 norm of one unit's gradients, in float64 (what the window's norm sums)."""
    return ops.l2_norm(grads).double().square()


def _weak_hook(method: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """A hook that calls ``method`` while its object lives: hooks stay on the parameters,
    which may outlive the optimizer (and must not keep its shards alive)."""
    ref = weakref.WeakMethod(method)

    def hook(p: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(p)

    return hook



class Shards(GradPlacement):
    """This rank's part of a :class:`~memkern.optim.ShardedOptimizer` across ranks and the
    collectives over it (see the module docstring): the
    :class:`~memkern.optim.grad_placement.GradPlacement` of ZeRO-1/2.

    Args:
        group: the process group (None: one process, no ``torch.distributed``).
        rank, world: this process's rank in ``group`` and the group's size.
        zero_stage: 1 or 2.
        bucket_size_mb: the largest unit, in MiB of gradients.
    """

    def __init__(self, group: Any, rank: int, world: int, zero_stage: int,
                 bucket_size_mb: float) -> None:
        super().__init__(group, rank, world)
        self.zero_stage = zero_stage
        self.unit_bytes = bucket_size_mb * 2**20
        self._layout: UnitLayout | None = None
        # Stage 2: per bucket, this rank's slices of all its units' gradients, back to back.
        self.shard_grads: dict[int, torch.Tensor] = {}
        self._in_flight: collections.deque = collections.deque()
        # Stage 2, per backward pass: gradients arrived per unit, staging buffers, next unit
        # to launch (index into self._order).
        self._in_backward = False
        self._arrived: list[set[int]] = []
        self._staging: dict[int, torch.Tensor] = {}
        self._next = 0
        self._order: list[Unit] = []
        # Called with a unit's index once its gradients are final in the current backward
        # pass (watch_units).
        self._watch: Callable[[int], None] | None = None
        self._final: list[set[int]] = []

    @property
    def label(self) -> str:
        """The setting that chose this part, for error messages."""
        return f"zero_stage={self.zero_stage}"

    # ------------------------------------------------------------------------ construction
    def check_consistent(self, groups: list[dict[str, Any]], settings: dict[str, Any]) -> None:
        """Raises ValueError on every rank when the ranks disagree on the parameters (count,
        shapes, dtypes), the param groups or ``settings``: one small all_gather_object at
        construction instead of mismatched collectives that hang later."""
        if self.world == 1:
            return
        mine = _describe(groups, settings)
        every = [None] * self.world
        # Host metadata: pickled and sized on real tensors even while the planner runs the
        # optimizer on fake ones (whose sizes have no value to read).
        with _fake.without_dispatch_modes():
            dist.all_gather_object(every, mine, group=self.group)
        for rank, theirs in enumerate(every):
            if theirs["error"] is not None:
                raise ValueError(f"memkern.ShardedOptimizer: rank {rank} of process_group cannot "
                                 f"use its parameters: {theirs['error']}")
        for rank, theirs in enumerate(every):
            if theirs != every[0]:
                raise ValueError(
                    f"memkern.ShardedOptimizer: the {self.world} ranks of process_group were "
                    f"given different parameters or settings: {_first_difference(every[0], theirs)}"
                    f" on rank {rank}. Every rank must build the same model and pass the same "
                    "params and arguments (in the same order)"
                )

    def make_grad_buffer(self, groups: list[dict[str, Any]], grad_dtype: torch.dtype | None,
                         quantized_ids: set[int]) -> GradBuffer:
        """The flat layout, cut into units (``quantized_ids``: the parameters with 8-bit
        state); stage 2's buffer hands gradients to the hooks."""
        params = [p for g in groups for p in g["params"]]
        group_of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
        self._layout = UnitLayout(group_of, self.world, self.unit_bytes, grad_dtype,
                                  quantized_ids)
        on_grad = _weak_hook(self._on_grad) if self.zero_stage == 2 else None
        return GradBuffer(params, dtype=grad_dtype, layout=self._layout, on_grad=on_grad)

    def make_segments(self, buffer: GradBuffer) -> list[Segment]:
        """The units and, for each, the segment of this rank's slice: its gradients (stage 1:
        a slice of the flat buffer; stage 2: of the rank's gradient shard) and its weights (a
        slice of the flat weights)."""
        for bucket in buffer.buckets:
            shard_start = 0
            for group, first, count, start, numel, quantized in self._layout.placed[
                    bucket.dtype]:
                params = bucket.params[first:first + count]
                offsets = [o - start for o in bucket.offsets[first:first + count]]
                unit = Unit(len(self.units), group, bucket, start, numel, params, offsets,
                            numel // self.world, shard_start, quantized)
                self._add_unit(unit)
                shard_start += unit.shard
            if self.zero_stage == 2:
                self.shard_grads[id(bucket)] = self._make_shard_grads(
                    bucket.numel // self.world, bucket.grad_dtype, buffer.device)
        self._order = self.units[::-1]
        if self.world == 1 and self.zero_stage == 1:
            for p in buffer.params:  # stage 2 knows when a unit is final: its reduction
                p.register_post_accumulate_grad_hook(_weak_hook(self._grad_accumulated))
        for unit in self.units:
            # With one rank a slice is the whole unit: per-parameter state views work.
            whole = self.world == 1
            unit.segment = Segment(unit.group, self.shard_grads_of(unit),
                                   unit.bucket.weights[unit.owned(self.rank)],
                                   unit.params if whole else [], unit.offsets if whole else [],
                                   quantized=unit.quantized)
        return [u.segment for u in self.units]

    def _make_shard_grads(self, numel: int, dtype: torch.dtype,
                          device: torch.device) -> torch.Tensor:
        """Stage 2: the zeroed gradient shard of one bucket (on the model's device)."""
        return torch.zeros(numel, dtype=dtype, device=device)

    def shard_grads_of(self, unit: Unit) -> torch.Tensor:
        """This rank's reduced gradients of ``unit`` (after the window's reduction): a slice of
        the flat buffer (stage 1) or of the gradient shard (stage 2)."""
        if self.zero_stage == 1:
            return unit.bucket.grads[unit.owned(self.rank)]
        flat = self.shard_grads[id(unit.bucket)]
        return flat[unit.shard_start:unit.shard_start + unit.shard]

    def broadcast_weights(self, buffer: GradBuffer) -> None:
        """Rank 0's initial weights to every rank, as DistributedDataParallel does: each rank
        keeps the master of its own slices, so they must start from the same values."""
        if self.world == 1:
            return
        src = dist.get_global_rank(self.group, 0)
        for bucket in buffer.buckets:
            dist.broadcast(bucket.weights, src=src, group=self.group)

    # ------------------------------------------------------------------------- collectives
    def _launch(self, work: Any, finish: Callable[[], None] | None = None,
                keep: torch.Tensor | None = None) -> None:
        """Tracks an asynchronous collective (None: already done, one rank: ``finish`` runs
        now); ``finish`` runs once it completed; ``keep`` is a buffer that must live until
        then."""
        if work is None:
            if finish is not None:
                finish()
            return
        self._in_flight.append((work, finish, keep))
        while len(self._in_flight) > IN_FLIGHT:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        work, finish, _ = self._in_flight.popleft()
        if work is not None:
            work.wait()
        if finish is not None:
            finish()

    def drain(self) -> None:
        """Waits for every collective in flight (on a GPU: the current stream waits)."""
        while self._in_flight:
            self._finish_oldest()

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> Any:
        if self.world == 1:
            if out is not inp:
                out.copy_(inp)
            return None
        return _reduce_scatter(out, inp, group=self.group, async_op=True)

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Any:
        if self.world == 1:
            if out is not inp:
                out.copy_(inp)
            return None
        return _all_gather(out, inp, group=self.group, async_op=True)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums ``tensor`` over the ranks in place (a no-op for one rank)."""
        if self.world > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def reduce_window(self) -> None:
        """Stage 1, at the window's end: every unit of the flat gradient buffer reduce-scattered
        in place; this rank's slices then hold the sums over ranks. (Stage 2 reduced them
        during backward; one rank's slice is the whole unit.)"""
        if self.zero_stage != 1 or self.world == 1:
            return
        for unit in self.units:
            grads = unit.bucket.grads
            self._launch(self._reduce_scatter(grads[unit.owned(self.rank)], grads[unit.whole]))
        self.drain()

    def window_norm(self, num_items: torch.Tensor, gradless: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each rank's norm over its reduced shard, then one all-reduce of
        ``[norm², num_items, gradless]`` in float64, whose sum is non-finite exactly when some
        rank's shard holds an inf/NaN (squares are >= 0 and cannot overflow float64)."""
        packet = torch.stack([torch.stack(self._unit_squares()).sum().to(num_items.device),
                              num_items, gradless])
        self.all_reduce(packet)
        return packet[0].sqrt().float(), packet[1], packet[2]

    def _unit_squares(self) -> list[torch.Tensor]:
        """Per unit, the squared norm of this rank's reduced slice (0-dim float64)."""
        return [unit_square(self.shard_grads_of(u)) for u in self.units]

    def gather_weights(self) -> None:
        """Every rank's updated slices of the weights to every rank (the weights' dtype)."""
        if self.world == 1:
            return
        for unit in self.units:
            weights = unit.bucket.weights
            self._launch(self._all_gather(weights[unit.whole], weights[unit.owned(self.rank)]))
        self.drain()

    # ---------------------------------------------------------------------- stage-2 hooks
    def begin_backward(self) -> None:
        if self.zero_stage == 2:
            self._in_backward = True
            self._arrived = [set() for _ in self.units]
            self._next = 0

    def _on_grad(self, p: torch.Tensor) -> None:
        """Post-accumulate hook (stage 2): ``p.grad`` into its unit's staging buffer, freed;
        launches the units that are complete, in order."""
        if not self._in_backward:
            raise RuntimeError(
                f"memkern.ShardedOptimizer ({self.label}): a gradient arrived outside "
                f"ShardedOptimizer.backward(loss); with {self.label} gradients are reduced into "
                "the rank's shard as backward produces them, so call opt.backward(loss) instead "
                "of loss.backward()"
            )
        unit, offset = self._place[id(p)]
        if len(self.units) - 1 - unit.index < self._next:  # its place in the launch order
            raise RuntimeError(
                f"memkern.ShardedOptimizer ({self.label}): a parameter of shape "
                f"{tuple(p.shape)} received a second gradient in one backward pass after its "
                "bucket was already reduced (reentrant activation checkpointing that runs "
                "backward more than once over it?); use non-reentrant checkpointing "
                "(memkern.checkpoint, or torch.utils.checkpoint with use_reentrant=False)"
            )
        staging = self._staging.get(unit.index)
        if staging is None and self._takes_whole(unit, p.grad):
            # One rank, a unit of one parameter: its gradient is the unit's reduction as it is
            # (no staging copy, which for a large embedding or head is as large as it).
            self._staging[unit.index] = p.grad.reshape(-1)
        else:
            if staging is None:
                staging = torch.zeros(unit.numel, dtype=unit.bucket.grad_dtype, device=p.device)
                self._staging[unit.index] = staging
            staging[offset:offset + p.numel()].add_(p.grad.reshape(-1))
        p.grad = None
        self._arrived[unit.index].add(id(p))
        while self._next < len(self._order) and self._complete(self._order[self._next]):
            self._launch_unit()

    def _takes_whole(self, unit: Unit, grad: torch.Tensor) -> bool:
        """Whether ``grad``, the first gradient of ``unit`` in this pass, is taken as the unit's
        reduction itself: one rank, one parameter, the gradients' dtype (adding it into a zero
        buffer first would change no bit: the sum it is added to starts at +0, and
        ``x + (-0) == x + (+0)`` for every such ``x``)."""
        return self.world == 1 and len(unit.params) == 1 and grad.dtype == unit.bucket.grad_dtype

    def _complete(self, unit: Unit) -> bool:
        return len(self._arrived[unit.index]) == len(unit.params)

    def _launch_unit(self) -> None:
        unit = self._order[self._next]
        self._next += 1
        staging = self._staging.pop(unit.index, None)
        if staging is None:  # no gradient reached this unit on this rank: it still takes part
            staging = torch.zeros(unit.numel, dtype=unit.bucket.grad_dtype,
                                  device=unit.bucket.weights.device)
        # one rank: the staging buffer is the unit's reduction
        reduced = staging if self.world == 1 else torch.empty(
            unit.shard, dtype=staging.dtype, device=staging.device)
        self._launch(self._reduce_scatter(reduced, staging),
                     lambda: self._take_reduced(unit, reduced), keep=staging)

    def _take_reduced(self, unit: Unit, reduced: torch.Tensor) -> None:
        """Stage 2, once ``unit``'s reduction ``reduced`` (this rank's slice, on the device; one
        parameter's gradient alone: its leading elements) completed: added into the rank's
        gradient shard; the unit is then final."""
        self.shard_grads_of(unit)[:reduced.numel()].add_(reduced)
        self._unit_final(unit)

    def _unit_final(self, unit: Unit) -> None:
        if self._watch is not None:
            self._watch(unit.index)

    def watch_units(self, callback: Callable[[int], None] | None) -> None:
        """While set (one process, the step on the host: the window's last backward pass),
        ``callback(unit.index)`` runs once each unit's gradients are final in the current
        backward pass: stage 1, all its parameters' gradients accumulated in the buffer;
        stage 2, its reduction added into the shard. None stops it."""
        self._watch = callback
        self._final = [set() for _ in self.units]

    def _grad_accumulated(self, p: torch.Tensor) -> None:
        """Post-accumulate hook (stage 1, one process): counts a unit's gradients."""
        if self._watch is None:
            return
        unit, _ = self._place[id(p)]
        final = self._final[unit.index]
        final.add(id(p))
        if len(final) == len(unit.params):
            self._watch(unit.index)

    def end_backward(self) -> None:
        """After a backward pass (stage 2): launches the units still waiting, in order, and
        waits for all of them; this rank's shard then holds the micro-batch's reduced sum."""
        if self.zero_stage != 2:
            return
        while self._next < len(self._order):
            self._launch_unit()
        self.drain()
        self._in_backward = False

    def abandon_backward(self) -> None:
        """A backward pass raised: forget its staging buffers (the window is lost)."""
        self._in_flight.clear()
        self._staging.clear()
        self._in_backward = False

    def zero_grads(self) -> None:
        for flat in self.shard_grads.values():
            flat.zero_()

    # ------------------------------------------------------------------------- checkpoints
    def gather_unit(self, unit: Unit, local: torch.Tensor) -> list[torch.Tensor]:
        device = unit.bucket.weights.device
        full = torch.empty(unit.numel, dtype=local.dtype, device=device)
        self._launch(self._all_gather(full, local.to(device)))
        self.drain()
        return [full[o:o + p.numel()].view_as(p).to("cpu", copy=True)
                for p, o in zip(unit.params, unit.offsets)]

    def reduced_window_grads(self) -> list[torch.Tensor]:
        """Stage 2's shard holds the window's reduced gradient; stage 1 reduce-scatters a
        copy."""
        if self.zero_stage == 2:
            return super().reduced_window_grads()
        slices = []
        for unit in self.units:
            out = torch.empty(unit.shard, dtype=unit.bucket.grads.dtype,
                              device=unit.bucket.grads.device)
            window = unit.bucket.grads[unit.whole].clone()
            self._launch(self._reduce_scatter(out, window), keep=window)
            slices.append(out)
        self.drain()
        return slices
