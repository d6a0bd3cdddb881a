"""A training step's device memory, measured on fake tensors: the peak and what it is made of.

:func:`plan_training_step` builds a training set-up and runs whole training steps — forward,
backward, optimizer step — under a fake tensor mode (:mod:`memkern._fake`), so nothing is
computed and no memory is used, at any size. A dispatch mode sees every op; the storages the
ops create, and when they are freed (a weak reference on each storage) or resized in place
(``UntypedStorage.resize_``, as FSDP2 frees and re-gathers its unsharded parameters), make a
timeline of allocations. The timeline is replayed through the target device's allocator
(:mod:`memkern.profile.caching_allocator`; on a GPU the CUDA caching allocator, whose block
sizes are what ``torch.cuda.max_memory_allocated()`` adds up), and the peak is taken apart:

=====================  ==========================================================================
parameters             the storages of the model's parameters
gradients              the storages of the parameters' ``.grad`` (a flat gradient buffer whole)
master weights         optimizer state under a master-weight key (memkern's ``master_param``)
optimizer state        the rest of the optimizer's state (moments, step counters)
saved for backward     what autograd saves (``saved_tensors_hooks``) and what memkern reports
                       keeping (:func:`memkern.profile.note_saved`), by the module that saved it
kept from forward      created by this step's forward, alive after it, and neither of the above:
                       gradients a fused loss computed in forward, a checkpoint's inputs, the loss
transient              everything else: the outputs in flight and the ops' workspaces, by op
=====================  ==========================================================================

Each step has three phases — forward (inside a module's forward, or before backward),
backward (while autograd's engine runs a node: recomputation in backward included), optimizer
(after backward: unscaling, clipping, the update) — and the plan reports the highest moment of
each, so the second-highest moment is the peak of another phase.

**Host memory** is a budget too: offloading's buffers (:mod:`memkern._host`: the masters and the
optimizer state of ``offload="cpu"``, pinned copies of gradients and weights, blocks' inputs), and
what ops make from them alone, are planned on a timeline of their own, replayed through the
host's allocators (:class:`~memkern.profile.caching_allocator.HostAllocator`: torch's pinned
caching allocator rounds a request up to a power of two) into :attr:`StepPlan.host_peak`, taken
apart by what each buffer holds. For a GPU they are not device memory; on the CPU target host
and device are one memory, and they count in the device's peak too.

The set-up runs on the CPU as a stand-in for the target device: a :class:`Target`
(:mod:`memkern.profile.targets`) says what a GPU does differently (attention kernels, cuBLAS's
workspace, memkern's GPU code paths) and the planner applies it. A step written for the GPU
with ``torch.autocast("cuda")`` is planned under the CPU's autocast with the same dtype
(:class:`_AutocastOnHost`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import re
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from memkern import _fake, _host, _saved_notes, backend
from memkern.ops._registry import COMPOSITE_REFERENCES
from memkern.profile.caching_allocator import HostAllocator
from memkern.profile.memory import MASTER_KEYS, _state_tensors
from memkern.profile.targets import GEMMS, Target
from memkern.profile.targets import target as _target

CATEGORIES = ("parameters", "gradients", "master weights", "optimizer state",
              "saved for backward", "kept from forward", "transient")
PHASES = ("forward", "backward", "optimizer")
_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


@dataclasses.dataclass
class TrainingSetup:
    """What :func:`plan_training_step` runs: ``step()`` is one whole training step (forward,
    backward, optimizer step, zeroing the gradients) on ``model`` with ``optimizer``."""

    model: nn.Module
    optimizer: Any
    step: Callable[[], Any]
    description: str = ""


@dataclasses.dataclass
class Moment:
    """The allocations alive at one moment, taken apart (bytes: the allocator's blocks)."""

    phase: str
    allocated: int
    op: str
    """The op whose allocation made the moment."""
    where: str
    """The module running (forward) or the autograd node (backward) at that moment."""
    by_category: dict[str, int]
    saved_by_module: dict[str, int]
    """Saved-for-backward bytes by saving module (layer indices collapsed to ``*``)."""
    by_op: dict[str, dict[str, int]]
    """For "kept from forward" and "transient": bytes by ``op @ where``."""


@dataclasses.dataclass
class StepPlan:
    """A planned training step (see the module docstring). Bytes throughout."""

    device: str
    description: str
    peak: Moment
    """The measured step's highest moment."""
    phase_peaks: dict[str, Moment]
    """The highest moment of each phase of the measured step."""
    run_peak: int
    """The highest allocated over the whole run (set-up, warm-up steps and the measured step):
    what ``torch.cuda.max_memory_allocated()`` reports for a process that did just that."""
    step_start: int
    """Allocated when the measured step began."""
    held: dict[str, int]
    """Bytes of each persistent category at the measured step's start (storage sizes, each
    storage once: what :func:`memkern.profile.memory_breakdown` counts)."""
    reserved: int
    """Bytes the allocator reserved from the device by the end (its segments)."""
    seconds: float
    """Wall time of the planning."""
    flops: int | None = None
    """Floating-point operations of the measured step (``count_flops=True``), by the formulas
    of ``torch.utils.flop_counter`` (GEMMs and attention)."""
    host_peak: int = 0
    """The highest host memory the run's offloading holds (:mod:`memkern._host`'s buffers and
    what ops make from them alone): pinned buffers as the pinned caching allocator's blocks
    (freed ones cached, never returned), pageable ones at their size. 0: nothing offloaded."""
    host_by_category: dict[str, int] = dataclasses.field(default_factory=dict)
    """:attr:`host_peak` taken apart by what the buffers hold (:data:`memkern._host.HOLDS`,
    and "cached" for free pinned blocks), in the allocator's blocks."""
    host_pinned: int = 0
    """Of :attr:`host_peak`, the pinned blocks (page-locked: never swapped out)."""

    @property
    def peak_bytes(self) -> int:
        return self.peak.allocated

    @property
    def step_peak_above_start(self) -> int:
        """The measured step's peak above its starting level (``allocation_stats``'s peak)."""
        return self.peak.allocated - self.step_start

    @property
    def second(self) -> Moment | None:
        """The highest moment of a phase other than the peak's."""
        others = [m for p, m in self.phase_peaks.items() if p != self.peak.phase]
        return max(others, key=lambda m: m.allocated) if others else None


def collapse_indices(name: str) -> str:
    """``model.layers.3.mlp`` -> ``model.layers.*.mlp``: a layer's entries summed over layers."""
    return _INDEX.sub("*", name)


_active: list[_Timeline] = []


@contextlib.contextmanager
def on_host():
    """Inside a :func:`plan_training_step` build, storages created in the block are host memory,
    not the device's (a model built on the CPU before it is moved, as ``from_config(...).to(
    "cuda")`` does): they are not counted, and neither are their frees. Outside a plan: nothing."""
    tl = _active[-1] if _active else None
    if tl is None:
        yield
        return
    tl.host = True
    try:
        yield
    finally:
        tl.host = False


class _Timeline(TorchDispatchMode):
    """Records every storage's creation and death while ops run (see the module docstring)."""

    def __init__(self, tgt: Target) -> None:
        super().__init__()
        self.target = tgt
        self.events: list[int] = []  # sid: allocated; ~sid: freed
        self.marks: list[tuple[int, int, str]] = []  # (event index, step, phase) from there on
        self.nbytes: list[int] = []
        self.op: list[str] = []
        self.where: list[str] = []
        self.created: list[tuple[int, str]] = []  # (step, phase) at creation
        self.creator: list[tuple[str, int] | None] = []  # the node running at creation, if any
        self.saved: dict[int, tuple[int, str]] = {}  # sid -> (event index, saving module)
        self.roles: dict[int, str] = {}
        self._live: dict[int, int] = {}  # id(storage) -> sid
        self._refs: dict[int, weakref.ref] = {}
        self._modules: list[str] = []
        self.names: dict[int, str] = {}  # id(module) -> its name
        self.step, self.phase = -1, "setup"
        self._backward_ran = False
        self._gemm_threads: set[str] = set()
        self.roots: list[tuple[nn.Module, Any]] = []
        self.closed = False  # after the run: frees are no longer events
        self.host = False  # inside on_host(): new storages are host memory, not counted
        # Offloaded host memory (memkern._host's buffers, and what ops make from them alone):
        # sid -> [kind, what it holds]; its own events (sid: allocated; ~sid: freed)
        self.host_sids: dict[int, list] = {}
        self.host_events: list[int] = []
        self.host_sizes: dict[int, int] = {}
        self.count_flops = False
        self.flops = 0
        self._node: tuple[str, int] | None = None  # the autograd node running the current op
        # (first gradient's sid, sum's sid, event count) of a sum autograd's engine may write
        # over its first operand (_note_accumulation), until the next event
        self._accumulation: tuple[int, int, int] | None = None

    # ---------------------------------------------------------------------------- storages
    def _new(self, nbytes: int, op: str, where: str,
             offloaded: tuple[str, str] | None = None) -> int:
        """A new storage of ``nbytes``; ``offloaded``: ``(kind, holds)`` of offloaded host
        memory (:mod:`memkern._host`; its own timeline; on a CPU target, the same memory as
        the device's)."""
        sid = len(self.nbytes)
        self.op.append(op)
        self.where.append(where)
        self.created.append((self.step, self.phase))
        self.creator.append(self._node)
        if offloaded is not None:
            self.host_sids[sid] = list(offloaded)
            self.host_sizes[sid] = nbytes
            self.host_events.append(sid)
        if self.host or (offloaded is not None and self.target.name != "cpu"):
            self.nbytes.append(0)  # not device memory: no event, size 0 (never counted)
            return sid
        self.nbytes.append(nbytes)
        self.events.append(sid)
        return sid

    def _free(self, sid: int) -> None:
        pending, self._accumulation = self._accumulation, None
        if (pending is not None and pending[0] == sid and pending[2] == len(self.events)
                and not self.closed):
            self._accumulate_in_place(sid, pending[1])
            return
        if not self.closed and self.nbytes[sid]:
            self.events.append(~sid)
        if not self.closed and sid in self.host_sids:
            self.host_events.append(~sid)
        self._refs.pop(sid, None)

    def _watch(self, storage: torch.UntypedStorage, sid: int) -> None:
        """Frees ``sid`` when ``storage`` dies."""
        key = id(storage)
        self._live[key] = sid

        def died(_ref, key=key, sid=sid):
            if self._live.get(key) == sid:
                del self._live[key]
            if sid in self._refs:
                self._free(sid)

        self._refs[sid] = weakref.ref(storage, died)

    # ------------------------------------------------------------------ gradient accumulation
    def _note_accumulation(self, args: tuple, kwargs: dict, out: Any) -> None:
        """autograd's engine sums two gradients for one input with ``old + new``
        (``InputBuffer::accumulate``), and writes the sum over ``old`` instead (``old.add_(new)``)
        when it holds the last reference to a plain dense tensor — never for a fake tensor, a
        tensor subclass. So on the device the sum takes no block of its own: this notes a
        backward ``aten.add`` that may be such a sum (same shape and dtype, ``old`` made outside
        the running node: another node's gradient, or one a fused loss computed in forward), and
        :meth:`_free` moves the sum into ``old``'s block if ``old`` dies before anything else
        happens — the engine dropping its last reference. A node's own sum of its own
        intermediate is never taken for one (kept out-of-place: the plan errs high, not low)."""
        if kwargs or len(args) != 2 or not all(isinstance(t, torch.Tensor) for t in (*args, out)):
            return
        old, new = args
        if not (old.shape == new.shape == out.shape and old.dtype == new.dtype == out.dtype
                and old.is_contiguous()):
            return
        old_sid, out_sid = self.sid_of(old), self.sid_of(out)
        if (old_sid is None or out_sid is None or old_sid == out_sid or not self.events
                or self.events[-1] != out_sid or self.creator[old_sid] == self._node
                or self.nbytes[old_sid] != self.nbytes[out_sid]):
            return
        self._accumulation = (old_sid, out_sid, len(self.events))

    def _accumulate_in_place(self, old_sid: int, sum_sid: int) -> None:
        """The sum noted by :meth:`_note_accumulation` written over ``old`` (which just died):
        the sum's allocation undone, its storage tracked as ``old``'s block from here on."""
        assert self.events[-1] == sum_sid
        self.events.pop()
        self.nbytes[sum_sid] = 0
        self._refs.pop(old_sid, None)
        storage = self._refs.pop(sum_sid)()
        if storage is None:  # cannot happen: the sum is the engine's buffer now
            self.events.append(~old_sid)
            return
        self._watch(storage, old_sid)

    def sid_of(self, t: torch.Tensor) -> int | None:
        try:
            storage = _fake.local_tensor(t).untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage (sparse, nested)
            return None
        return self._live.get(id(storage))

    def _track(self, t: torch.Tensor, op: str, where: str,
               offloaded: tuple[str, str] | None = None) -> None:
        try:
            storage = _fake.local_tensor(t).untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        self._track_storage(storage, storage.nbytes(), op, where, offloaded)

    def offloaded_inputs(self, args: Any) -> tuple[str, str] | None:
        """What :mod:`memkern._host` is making on this thread; else ``("pageable", what the
        first holds)`` when an op's tensor inputs are all offloaded host memory (its outputs
        are host memory too: ``host_weights.float()``); else None."""
        making = _host.current()
        if making is not None:
            return making
        if not self.host_sids:
            return None
        first = None
        for t in tree_leaves(args):
            if isinstance(t, torch.Tensor):
                sid = self.sid_of(t)
                if sid is None or sid not in self.host_sids:
                    return None
                first = first or self.host_sids[sid]
        return None if first is None else ("pageable", first[1])

    def resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """A storage resized in place (``UntypedStorage.resize_``, no op of its own: FSDP2
        frees its unsharded parameters with ``resize_(0)`` after each use and resizes them back
        for the next all-gather): the old block given back, a block of the new size taken."""
        if id(storage) in self._live:
            self._track_storage(storage, nbytes, "UntypedStorage.resize_",
                                self._modules[-1] if self._modules else "(top)")

    def _track_storage(self, storage: torch.UntypedStorage, nbytes: int, op: str,
                       where: str, offloaded: tuple[str, str] | None = None) -> None:
        key = id(storage)
        sid = self._live.get(key)
        if sid is not None:
            if self.host_sizes.get(sid, self.nbytes[sid]) == nbytes:
                return
            offloaded = self.host_sids.get(sid, offloaded)
            self._free(sid)  # resized in place: a new block, the old one given back
        self._watch(storage, self._new(nbytes, op, where, offloaded))

    def workspace(self, nbytes: int, op: str, where: str, keep: bool = False) -> None:
        sid = self._new(nbytes, op, where)
        if not keep:
            self.events.append(~sid)

    # ---------------------------------------------------------------------------- phases
    def _set_phase(self, phase: str) -> None:
        if phase != self.phase:
            if self.phase == "backward":
                self.assign_roles(grads_only=True)
            self.phase = phase
            self.marks.append((len(self.events), self.step, phase))

    def begin_step(self, step: int) -> None:
        self.assign_roles()
        self.step = step
        self._backward_ran = False
        self.phase = ""
        self._set_phase("forward")

    def assign_roles(self, grads_only: bool = False) -> None:
        """Marks the storages of the roots' parameters, gradients and optimizer state."""
        for model, optimizer in self.roots:
            params = list(model.parameters())
            if not grads_only:
                self._assign(params, "parameters")
            self._assign((p.grad for p in params if p.grad is not None), "gradients")
            if grads_only or optimizer is None:
                continue
            state = list(_state_tensors(optimizer))
            self._assign((t for k, t in state if k in MASTER_KEYS), "master weights")
            self._assign((t for k, t in state if k not in MASTER_KEYS), "optimizer state")

    def _assign(self, tensors: Iterable[torch.Tensor], role: str) -> None:
        for t in tensors:
            sid = self.sid_of(t)
            if sid is not None:
                self.roles.setdefault(sid, role)

    # ---------------------------------------------------------------------------- hooks
    def module_entered(self, module: nn.Module, *args: Any) -> None:
        self._modules.append(self.names.get(id(module), type(module).__name__))

    def module_left(self, module: nn.Module, *args: Any) -> None:
        if self._modules:
            self._modules.pop()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.noted(t)
        return t

    def noted(self, t: torch.Tensor) -> None:
        sid = self.sid_of(t)
        if sid is not None and sid not in self.saved:
            self.saved[sid] = (len(self.events), self._modules[-1] if self._modules else "(top)")

    # ---------------------------------------------------------------------------- ops
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._accumulation = None
        node = _fake.current_autograd_node()
        self._node = None if node is None else _fake.autograd_node_key(node)
        if node is not None:
            self._backward_ran = True
            phase = "backward"
            where = node.name() + (f" > {self._modules[-1]}" if self._modules else "")
        else:
            where = self._modules[-1] if self._modules else "(top)"
            phase = ("setup" if self.step < 0 else "forward" if self._modules
                     or not self._backward_ran else "optimizer")
        self._set_phase(phase)
        op = func.name()
        if func in GEMMS and self.target.gemm_workspace:
            thread = "backward" if node is not None else "main"
            if thread not in self._gemm_threads:
                self._gemm_threads.add(thread)
                self.workspace(self.target.gemm_workspace, f"cuBLAS workspace ({thread} thread)",
                               where, keep=True)
        reference = COMPOSITE_REFERENCES.get(func)
        if reference is not None:  # its ops run here instead, each recorded
            with self:
                return reference(*args, **kwargs)
        offloaded = self.offloaded_inputs((args, kwargs))
        out = func(*args, **kwargs)
        if self.count_flops:  # torch's FLOP formulas (FlopCounterMode's), without its module
            count = flop_registry.get(func._overloadpacket)  # hooks, which change memory
            if count is not None:
                self.flops += count(*args, **kwargs, out_val=out)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, op, where, offloaded)
        for nbytes in self.target.workspaces(func, args, kwargs):
            self.workspace(nbytes, op + " workspace", where)
        if func is torch.ops.aten.add.Tensor and node is not None:
            self._note_accumulation(args, kwargs, out)
        return out


@contextlib.contextmanager
def _storage_resizes_seen(tl: _Timeline) -> Iterator[None]:
    """``torch.UntypedStorage.resize_`` reported to ``tl`` while planning: a storage method,
    which no dispatch mode sees."""
    resize = torch.UntypedStorage.resize_

    def resize_and_report(storage: torch.UntypedStorage, size: int) -> Any:
        out = resize(storage, size)
        tl.resized(storage, storage.nbytes())
        return out

    torch.UntypedStorage.resize_ = resize_and_report
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = resize


# -------------------------------------------------------------------------------- replay


def _replay(tl: _Timeline, tgt: Target) -> tuple[dict, int, int, list, int]:
    """Allocator replay: per (step, phase) the highest allocated and its event index; the run's
    peak; the block size of each storage; the allocated level at each step's first event."""
    allocator = tgt.allocator()
    handles: dict[int, Any] = {}
    block = [0] * len(tl.nbytes)
    best: dict[tuple[int, str], tuple[int, int]] = {}
    step_start: dict[int, int] = {}
    marks = iter(tl.marks)
    next_mark = next(marks, None)
    step, phase = -1, "setup"
    for i, e in enumerate(tl.events):
        while next_mark is not None and next_mark[0] <= i:
            _, step, phase = next_mark
            step_start.setdefault(step, allocator.allocated)
            next_mark = next(marks, None)
        if e >= 0:
            h = allocator.malloc(tl.nbytes[e])
            handles[e] = h
            block[e] = allocator.size_of(h)
            key = (step, phase)
            if key not in best or allocator.allocated > best[key][0]:
                best[key] = (allocator.allocated, i)
        else:
            allocator.free(handles.pop(~e))
    return best, allocator.peak_allocated, allocator.reserved, block, step_start


def _moment(tl: _Timeline, index: int, phase: str, allocated: int, block: list[int],
            step: int) -> Moment:
    alive: set[int] = set()
    for e in tl.events[:index + 1]:
        if e >= 0:
            alive.add(e)
        else:
            alive.discard(~e)
    by_category = dict.fromkeys(CATEGORIES, 0)
    saved_by: dict[str, int] = {}
    by_op: dict[str, dict[str, int]] = {"kept from forward": {}, "transient": {}}
    for sid in alive:
        size = block[sid]
        if not size:
            continue
        role = tl.roles.get(sid)
        if role is None and sid in tl.host_sids:  # the CPU target: host memory is the device's
            role = _DEVICE_CATEGORY[tl.host_sids[sid][1]]
        saved = tl.saved.get(sid)
        created_step, created_phase = tl.created[sid]
        if role is None and saved is not None and saved[0] <= index:
            role = "saved for backward"
            name = collapse_indices(saved[1])
            saved_by[name] = saved_by.get(name, 0) + size
        elif role is None:
            role = ("kept from forward" if created_step == step and created_phase == "forward"
                    and phase != "forward" else "transient")
            key = f"{tl.op[sid]} @ {collapse_indices(tl.where[sid])}"
            by_op[role][key] = by_op[role].get(key, 0) + size
        by_category[role] += size
    event = tl.events[index]
    return Moment(phase, allocated, tl.op[event], tl.where[event], by_category,
                  dict(sorted(saved_by.items(), key=lambda kv: -kv[1])),
                  {k: dict(sorted(v.items(), key=lambda kv: -kv[1])) for k, v in by_op.items()})


def _held(tl: _Timeline) -> dict[str, int]:
    """Storage bytes of each persistent role among the storages alive now."""
    held = dict.fromkeys(CATEGORIES[:4], 0)
    seen: set[int] = set()
    for model, optimizer in tl.roots:
        groups = [("parameters", model.parameters()),
                  ("gradients", (p.grad for p in model.parameters() if p.grad is not None))]
        if optimizer is not None:
            state = list(_state_tensors(optimizer))
            groups += [("master weights", (t for k, t in state if k in MASTER_KEYS)),
                       ("optimizer state", (t for k, t in state if k not in MASTER_KEYS))]
        for role, tensors in groups:
            for t in tensors:
                sid = tl.sid_of(t)
                if sid is not None and sid not in seen:
                    seen.add(sid)
                    held[role] += tl.nbytes[sid]
    return held


_HOLDS_OF_ROLE = {"parameters": "weights", "gradients": "gradients",
                  "master weights": "master weights", "optimizer state": "optimizer state"}
_DEVICE_CATEGORY = {"weights": "parameters", "gradients": "gradients",
                 "master weights": "master weights", "optimizer state": "optimizer state",
                 "state copies": "optimizer state", "activations": "saved for backward"}
"""The device category of a host buffer by what it holds, where host memory is the device's
(the CPU target)."""


def _host_replay(tl: _Timeline) -> tuple[int, dict[str, int], int]:
    """The host timeline through :class:`HostAllocator`: its peak, that moment's bytes by what
    each buffer holds (a role from the optimizer or the model first: a master made by an op
    from the weights' copy is a master), and the pinned blocks then."""
    allocator = HostAllocator()
    handles: dict[int, Any] = {}
    best, best_index = 0, -1
    for i, e in enumerate(tl.host_events):
        if e >= 0:
            handles[e] = allocator.malloc(tl.host_sizes[e], tl.host_sids[e][0])
            if allocator.allocated > best:
                best, best_index = allocator.allocated, i
        else:
            allocator.free(handles.pop(~e))
    if best_index < 0:
        return 0, {}, 0
    replay = HostAllocator()
    alive: dict[int, Any] = {}
    for e in tl.host_events[:best_index + 1]:
        if e >= 0:
            alive[e] = replay.malloc(tl.host_sizes[e], tl.host_sids[e][0])
        else:
            replay.free(alive.pop(~e))
    by_category = dict.fromkeys(_host.HOLDS, 0)
    for sid, (size, _) in alive.items():
        holds = _HOLDS_OF_ROLE.get(tl.roles.get(sid), tl.host_sids[sid][1])
        by_category[holds] += size
    by_category["cached"] = replay.cached
    return best, {k: v for k, v in by_category.items() if v}, replay.pinned


# -------------------------------------------------------------------------------- autocast


class _AutocastOnHost(torch.amp.autocast_mode.autocast):
    """``torch.autocast`` while a step is planned for a GPU on the CPU stand-in: a GPU script's
    ``torch.autocast("cuda", dtype)`` (default dtype float16, as on a GPU) runs as the CPU's
    autocast with that dtype, so its matmuls, their saved inputs and the weights' cached
    low-precision copies are planned in that dtype rather than ignored (CPU-only torch
    disables a CUDA autocast). The CPU's op lists stand in for CUDA's: CUDA keeps softmax,
    layer_norm and the losses in float32, the CPU runs some of them in the low dtype."""

    def __init__(self, device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
                 cache_enabled: bool | None = None) -> None:
        if device_type == "cuda":
            device_type, dtype = "cpu", dtype or torch.float16
        super().__init__(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


@contextlib.contextmanager
def _autocast_on_host(device_type: str):
    """For a CUDA target: ``torch.autocast`` and ``torch.amp.autocast`` are
    :class:`_AutocastOnHost` while the step is planned (the module attributes a script reads
    at call time; restored after)."""
    if device_type != "cuda":
        yield
        return
    saved = torch.autocast, torch.amp.autocast
    torch.autocast = torch.amp.autocast = _AutocastOnHost
    try:
        yield
    finally:
        torch.autocast, torch.amp.autocast = saved


# -------------------------------------------------------------------------------- entry point


def plan_training_step(build: Callable[[], TrainingSetup], *, device: str | Target = "cuda",
                       warmup_steps: int = 1, count_flops: bool = False,
                       world_size: int = 1) -> StepPlan:
    """Plans one training step of the set-up ``build()`` makes, for ``device``.

    ``build`` runs inside the fake mode (create the model, the optimizer and the batch there, on
    the CPU: the stand-in for every target) and returns a :class:`TrainingSetup`. Its ``step``
    runs ``warmup_steps`` times (the optimizer creates its state), then once more: that step is
    measured. ``device``: "cuda" (Hopper), "cuda-sm80" (Ampere), "cpu", or a
    :class:`~memkern.profile.targets.Target`. ``count_flops``: also count the measured step's
    floating-point operations (:attr:`StepPlan.flops`). ``world_size`` > 1: ``build`` and the
    steps run as rank 0 of that many ranks, ``torch.distributed`` initialised with a fake
    process group whose collectives move no data (shard the model or the optimizer over the
    default group in ``build``, as :func:`memkern.profile.hf_workload`'s ``sharding`` does):
    the plan is one rank's (rank 0 holds the largest shards). Returns a :class:`StepPlan`.
    """
    if warmup_steps < 0:
        raise ValueError(f"plan_training_step: warmup_steps={warmup_steps} must be >= 0")
    if world_size < 1:
        raise ValueError(f"plan_training_step: world_size={world_size} must be >= 1")
    tgt = _target(device)
    tl = _Timeline(tgt)
    start = time.perf_counter()
    gc.collect()
    hooks = [nn.modules.module.register_module_forward_pre_hook(tl.module_entered),
             nn.modules.module.register_module_forward_hook(tl.module_left, always_call=True)]
    _saved_notes.observers.append(tl.noted)
    _active.append(tl)
    try:
        with contextlib.ExitStack() as stack:
            if world_size > 1:
                stack.enter_context(_fake.fake_process_group(world_size))
            stack.enter_context(_fake.fake_mode())
            stack.enter_context(backend.planning_for(tgt.device_type))
            stack.enter_context(_autocast_on_host(tgt.device_type))
            stack.enter_context(tl)
            stack.enter_context(_storage_resizes_seen(tl))
            setup = build()
            if not isinstance(setup, TrainingSetup):
                raise TypeError("plan_training_step: build() must return a TrainingSetup, got "
                                f"{type(setup).__name__}")
            tl.roots.append((setup.model, setup.optimizer))
            tl.names = {id(m): n or type(setup.model).__name__
                        for n, m in setup.model.named_modules()}
            held: dict[str, int] = {}
            flops = None
            with torch.autograd.graph.saved_tensors_hooks(tl.pack, lambda t: t):
                for step in range(warmup_steps + 1):
                    gc.collect()
                    tl.begin_step(step)
                    last = step == warmup_steps
                    if last:
                        held = _held(tl)
                    tl.count_flops = last and count_flops
                    setup.step()
                    tl.assign_roles()
                    if tl.count_flops:
                        flops = tl.flops
            description = setup.description
            tl.closed = True
            del setup
    finally:
        _active.remove(tl)
        _saved_notes.observers.remove(tl.noted)
        for h in hooks:
            h.remove()
    best, run_peak, reserved, block, step_start = _replay(tl, tgt)
    measured = warmup_steps
    phase_peaks = {}
    for phase in PHASES:
        if (measured, phase) in best:
            allocated, index = best[(measured, phase)]
            phase_peaks[phase] = _moment(tl, index, phase, allocated, block, measured)
    if not phase_peaks:
        raise RuntimeError("plan_training_step: the step ran no op (nothing to measure)")
    peak = max(phase_peaks.values(), key=lambda m: m.allocated)
    host_peak, host_by_category, host_pinned = _host_replay(tl)
    return StepPlan(str(device if isinstance(device, str) else device.name), description, peak,
                    phase_peaks, run_peak, step_start.get(measured, 0), held, reserved,
                    time.perf_counter() - start, flops, host_peak, host_by_category,
                    host_pinned)
