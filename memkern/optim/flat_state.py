"""The flat-state base of memkern's optimizers: parameters, gradients and optimizer state of a
param group live in contiguous flat tensors, so one kernel call updates a whole group.

Where things live (all on the parameters' device; :mod:`memkern.optim.zero` says what
changes across ranks, :mod:`memkern.optim.offload` with ``offload="cpu"``):

============================  ===============================================================
``grad_buffer``               a :class:`~memkern.GradBuffer` over all parameters, laid out
                              param group by param group; ``p.grad`` are views into it.
model weights                 moved into the same layout (``GradBuffer.flat_params``): every
                              ``p`` is a view of one flat tensor per dtype.
``Segment``                   what one kernel call updates: the parameters of one param group
                              and one dtype, a contiguous slice of the flat gradients and
                              weights (sharded: a rank's slice of one bucket of them).
``state[p]["master_param"]``  float32 master weights of bfloat16/float16 parameters (a view
                              into the segment's flat float32 master). For float32 parameters
                              the weights themselves are the master and there is no such key.
``state[p][<algorithm key>]`` float32 views into the segment's flat state (``exp_avg``,
                              ``exp_avg_sq`` for AdamW; ``momentum_buffer`` for SGD).
``state[p]["step"]``          the segment's step counter: a one-element float32 device tensor
                              shared by the segment's parameters.
============================  ===============================================================

Bytes per parameter with AdamW: 2 + 2 for bfloat16/float16 weights and gradients plus 12 for
the float32 master, ``exp_avg`` and ``exp_avg_sq`` (16; docs/memory.md's 4 + 12/W for one
process); float32 weights: 4 + 4 + 8.

``state_dict()`` has ``torch.optim``'s format (per-parameter state, ``step`` as a CPU tensor),
so a state dict moves between memkern and torch optimizers of the same algorithm.

Differences from ``torch.optim`` that come with flat buffers: a parameter whose gradient is
None (unused in the forward) is stepped with a zero gradient instead of being skipped
(weight decay and momentum still apply); ``zero_grad`` zeroes instead of setting None; and
parameter groups cannot be added after construction. Weights written into the model through
its parameters after construction (``model.load_state_dict``) become the masters at the next
step where they differ from the masters' rounding (:meth:`FlatOptimizer._take_as_masters`).
"""
from __future__ import annotations

import contextlib
import copy
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DeviceMesh

from memkern import _fake
from memkern.optim import dtensor_params, state_precision
from memkern.optim.grad_buffer import GradBuffer, check_params
from memkern.optim.grad_placement import GradPlacement
from memkern.optim.replaced_params import ReplacementWatch
from memkern.optim.segment import Segment


def _weight_address(p: torch.Tensor) -> int | None:
    """Where ``p``'s weights live (its data pointer); None for a fake or meta tensor, which has
    no storage to compare (the planner's optimizers: their parameters are never replaced)."""
    return None if _fake.is_fake(p) else p.data_ptr()


def _write_count(p: torch.Tensor) -> int:
    """How many in-place writes went through ``p``: torch's version counter (``Tensor._version``,
    what autograd checks saved tensors against), which has no public accessor."""
    return p._version


class Algorithm(Protocol):
    """Hyper-parameters, state and kernel call of one update rule (see fused_adamw, fused_sgd)."""

    defaults: Callable[..., dict[str, Any]]
    """Validates the constructor's hyper-parameters and returns the param-group defaults."""

    @staticmethod
    def state_keys(group: dict[str, Any]) -> tuple[str, ...]:
        """The zero-initialised flat float32 state a segment of ``group`` needs."""

    @staticmethod
    def quantized(p: torch.Tensor, group: dict[str, Any]) -> bool:
        """Whether ``p``'s state is kept in 8 bits (``group``: its param group's options)."""

    @staticmethod
    def zero_quantized_state(weights: torch.Tensor,
                             group: dict[str, Any]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The zero 8-bit state (name -> ``(codes, absmax)``) of a quantized segment of
        ``group``."""

    @staticmethod
    def update(seg: Segment, group: dict[str, Any], grad_multiplier: torch.Tensor | None,
               found_inf: torch.Tensor | None) -> None:
        """One kernel call updating ``seg``."""


def as_param_groups(params: Any) -> list[dict[str, Any]]:
    """``params`` (tensors, (name, tensor) pairs or param-group dicts) as param-group dicts
    whose "params" are lists, so that the parameters can be laid out before torch sees them."""
    if isinstance(params, torch.Tensor):
        raise TypeError("memkern: params must be an iterable of tensors or of param-group dicts, "
                        "got a single tensor; wrap it in a list")
    items = list(params)
    if items and isinstance(items[0], dict):
        groups = [dict(g) for g in items]
    else:
        groups = [{"params": items}]
    for group in groups:
        ps = group["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        if ps and isinstance(ps[0], tuple):  # model.named_parameters()
            group["param_names"] = [name for name, _ in ps]
            ps = [p for _, p in ps]
        group["params"] = ps
    return groups


class FlatOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose update runs as one fused kernel per segment.

    Subclasses give their :class:`Algorithm` and where the gradients live (a
    :class:`~memkern.optim.grad_placement.GradPlacement`: the flat buffer's layout and its
    segments). ``grad_dtype`` is the gradient buffer's dtype (None: each parameter's own).
    Construction moves the parameters into flat storage and makes their ``.grad`` views of
    ``grad_buffer`` (see the module docstring); the optimizer state (float32 masters, moments,
    step counters) is created at the first step or load.

    What checkpoints read and write (through :class:`~memkern.optim.state_io.StateIO`) is the
    state store's public interface: :attr:`state_ready`, :meth:`init_state`,
    :meth:`check_param_groups`, :meth:`adopt_param_groups`, :meth:`set_steps`.
    """

    # torch.amp.GradScaler.step hands such an optimizer `grad_scale` and `found_inf` instead of
    # unscaling and reading found_inf on the host; the kernel takes both.
    _step_supports_amp_scaling = True

    def __init__(self, params: Any, defaults: dict[str, Any], *, algorithm: Algorithm,
                 grad_placement: GradPlacement, grad_dtype: torch.dtype | None = None) -> None:
        groups = as_param_groups(params)
        self.algorithm = algorithm
        self._grads = grad_placement
        self._mesh = dtensor_params.dtensor_mesh(groups, type(self).__name__)
        # Parameters whose moments are stored in 8 bits: decided before the layout, which
        # keeps them in runs of their own (one kernel call each).
        self._quantized_ids = {id(p) for g in groups for p in g["params"]
                               if algorithm.quantized(p, {**defaults, **g})}
        self._float_state_depth = 0
        if self._mesh is None:
            self.grad_buffer: GradBuffer | None = grad_placement.make_grad_buffer(
                groups, grad_dtype, self._quantized_ids)
        else:
            if grad_dtype is not None:
                raise ValueError(
                    f"memkern.{type(self).__name__}: grad_dtype={grad_dtype} sets the flat "
                    "gradient buffer's dtype, and DTensor parameters have none (their gradients "
                    "come from FSDP2 in its reduce_dtype); leave grad_dtype=None")
            check_params(p for g in groups for p in g["params"])
            self.grad_buffer = None
        super().__init__(groups, defaults)
        self._built_param_ids = frozenset(id(p) for g in self.param_groups for p in g["params"])
        if self.grad_buffer is not None:
            # Gradients kept on the host are for models that fill the device: their weights
            # are flattened through host memory, never held twice on the device.
            self.grad_buffer.flat_params(through_host=grad_placement.on_host)
            # Where each parameter's weights live in the flat layout: checked at every step.
            self._weight_ptrs = [_weight_address(p) for p in self.grad_buffer.params]
            self._replacements = ReplacementWatch(self.grad_buffer.params)
            # Each parameter's count of in-place writes through it, as of the last check.
            self._writes = [_write_count(p) for p in self.grad_buffer.params]
        self._segments: list[Segment] = self._make_segments()
        self._state_ready = False

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The device mesh of DTensor parameters (stepped shard by shard, see
        :mod:`memkern.optim.dtensor_params`); None for plain parameters."""
        return self._mesh

    @property
    def segments(self) -> tuple[Segment, ...]:
        """The kernel-call units and their flat state, read-only (memory accounting, tools)."""
        return tuple(self._segments)

    @property
    def state_ready(self) -> bool:
        """Whether the optimizer state exists (from the first step or load on)."""
        return self._state_ready

    def _make_segments(self) -> list[Segment]:
        """The segments of the gradients' part (:mod:`memkern.optim.grad_placement`); for
        DTensor parameters, one per parameter: its local shard."""
        if self._mesh is not None:
            return [Segment(gi, torch.empty(0), dtensor_params.local_flat(p, "a parameter"),
                            [p], [0], quantized=id(p) in self._quantized_ids, dtensor=True)
                    for gi, g in enumerate(self.param_groups) for p in g["params"]]
        return self._grads.make_segments(self.grad_buffer)

    def _check_params_as_built(self, where: str) -> None:
        """A RuntimeError when a parameter stopped requiring grad, its storage was replaced or
        the parameter itself was replaced in its module since construction: the step would
        move a frozen parameter (weight decay, momentum), update a flat buffer the model no
        longer reads, or step a parameter the model no longer uses."""
        replaced = self._replacements.replaced()
        if replaced is not None:
            raise RuntimeError(
                f"{where}: {replaced}: the optimizer would step the old "
                "parameter, which the model no longer uses, and never the new one, so no step "
                "was taken. Change the model before building the optimizer")
        params, built = self.grad_buffer.params, self._weight_ptrs
        # (the common case, in ~0.1 us a parameter: no message built, and torch's is_fake,
        # ~14 us a tensor, only for the parameters that were fake when built)
        if all(p.requires_grad for p in params) and built == [
                None if ptr is None else p.data_ptr() for p, ptr in zip(params, built)]:
            return
        for i, (p, ptr) in enumerate(zip(params, self._weight_ptrs)):
            what = (f"a parameter of shape {tuple(p.shape)} ({p.dtype}, number {i} in the flat "
                    "layout)")
            if not p.requires_grad:
                raise RuntimeError(
                    f"{where}: {what} no longer requires grad; memkern steps every parameter it "
                    "was built with (a frozen one would still move by weight decay and "
                    "momentum), so no step was taken. Build the optimizer with the trainable "
                    "parameters only, or set the param group's lr and weight_decay to 0")
            if _weight_address(p) != ptr:
                raise RuntimeError(
                    f"{where}: the storage of {what} was replaced after the optimizer was built "
                    "(model.to(), .cuda(), .half(), p.data = ...): the optimizer updates the "
                    "flat buffer the model no longer reads, so no step was taken. Move or cast "
                    "the model before building the optimizer")

    def _written_params(self) -> list[torch.Tensor]:
        """The parameters written into through themselves since the last call
        (``model.load_state_dict``, ``p.copy_``, ``torch.nn.init``: their write count moved;
        the optimizer's own writes go to the flat buffers, not through the parameters): one
        counter read per parameter. A write through ``p.data`` is not counted."""
        params = self.grad_buffer.params
        writes = [_write_count(p) for p in params]
        if writes == self._writes:
            return []
        written = [p for p, now, then in zip(params, writes, self._writes) if now != then]
        self._writes = writes
        return written

    @torch.no_grad()
    def _take_as_masters(self, written: list[torch.Tensor]) -> None:
        """Weights written into the model since the optimizer last wrote them are not lost:
        where a written parameter's weights differ from what the optimizer would write (its
        float32 master rounded to the weights' dtype), they become the master; so does any
        copy of the weights the step writes (:attr:`Segment.weights` on the host). Masters
        the written values agree with stay as they are: loading the model's weights saved
        with the optimizer's state, before or after loading that state, changes nothing. On
        each rank, for the slices of the parameter it owns. (Before the first step or load
        the masters are made from the weights anyway.)"""
        if not written or not self._state_ready:
            return
        for p in written:
            seg = self._grads.unit_of(p).segment
            values = p.detach().reshape(-1)
            for target in dict.fromkeys([seg.master, seg.weights]):  # one for float32 weights
                piece = self._grads.owned_piece(p, target)
                if piece is None:
                    continue
                view, start = piece
                mine = values[start:start + view.numel()]
                if view.dtype == mine.dtype:
                    view.copy_(mine)
                else:  # a float32 master of 16-bit weights: only where it no longer rounds to them
                    changed = (mine != view.to(mine.dtype)).to(view.device)
                    view[changed] = mine.to(view.device)[changed].float()

    def _check_groups_as_built(self, where: str) -> None:
        """A RuntimeError when the param groups hold a tensor the optimizer was not built with:
        the step updates the parameters of its flat layout, not the tensors swapped in."""
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in self._built_param_ids:
                    raise RuntimeError(
                        f"{where}: param_groups hold a {type(p).__name__} of shape "
                        f"{tuple(p.shape)} the optimizer was not built with (swapped in after "
                        "construction, as accelerate's FSDP2 preparation swaps in the "
                        "fully_shard-ed parameters): the step would update the parameters it "
                        "was built with, so no step was taken. Build the optimizer on the "
                        "parameters it is to step (after fully_shard)")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_segments", None) is not None:
            raise NotImplementedError(
                f"memkern.{type(self).__name__}.add_param_group: the flat layout is fixed at "
                "construction; pass every param group to the constructor"
            )
        super().add_param_group(param_group)

    # -------------------------------------------------------------------------------- state
    def init_state(self) -> None:
        """(Re)creates all optimizer state: masters from the current weights, zero moments."""
        self._refresh_local_shards()
        self.state = defaultdict(dict)
        for seg in self._segments:
            group = self.param_groups[seg.group]
            seg.param_states = [self.state[p] for p in seg.params]
            seg.state = {}
            with self._allocating("optimizer state"):
                seg.step = seg.weights.new_zeros((), dtype=torch.float32)  # where the weights are
            for state in seg.param_states:
                state["step"] = seg.step
            if seg.low_precision:
                with self._allocating("master weights"):
                    seg.add_state("master_param", seg.weights.float())
            with self._allocating("optimizer state"):
                state_precision.make_moments(seg, self.algorithm, group)
        self._state_ready = True
        if self._float_state_depth:
            state_precision.show_as_float32(self._segments)

    def _allocating(self, holds: str) -> contextlib.AbstractContextManager:
        """The context the state holding ``holds`` (:data:`memkern._host.HOLDS`) is made in:
        on the weights' device here (the sharded front end may step on the host)."""
        return contextlib.nullcontext()

    def _refresh_local_shards(self) -> None:
        """Points DTensor parameters' segments at their current local shards: FSDP2 may
        reallocate a shard after the optimizer was built (its lazy initialisation pads uneven
        shards at the first forward)."""
        for seg in self._segments:
            if seg.dtensor:
                seg.weights = dtensor_params.local_flat(seg.params[0], "a parameter")

    @contextlib.contextmanager
    def _float_state(self, write_back: bool):
        """Within it, 8-bit moments are float32 state like the others (``state``, the
        per-parameter views): what checkpoints read and write. On leaving the outermost one
        they are dropped, after being quantized back into the 8-bit state when
        ``write_back`` (a load). Requantizing values read from the codes gives the same codes,
        so saving and loading is exact. Holds float32 copies of the moments meanwhile."""
        self._float_state_depth += 1
        if self._float_state_depth == 1 and self._state_ready:
            state_precision.show_as_float32(self._segments)
        try:
            yield
        finally:
            self._float_state_depth -= 1
            if self._float_state_depth == 0:
                state_precision.hide_float32(self._segments, write_back)

    # --------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *,
             grad_multiplier: torch.Tensor | None = None,
             found_inf: torch.Tensor | None = None) -> Any:
        """One update of every parameter: one kernel call per segment.

        Args:
            closure: re-evaluates the model and returns the loss (as in torch.optim).
            grad_multiplier: optional one-element float32 device tensor every gradient is
                multiplied by inside the kernel (e.g. ``LossScaler.inv_scale(device)``).
            found_inf: optional one-element float32 device tensor; non-zero skips the step
                bit-identically (e.g. what ``LossScaler.unscale_`` returned).
        Under ``torch.amp.GradScaler.step(optimizer)`` both come from the scaler, with no host
        sync and no separate unscale pass.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)  # set by torch.amp.GradScaler.step
        if grad_scale is not None:
            inv_scale = grad_scale.double().reciprocal().float()
            grad_multiplier = inv_scale if grad_multiplier is None else grad_multiplier * inv_scale
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        if self._mesh is None:
            self._check_groups_as_built(f"memkern.{type(self).__name__}.step")
            self._check_params_as_built(f"memkern.{type(self).__name__}.step")
            self._take_as_masters(self._written_params())
            self.grad_buffer.claim_grads()
            self._apply_update(grad_multiplier, found_inf)
        else:
            self._step_local_shards(grad_multiplier, found_inf)
        return loss

    def _step_local_shards(self, grad_multiplier: torch.Tensor | None,
                           found_inf: torch.Tensor | None) -> None:
        """The step of DTensor parameters: the ranks agree on ``found_inf``, then each
        parameter with a gradient is updated on its local shard (one without is skipped, as
        torch.optim skips it)."""
        if found_inf is not None:
            dtensor_params.agree_on_found_inf(found_inf, self._mesh)
        if not self._state_ready:
            self.init_state()
        self._refresh_local_shards()
        for seg in self._segments:
            grads = dtensor_params.local_grad(seg.params[0])
            if grads is not None:
                seg.grads = grads
                self.algorithm.update(seg, self.param_groups[seg.group], grad_multiplier,
                                      found_inf)

    def _apply_update(self, grad_multiplier: torch.Tensor | None,
                      found_inf: torch.Tensor | None) -> None:
        """The update phase: one kernel call per segment, gradients already in the buffer."""
        if not self._state_ready:
            self.init_state()
        for seg in self._segments:
            self.algorithm.update(seg, self.param_groups[seg.group], grad_multiplier, found_inf)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the flat gradient buffer (one fill per dtype).

        ``set_to_none`` is accepted for compatibility and ignored: the gradients stay views of
        the buffer (a None ``.grad`` would make the next backward allocate outside it). DTensor
        parameters have no flat buffer: their gradients are set to None (or zeroed), as
        ``torch.optim`` does.
        """
        if self._mesh is not None:
            super().zero_grad(set_to_none)
            return
        self.grad_buffer.zero_()

    # -------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``torch.optim`` format. Tensors are views of the live flat state (``torch.save`` them
        or copy), except ``step``, a fresh per-parameter CPU tensor as torch keeps it. With
        DTensor parameters they are DTensors like their parameters, and an optimizer that has
        not stepped yet gives its initial state (zero moments, step 0): that is what
        ``torch.distributed.checkpoint.load`` loads into, in place."""
        if self._mesh is not None and not self._state_ready:
            self.init_state()
        with self._float_state(write_back=False):
            state_dict = super().state_dict()
            # New per-parameter dicts: torch's are the live ones, which lose the float32
            # moments of 8-bit state when the context ends.
            state_dict["state"] = {
                index: {k: (v.detach().to("cpu", copy=True) if k == "step" else v)
                        for k, v in param_state.items()}
                for index, param_state in state_dict["state"].items()
            }
        self._mark_state_precision(state_dict["state"])
        return state_dict

    def _mark_state_precision(self, states: dict[int, dict[str, Any]]) -> None:
        """Says, per parameter index of an 8-bit param group, whether its moments were
        stored in ``"8bit"`` or ``"32bit"`` (below the size threshold)."""
        placed = [(p, g) for g in self.param_groups for p in g["params"]]
        for index, state in states.items():
            p, group = placed[index]
            if group.get("state_precision", "32bit") != "32bit":
                state["state_precision"] = self._state_precision_of(p)

    def _state_precision_of(self, p: torch.Tensor) -> str:
        return "8bit" if id(p) in self._quantized_ids else "32bit"

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of this class or of the torch optimizer of the same algorithm.

        Values are copied into the flat state (cast to float32). A bfloat16/float16 parameter
        without a saved ``master_param`` gets its master from its current weights, so load the
        model's weights first. One step counter serves each param group and dtype: differing
        saved steps within one are replaced by their maximum, with a warning.
        """
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        name = f"memkern.{type(self).__name__}.load_state_dict"
        id_map = self.adopt_param_groups(state_dict["param_groups"], name)
        with self._float_state(write_back=True):
            self.init_state()  # with the loaded hyper-parameters (e.g. SGD momentum on or off)
            self._load_param_states(state_dict["state"], id_map, name)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def check_param_groups(self, saved_groups: list[dict[str, Any]], name: str,
                            source: str) -> None:
        """Raises ValueError (its message starting with ``name: source``) if saved param
        groups cannot be loaded into this optimizer: other sizes or state precisions."""
        saved_sizes = [len(g["params"]) for g in saved_groups]
        sizes = [len(g["params"]) for g in self.param_groups]
        if saved_sizes != sizes:
            raise ValueError(
                f"{name}: {source}has param groups of sizes {saved_sizes}, this optimizer "
                f"{sizes}; it was saved for another model or another param-group split"
            )
        for i, (sg, g) in enumerate(zip(saved_groups, self.param_groups)):
            saved_precision = sg.get("state_precision", "32bit")
            precision = g.get("state_precision", "32bit")
            if saved_precision != precision:
                raise ValueError(
                    f"{name}: {source}param group {i} was saved with state_precision="
                    f"{saved_precision!r} but this optimizer has state_precision={precision!r};"
                    f" build the optimizer with state_precision={saved_precision!r} to load it"
                )

    def adopt_param_groups(self, saved_groups: list[dict[str, Any]],
                            name: str) -> dict[Any, torch.Tensor]:
        """Takes the saved param groups' hyper-parameters; returns saved id -> parameter."""
        self.check_param_groups(saved_groups, name, "state_dict ")
        saved_groups = copy.deepcopy(saved_groups)
        id_map = {
            saved: p
            for sg, g in zip(saved_groups, self.param_groups)
            for saved, p in zip(sg["params"], g["params"])
        }
        for sg, g in zip(saved_groups, self.param_groups):
            sg["params"] = g["params"]
            if "param_names" in g and "param_names" not in sg:
                sg["param_names"] = g["param_names"]
        self.param_groups = saved_groups
        return id_map

    def _state_pieces(self, p: torch.Tensor, key: str) -> list[tuple[torch.Tensor, int]] | None:
        """Where this process keeps state ``key`` of parameter ``p``: ``(flat, start)`` pairs,
        each holding ``p``'s flattened elements ``[start, start + flat.numel())``; None when
        the optimizer has no such state for ``p``. Here: the whole per-parameter view (the
        model's own weights for the "master" of a float32 parameter)."""
        if key == "master_param" and p.dtype == torch.float32:
            return [(dtensor_params.local_flat(p.detach(), "a parameter"), 0)]
        state = self.state[p].get(key)
        return None if state is None else [(dtensor_params.local_flat(state, key), 0)]

    # A DTensor's state is written through a view that to_local(), an autograd Function, made:
    # autograd forbids copying into it in place while grad mode is on.
    @torch.no_grad()
    def _load_param_states(self, saved_state: dict[Any, dict[str, Any]],
                           id_map: dict[Any, torch.Tensor], name: str) -> None:
        """Copies per-parameter saved state into the flat state (wherever
        :meth:`_state_pieces` says it lives) and sets the step counters."""
        steps = {}
        for saved_id, p in id_map.items():
            saved = saved_state.get(saved_id, {})
            for key, value in saved.items():
                if key == "state_precision" and value != self._state_precision_of(p):
                    raise ValueError(
                        f"{name}: parameter {saved_id} was saved with {value} state, this "
                        f"optimizer keeps it in {self._state_precision_of(p)} (another size "
                        "threshold or another model?); load it into an optimizer built as the "
                        "saved one was"
                    )
                if key in ("step", "state_precision"):
                    continue
                if value is None:  # torch.optim.SGD's momentum_buffer before its first step
                    continue
                pieces = self._state_pieces(p, key) if isinstance(value, torch.Tensor) else None
                if pieces is None:
                    raise ValueError(
                        f"{name}: saved state {key!r} of parameter {saved_id} is not used by "
                        f"{type(self).__name__} (saved by another algorithm or option, e.g. "
                        "amsgrad?)"
                    )
                if value.shape != p.shape:
                    raise ValueError(
                        f"{name}: saved state {key!r} of parameter {saved_id} has shape "
                        f"{tuple(value.shape)}, the parameter {tuple(p.shape)}"
                    )
                flat = (dtensor_params.local_values(value, p) if self._mesh is not None
                        else value.reshape(-1))
                for target, start in pieces:
                    target.copy_(flat[start:start + target.numel()])
            if "step" in saved:
                steps[id(p)] = float(saved["step"])
            else:  # torch.optim.SGD keeps no step: a momentum buffer means it has stepped
                steps[id(p)] = float(any(isinstance(v, torch.Tensor) for v in saved.values()))
        self.set_steps(steps, name)

    def set_steps(self, steps: dict[int, float], name: str) -> None:
        """Sets the step counters from saved per-parameter steps (``id(p)`` -> step): the
        largest of each param group and dtype, with a warning where they differ."""
        per_segment: dict[tuple[int, torch.dtype], list[float]] = defaultdict(list)
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                per_segment[gi, p.dtype].append(steps[id(p)])
        for (group, _), values in per_segment.items():
            if len(set(values)) > 1:
                warnings.warn(
                    f"{name}: parameters of param group {group} were saved at different step "
                    f"counts {sorted(set(values))}; memkern keeps one counter per param group and "
                    f"dtype and uses the largest ({max(values):g})",
                    RuntimeWarning,
                    stacklevel=4,
                )
        for seg in self._segments:
            seg.step.fill_(max(per_segment[seg.group, seg.weights.dtype]))
