"""``ShardedOptimizer``: the training front end over the flat buffers.

It owns the flat gradient buffer, loss scaling, gradient accumulation, the normalisation of the
window's gradient, clipping and the fused optimizer step::

    opt = mk.optim.ShardedOptimizer(model.parameters(), "adamw", lr=3e-4,
                                    accumulation_steps=4, loss_scale="dynamic", max_grad_norm=1.0)
    for batch in loader:
        opt.backward(model(batch).loss)       # or backward(loss_sum, num_items=n_tokens)
        opt.step()                            # False until the 4th micro-batch
        opt.zero_grad()                       # does nothing while the window is open

One step (one closed accumulation window) is, on the device and without a host sync:

1. one read-only pass per flat gradient buffer: ``memkern.ops.l2_norm``. The norm of the
   scaled, summed gradients being non-finite *is* the inf check (no separate pass);
2. a few one-element ops: ``found_inf``, the true norm ``norm / (scale · normaliser)`` and
   ``grad_multiplier = 1 / (scale · normaliser) · clip_coef`` with torch's
   ``clip_coef = min(1, max_grad_norm / (true_norm + 1e-6))``;
3. one ``adamw_step_``/``sgd_step_`` kernel per param group and dtype: it multiplies each
   gradient by ``grad_multiplier``, skips everything when ``found_inf`` is set, and writes
   16-bit weights back from the float32 masters in the same pass;
4. the loss scaler's update (device ops).

The normaliser is the number of micro-batches in the window (each ``backward(loss)`` adds
that micro-batch's gradient; the window's gradient is their mean, as one large batch with a
mean loss), or the window's total ``num_items`` when ``backward(loss_sum, num_items=n)`` was
used (the token-level mean). It is applied in step 2's multiply, never as a separate pass.

A window whose gradients hold an inf/NaN is skipped (parameters, masters and optimizer state
bit-identical, step counters not advanced) and counted in :attr:`ShardedOptimizer.skipped_steps`,
with every ``loss_scale`` setting; ``loss_scale=None`` only means that the loss is not scaled.
Skips that keep coming while the scale cannot go lower (None, a static scale, or a dynamic
one at ``min_scale``) are reported by the :class:`~memkern.LossScaler`: a warning with the
count of consecutive skipped steps, or an error with ``on_min_scale_overflow="raise"``.

Across W processes (:mod:`memkern.optim.zero` has the layout, what lives where and the
collectives): each rank owns 1/W of every flat buffer, and holds float32 masters and
optimizer state for that part only. A step is then

0. the reduction of the window's gradients: stage 1 reduce-scatters the flat buffer here,
   bucket by bucket; stage 2 has already reduce-scattered them during backward;
1. each rank's norm of its own reduced gradients, then ONE all-reduce of the float64 pair
   ``[squared norm of my shard, my num_items]``: the sum is the global squared norm and the
   window's item count. The inf check is part of it: the global squared norm is non-finite
   exactly when some rank's shard holds an inf/NaN (squares are >= 0 and cannot overflow
   float64, and every reduced gradient element is on exactly one rank), so an overflow on
   any single rank makes every rank skip. No host sync: the sum stays on the device;
2-3. as above, on the rank's own slices (one kernel call per bucket);
4. all-gather of the updated weights, bucket by bucket;
5. the loss scaler's update, identical on every rank.

Without ``num_items`` the normaliser is the number of micro-batch gradients summed, i.e.
micro-batches x W: the mean over micro-batches and ranks, as one large batch split evenly.

``offload="cpu"`` moves the masters, the optimizer state and the step counters to host memory
and runs phase 3 with the C++ CPU kernel (:mod:`memkern.optim.offload`), in one process or many.
In one process phase 3 starts during the window's last backward pass, bucket by bucket as
their gradients become final, and the window's end only settles it (kept, undone on an
overflow, redone when clipped): the same bits as phase 3 run after phase 2.

``gradients="host"`` keeps no gradient buffer on the device: each bucket's gradients are
reduced during backward (across ranks) and streamed to host memory, where the window sums
them, and phase 3 runs on the host as with offload (:mod:`memkern.optim.streamed_grads`).

Where each part lives: this module is the window's end above, its CUDA-graph capture and the
public API, composed of parts (docs/architecture.md): where the gradients live
(:mod:`memkern.optim.grad_placement`: :class:`~memkern.optim.local_grads.LocalGrads` in one
process, :class:`~memkern.optim.zero.Shards` for ZeRO-1/2 and with the step on the host,
:class:`~memkern.optim.streamed_grads.StreamedGrads`; each also phase 1's norm and the
collectives), where phase 3 runs (:mod:`memkern.optim.step_placement`: on the device, or
:class:`~memkern.optim.offload.HostStep`), :mod:`memkern.optim.state_precision`,
:mod:`memkern.optim.window` (the accumulation window's bookkeeping),
:mod:`memkern.optim.scaling` (loss scaling and clipping: phase 2),
:mod:`memkern.optim.state_io` (what state dicts and checkpoints read and write, through the
parts) and :mod:`memkern.optim.checkpoint` (the sharded checkpoint format).
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import math
import os
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from memkern.optim import checkpoint
from memkern.optim.flat_state import FlatOptimizer, as_param_groups
from memkern.optim.fused_adamw import AdamW
from memkern.optim.fused_sgd import SGD
from memkern.optim.grad_placement import GradPlacement
from memkern.optim.local_grads import LocalGrads
from memkern.optim.offload import HostStep, OverlappedHostStep
from memkern.optim.process_group import WeakGroup
from memkern.optim.scaling import grad_multiplier, loss_scaler_for, unclipped_multiplier
from memkern.optim.segment import Segment
from memkern.optim.state_io import StateIO
from memkern.optim.step_placement import DeviceStep
from memkern.optim.streamed_grads import StreamedGrads
from memkern.optim.window import AccumulationWindow
from memkern.optim.zero import Shards, _weak_hook

ALGORITHMS = {"adamw": AdamW, "sgd": SGD}
GRADIENTS = ("device", "host")
"""Where the window's gradients live: the ``gradients`` options of ``ShardedOptimizer``."""


def _grad_placement(gradients: str, offload: str | None, group: Any, rank: int, world: int,
                    zero_stage: int, bucket_size_mb: float) -> GradPlacement:
    """The part that holds the gradients (:mod:`memkern.optim.grad_placement`): streamed to
    the host; one process's whole device buffer; or ZeRO's units across ranks (and in one
    process when the step runs on the host, which steps unit by unit during backward)."""
    if gradients == "host":
        return StreamedGrads(group, rank, world, bucket_size_mb)
    if world == 1 and offload is None:
        return LocalGrads()
    return Shards(group, rank, world, zero_stage, bucket_size_mb)


def _refuse_dtensors(groups: list[dict[str, Any]], name: str) -> None:
    """A ValueError for DTensor parameters: FSDP2 (or tensor parallelism) already shards them
    and reduces their gradients, and this optimizer's ZeRO-1/2 would do both again over a flat
    buffer of its own (docs/distributed.md, "ShardedOptimizer or FSDP2")."""
    params = [p for g in groups for p in g["params"]]
    index = next((i for i, p in enumerate(params) if isinstance(p, DTensor)), None)
    if index is not None:
        raise ValueError(
            f"{name}: params[{index}] is a DTensor (FSDP2's fully_shard or tensor parallelism), "
            "which already shards parameters and reduces gradients; step them with "
            "memkern.optim.FusedAdamW or FusedSGD (state_precision='8bit' for 8-bit state), "
            "clip with torch.nn.utils.clip_grad_norm_ and scale with FSDP's ShardedGradScaler "
            "(docs/distributed.md)")


def _group_and_rank(process_group: Any) -> tuple[Any, int, int]:
    """``(group, rank, world size)``; group None for one process without torch.distributed."""
    dist = torch.distributed
    initialised = dist.is_available() and dist.is_initialized()
    if process_group is None:
        if not initialised:
            return None, 0, 1
        return dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    if not initialised:
        raise ValueError(
            "memkern.ShardedOptimizer: process_group was given but torch.distributed is not "
            "initialised; call torch.distributed.init_process_group() first (e.g. under "
            "torchrun), or pass process_group=None for one process"
        )
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            "memkern.ShardedOptimizer: process_group must be a torch.distributed.ProcessGroup "
            f"(e.g. from torch.distributed.new_group) or None, got {type(process_group).__name__}"
        )
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError("memkern.ShardedOptimizer: this process is not a member of "
                         "process_group; build the optimizer on the group's ranks only")
    return process_group, rank, process_group.size()


class ShardedOptimizer(FlatOptimizer):
    """The training front end: flat gradients, accumulation, loss scaling, clipping and the
    fused AdamW/SGD step (see the module docstring for the step's anatomy).

    Args:
        params: tensors, ``(name, tensor)`` pairs or param-group dicts, as for torch
            optimizers; float32/bfloat16/float16 on one device. 16-bit parameters get float32
            master weights (``state[p]["master_param"]``).
        optimizer: ``"adamw"`` or ``"sgd"``.
        lr, **hyperparams: the algorithm's hyper-parameters (those of
            :class:`~memkern.optim.FusedAdamW` / :class:`~memkern.optim.FusedSGD`).
        grad_dtype: dtype of the flat gradient buffer; None keeps each parameter's dtype
            (then every ``p.grad`` is a view of the buffer).
        zero_stage: 1 (master weights and optimizer state sharded across ranks) or 2
            (gradients too); the same thing in one process. See :mod:`memkern.optim.zero`.
        process_group: None: the default group when ``torch.distributed`` is initialised,
            else one process. Every rank of the group builds the optimizer with the same
            parameters (shapes, order, param groups) and arguments, which is checked at
            construction (a mismatch raises ValueError on every rank); the weights are then
            broadcast from the group's rank 0, as ``DistributedDataParallel`` does. Held
            weakly: ``destroy_process_group()`` frees it even while the optimizer lives
            (whose collectives then raise RuntimeError).
        accumulation_steps: micro-batches per optimizer step (>= 1).
        loss_scale: None (no scaling), ``"dynamic"`` (``LossScaler()``'s defaults), a number
            (a static scale) or a :class:`~memkern.LossScaler` for custom settings.
        max_grad_norm: clip the window's gradient to this total L2 norm (None: no clipping).
        offload: None, or ``"cpu"``: float32 masters, optimizer state and step counters in
            host memory, stepped by the C++ CPU kernel (:mod:`memkern.optim.offload`); in one
            process each bucket's step starts during the window's last backward pass, and
            :meth:`step` settles it (the parameters change in :meth:`step` only).
        gradients: where the window's gradients live: ``"device"`` (the flat buffer on the
            parameters' device; across ranks as ``zero_stage`` says) or ``"host"``: no
            gradient buffer on the device; each bucket's gradients, once backward has made
            them (reduce-scattered across ranks, which needs ``zero_stage=2``), are copied to
            host memory, where the window's micro-batches are summed in the gradient dtype,
            and the step runs on the host as with ``offload="cpu"`` (implied). The device
            then keeps the weights and the buckets in flight only
            (:mod:`memkern.optim.streamed_grads`).
        bucket_size_mb: the largest communication bucket across ranks, in MiB of gradients
            (> 0); a larger parameter is a bucket of its own.

    Across ranks: :meth:`backward`, :meth:`step`, :meth:`state_dict`, :meth:`load_state_dict`,
    :meth:`save_sharded` and :meth:`load_sharded` are collective (every rank calls them, with
    the same number of micro-batches per window). Each rank feeds its own micro-batches; the
    window's gradient is the mean over all ranks' micro-batches (or Σ gradients / Σ num_items
    over all of them). With W > 1, ``opt.state`` is empty (a rank holds slices of the state,
    not per-parameter tensors): :meth:`state_dict` assembles the full state. With
    ``zero_stage=2``, ``p.grad`` is None after backward (the gradients went to their owners).

    ``step()`` and ``backward()`` never wait for the device (except the CPU step of offload
    from a GPU, which waits for the gradients it reads); the properties :attr:`loss_scale`,
    :attr:`grad_norm` and :attr:`skipped_steps` read it when called. LR schedulers work as
    with torch optimizers (step them when :meth:`step` is not False).
    """

    # It scales and checks its own gradients: torch.amp.GradScaler must not drive it.
    _step_supports_amp_scaling = False

    process_group = WeakGroup("memkern.ShardedOptimizer")
    """The process group it runs on (None: one process), held weakly
    (:mod:`memkern.optim.process_group`)."""

    def __init__(self, params: Any, optimizer: str = "adamw", *, lr: float,
                 grad_dtype: torch.dtype | None = None, zero_stage: int = 1,
                 process_group: Any = None, accumulation_steps: int = 1, loss_scale: Any = None,
                 max_grad_norm: float | None = None, offload: str | None = None,
                 gradients: str = "device", bucket_size_mb: float = 25,
                 **hyperparams: Any) -> None:
        name = "memkern.ShardedOptimizer"
        if optimizer not in ALGORITHMS:
            raise ValueError(f"{name}: optimizer must be one of {sorted(ALGORITHMS)}, got "
                             f"{optimizer!r}")
        algorithm = ALGORITHMS[optimizer]
        accepted = set(inspect.signature(algorithm.defaults).parameters) - {"lr"}
        unknown = sorted(set(hyperparams) - accepted)
        if unknown:
            raise TypeError(f"{name}: optimizer={optimizer!r} takes the hyper-parameters "
                            f"{sorted(accepted)}, not {unknown}")
        if not (isinstance(accumulation_steps, int) and not isinstance(accumulation_steps, bool)
                and accumulation_steps >= 1):
            raise ValueError(f"{name}: accumulation_steps must be an int >= 1, got "
                             f"{accumulation_steps!r}")
        if max_grad_norm is not None and not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
            raise ValueError(f"{name}: max_grad_norm must be None or a finite number > 0, got "
                             f"{max_grad_norm!r}")
        if zero_stage not in (1, 2):
            raise ValueError(f"{name}: zero_stage must be 1 or 2, got {zero_stage!r}")
        if not bucket_size_mb > 0:
            raise ValueError(f"{name}: bucket_size_mb must be > 0, got {bucket_size_mb!r}")
        if offload not in (None, "cpu"):
            raise ValueError(f"{name}: offload must be None or 'cpu', got {offload!r}")
        if gradients not in GRADIENTS:
            raise ValueError(f"{name}: gradients must be one of {GRADIENTS}, got {gradients!r}")
        params = as_param_groups(params)
        _refuse_dtensors(params, name)
        group, self.rank, self.world_size = _group_and_rank(process_group)
        if gradients == "host":
            if self.world_size > 1 and zero_stage == 1:
                raise ValueError(
                    f"{name}: gradients='host' reduce-scatters each bucket's gradients during "
                    "backward, as zero_stage=2 does (zero_stage=1 reduces the whole gradient at "
                    "the window's end, which needs it on the device); pass zero_stage=2")
            offload = "cpu"  # the step runs where the gradients are
        # What every rank must agree on, checked at construction (with the parameters).
        self._settings = {
            "optimizer": optimizer, "lr": lr, **{k: repr(v) for k, v in hyperparams.items()},
            "grad_dtype": str(grad_dtype), "zero_stage": zero_stage, "offload": offload,
            "gradients": gradients, "accumulation_steps": accumulation_steps,
            "max_grad_norm": max_grad_norm, "loss_scale": repr(loss_scale),
            "bucket_size_mb": bucket_size_mb,
        }
        grads = _grad_placement(gradients, offload, group, self.rank, self.world_size,
                                zero_stage, bucket_size_mb)
        grads.check_consistent(params, self._settings)
        super().__init__(params, algorithm.defaults(lr=lr, **hyperparams), algorithm=algorithm,
                         grad_placement=grads, grad_dtype=grad_dtype)
        grads.broadcast_weights(self.grad_buffer)
        self._steps = (DeviceStep() if offload is None else
                       HostStep(self._update_segment, self.world_size == 1,
                                torch.get_num_threads(), self._segment_hyperparameters,
                                "gradients='host'" if gradients == "host" else "offload='cpu'"))
        self._steps.home(self._segments, grads.on_host)
        self.optimizer_name = optimizer
        self.zero_stage = zero_stage
        self.process_group = group
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.offload = offload
        self.gradients = gradients
        self.bucket_size_mb = bucket_size_mb
        self.scaler = loss_scaler_for(loss_scale)
        device = self.grad_buffer.device
        self.scaler.scale_tensor(device)  # the scaler's state lives with the gradients
        self._window = AccumulationWindow(device, accumulation_steps)
        self._skipped = torch.zeros((), dtype=torch.int64, device=device)
        self._grad_norm: torch.Tensor | None = None
        self._io = StateIO(self, grads, self._steps, self._window, self.scaler, self._skipped,
                           group, self.rank, self.world_size)
        # A gradient that arrives outside backward() (a plain loss.backward(), accelerate's
        # backward) is neither scaled nor counted: step() refuses it instead of stepping wrong.
        for p in self._params():
            p.register_post_accumulate_grad_hook(_weak_hook(self._window.note_grad))

    @property
    def _shards(self) -> GradPlacement:
        """Where the gradients live (a :class:`~memkern.optim.zero.Shards` across ranks or
        with the step on the host): its units, for tests and tools."""
        return self._grads

    @property
    def _overlap(self) -> OverlappedHostStep | None:
        """The host steps overlapped with the window's last backward (one process, the step
        on the host); None runs them after the window's verdict, as across ranks."""
        return self._steps.overlap

    @_overlap.setter
    def _overlap(self, overlap: OverlappedHostStep | None) -> None:
        self._steps.overlap = overlap

    def _params(self) -> list[torch.Tensor]:
        """The parameters in state-dict index order."""
        return self._io.params()

    # ------------------------------------------------------------------------- micro-batch
    def backward(self, loss: torch.Tensor, num_items: int | float | torch.Tensor | None = None
                 ) -> None:
        """Adds one micro-batch's gradient to the window.

        Args:
            loss: a one-element loss that requires grad. Without ``num_items`` it is the
                micro-batch's mean loss and the window's gradient is the mean of the
                micro-batches' gradients.
            num_items: the number of items (e.g. non-padding tokens) ``loss`` is summed over:
                an int/float > 0 or a one-element device tensor (checked > 0 on the device).
                The window's gradient is then Σ gradients / Σ num_items. A window uses
                num_items on every micro-batch or on none.
        """
        name = "memkern.ShardedOptimizer.backward"
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"{name}: loss must be a one-element tensor, got "
                             + (f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                                else type(loss).__name__))
        if not loss.requires_grad:
            raise ValueError(f"{name}: loss does not require grad (computed under no_grad, or "
                             "from parameters that do not require grad?)")
        window = self._window
        mode = window.mode_for(num_items)
        if num_items is not None:
            window.add_items(num_items)
        window.check_before_backward(loss)
        scaled = self.scaler.scale(loss)
        steps, grads = self._steps, self._grads
        steps.settle()  # a backward after the window's last one voids its early steps
        last = window.micro_batches + 1 >= self.accumulation_steps
        if last:
            steps.begin_last_backward(lambda: self._unclipped_multiplier(mode), grads)
        with window.backward_pass():
            grads.begin_backward()
            try:
                scaled.backward()
            except BaseException:
                grads.abandon_backward()
                steps.settle()
                raise
            grads.end_backward()
            if last:
                steps.end_last_backward()
        if not window.grads_in_pass and self.world_size > 1:
            # refused at the step, on every rank (the other ranks would wait for this one)
            window.add_gradless_pass()
        elif not window.grads_in_pass:
            self._settle_host_steps()
            raise RuntimeError(
                f"{name}: no parameter of this optimizer received a gradient from loss, so "
                "the micro-batch was not counted. Were the model's parameters replaced after "
                "the optimizer was built (model.load_state_dict(..., assign=True), a new "
                "model)? Build the optimizer on the parameters the loss is computed from")
        window.add_micro_batch(mode, self.world_size)

    def _unclipped_multiplier(self, mode: str) -> torch.Tensor:
        """Before the window's last backward pass, for a step part that steps segments during
        it: the state made, and the multiplier of the window should it not be clipped."""
        # Autograd must accumulate into the buffer's views, which the steps read.
        self.grad_buffer.claim_grads()
        self._take_as_masters(self._written_params())
        if not self._state_ready:
            self.init_state()
        window = self._window
        normaliser = window.num_items if mode == "items" else window.gradients + self.world_size
        return unclipped_multiplier(self.scaler, normaliser, self.grad_buffer.device)

    # -------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, force: bool = False) -> bool | torch.Tensor:
        """Closes the accumulation window once it holds ``accumulation_steps`` micro-batches
        (or at ``force``) and updates the parameters.

        Returns False while the window is still open (no work done). At a window's end it
        returns a 0-dim bool device tensor: True when the parameters changed, False when the
        step was skipped because the gradients held inf/NaN. It is returned unevaluated so
        that the step loop never waits for the device: ``if opt.step():`` reads it (a sync on
        a GPU); ``opt.step() is not False`` tells "a window closed" without reading anything.

        ``force=True`` closes a window with fewer than ``accumulation_steps`` micro-batches
        (end of an epoch or of training); the gradient is then the mean over the micro-batches
        it has.
        """
        window = self._window
        if window.stray:
            raise RuntimeError(
                "memkern.ShardedOptimizer.step: gradients were accumulated by a backward pass "
                "that did not go through ShardedOptimizer.backward (loss.backward(), "
                "accelerator.backward(loss), a Trainer's own backward); they are not loss-scaled "
                "nor counted in the accumulation window, so no step was taken. Call "
                "opt.backward(loss) on the memkern optimizer instead, then opt.zero_grad() to "
                "drop these gradients (with transformers.Trainer use "
                "memkern.integrations.transformers.MemkernTrainer)"
            )
        if window.micro_batches == 0:
            if force:
                raise RuntimeError(
                    "memkern.ShardedOptimizer.step(force=True): nothing was accumulated since "
                    "the last step; call backward() first, or step() without force"
                )
            return False
        if window.micro_batches < self.accumulation_steps and not force:
            return False
        self._check_params_as_built("memkern.ShardedOptimizer.step")
        written = self._written_params()
        if written:  # steps taken before the verdict used the masters they replace
            self._settle_host_steps()
            self._take_as_masters(written)
        self.grad_buffer.claim_grads()
        stepped = self._window_end()
        window.close()
        return stepped

    def _window_end(self) -> torch.Tensor:
        """The device work of a window's end: norm, inf check, unscale, clip, update, loss-scale
        update. Its op sequence does not depend on any value (overflow, clipping), it reads
        nothing on the host and writes only into tensors that persist from step to step, so
        it can be captured in a CUDA graph (:meth:`graphed_step`)."""
        self._grads.reduce_window()
        window = self._window
        norm, num_items, gradless = self._grads.window_norm(window.num_items, window.gradless)
        if self.world_size > 1 or window.holds_gradless_pass:  # (one process: after a resume)
            window.check_every_pass_had_gradients(gradless)
        nonfinite = ~torch.isfinite(norm)
        found_inf = nonfinite.float()
        multiplier, self._grad_norm = grad_multiplier(
            self.scaler, norm, window.normaliser(num_items), self.max_grad_norm)
        self._apply_update(multiplier, found_inf)
        self._grads.gather_weights()
        self.scaler.update(found_inf)
        self._skipped.add_(nonfinite)
        window.reset_items()
        return ~nonfinite

    def graphed_step(self) -> Any:
        """Captures the window end in a CUDA graph and returns a ``step()`` that replays it.

        Call it once a window is complete (after its last ``backward``); it closes nothing
        itself. The returned callable is used in place of :meth:`step`: it returns False while
        a window is open and, at a window's end, replays the graph (one launch sequence, no
        Python per op) and returns the step's 0-dim bool result tensor (the same tensor every
        time). What the graph bakes in, and so must not change while it is used: the
        hyperparameters of the param groups (learning rate included — capture again after
        changing them), the window length and normalisation (``num_items`` or not), and the
        loss-scaler settings. The min-scale overflow warning is not issued from replays
        (:attr:`skipped_steps` still counts every skipped window). Needs CUDA tensors, one
        process and no offload; with the Triton backend, run one eager :meth:`step` first so
        that its kernels are compiled before the capture.
        """
        where = "memkern.ShardedOptimizer.graphed_step()"
        if self.grad_buffer.device.type != "cuda":
            raise RuntimeError(f"{where}: CUDA graphs need CUDA tensors; the parameters are on "
                               f"{self.grad_buffer.device}")
        if self.world_size > 1 or self.offload is not None:
            raise RuntimeError(f"{where}: supports one process without offload (world size "
                               f"{self.world_size}, offload={self.offload!r}); use step()")
        window = self._window
        if window.micro_batches < self.accumulation_steps:
            raise RuntimeError(f"{where}: call it at a window's end (after the last backward "
                               f"of a window: {window.micro_batches} of "
                               f"{self.accumulation_steps} micro-batches so far)")
        # State the graph reads and writes must exist before the capture, outside its pool.
        if not self._state_ready:
            self.init_state()
        self.scaler.scale_tensor(self.grad_buffer.device)
        mode, window_gradients = window.mode, window.gradients
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad(), torch.cuda.graph(graph, stream=side):
            stepped = self._window_end()
        torch.cuda.current_stream().wait_stream(side)

        def step(force: bool = False) -> bool | torch.Tensor:
            if window.micro_batches < self.accumulation_steps and not force:
                return False
            if (window.mode, window.gradients) != (mode, window_gradients):
                raise RuntimeError(
                    f"{where}: this window ({window.gradients} gradients, mode "
                    f"{window.mode!r}) differs from the captured one ({window_gradients}, "
                    f"{mode!r}); capture again or use step()")
            self._take_as_masters(self._written_params())
            self.grad_buffer.claim_grads()
            graph.replay()
            window.close()
            return stepped

        return step

    def init_state(self) -> None:
        """(Re)creates all optimizer state where the step runs (on the host: from the model's
        current weights, pulled into the host copies first)."""
        self._steps.pull_weights()
        super().init_state()

    def _allocating(self, holds: str) -> contextlib.AbstractContextManager:
        return self._steps.allocating(holds)

    def _apply_update(self, grad_multiplier: torch.Tensor | None,
                      found_inf: torch.Tensor | None) -> None:
        """The update phase: one kernel call per segment (this rank's slices), where the step
        part runs it."""
        if not self._state_ready:
            self.init_state()
        self._steps.run(self._segments, self._update_segment, grad_multiplier, found_inf)

    def _update_segment(self, seg: Segment, grad_multiplier: torch.Tensor | None,
                        found_inf: torch.Tensor | None) -> None:
        self.algorithm.update(seg, self.param_groups[seg.group], grad_multiplier, found_inf)

    def _segment_hyperparameters(self, i: int) -> dict[str, Any]:
        """What segment ``i``'s step reads of its param group, all but the parameters, as
        values: a tensor (an lr changed in place) as its numbers, the rest copied."""
        group = self.param_groups[self._segments[i].group]
        return {k: v.tolist() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                for k, v in group.items() if k not in ("params", "param_names")}

    def _settle_host_steps(self) -> None:
        """Before the state is read or replaced: undoes the host's early steps of an open
        window (its ``step()`` then runs them after the verdict)."""
        self._steps.settle()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the gradient buffer, unless an accumulation window is open.

        Inside an open window (micro-batches accumulated, the window's step not reached) it
        does nothing, so ``backward(); step(); zero_grad()`` on every micro-batch accumulates
        correctly. ``set_to_none`` is ignored: the gradients stay views of the buffer.
        """
        if self._window.micro_batches > 0:
            return
        self.grad_buffer.zero_()
        self._grads.zero_grads()
        self._window.gradients_cleared()

    # -------------------------------------------------------------------------- properties
    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without scaling). Reads the device."""
        return self.scaler.get_scale()

    @property
    def grad_norm(self) -> float | None:
        """Total L2 norm of the last closed window's gradient, unscaled and normalised, before
        clipping (inf/NaN for a skipped window; None before the first). Reads the device."""
        return None if self._grad_norm is None else float(self._grad_norm.item())

    @property
    def skipped_steps(self) -> int:
        """Windows skipped for inf/NaN gradients so far. Reads the device."""
        return int(self._skipped.item())

    @property
    def micro_batches(self) -> int:
        """Micro-batches accumulated in the open window (0 between windows)."""
        return self._window.micro_batches

    # ------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The full optimizer state in ``torch.optim`` format plus a ``"memkern"`` entry: the
        loss scaler, the skipped-step count and the open window (micro-batch count, the number
        of micro-batch gradients summed, normalisation mode, item total and, while the window
        is open, the window's accumulated gradient per parameter index, summed over ranks).
        Saved mid-window and loaded into a fresh optimizer, training continues exactly.

        The same dict whatever the world size: across W ranks it is collective, assembled on
        every rank as CPU tensors (the full state in host memory on each rank: for large
        models use :meth:`save_sharded`). In one process its tensors are views of the live
        state. Reads the device (not for the step loop)."""
        self._settle_host_steps()
        with self._float_state(write_back=False):
            state_dict = super().state_dict()
            if self.world_size > 1:
                state_dict["state"] = self._io.gather_param_states()
                self._mark_state_precision(state_dict["state"])
        state_dict["memkern"] = self._io.front_end_state()
        return state_dict

    def _state_pieces(self, p: torch.Tensor, key: str) -> list[tuple[torch.Tensor, int]] | None:
        return self._io.state_pieces(p, key)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads :meth:`state_dict`'s output, saved at any world size and zero stage (or a
        plain torch-format optimizer state dict, which restores the optimizer state only and
        leaves no window open). Collective across ranks: each rank keeps its slices."""
        self._settle_host_steps()
        super().load_state_dict(state_dict)
        self._io.load_front_end_state(state_dict.get("memkern"))

    def save_sharded(self, path: str | os.PathLike) -> None:
        """Saves the optimizer through ``torch.distributed.checkpoint``: every rank writes its
        own slices, nothing is gathered; loadable by :meth:`load_sharded` at any world size
        and zero stage. Atomic: written to ``<path>.incomplete`` and renamed to ``path`` once
        complete (a save that dies midway leaves ``path`` as it was). See
        :mod:`memkern.optim.checkpoint`. Collective."""
        self._settle_host_steps()
        with self._float_state(write_back=False):
            checkpoint.save_sharded(self._io, path)

    def load_sharded(self, path: str | os.PathLike) -> None:
        """Loads a checkpoint written by :meth:`save_sharded`, at any world size; each rank
        reads the parts of the saved slices it now owns. Raises if the checkpoint is
        incomplete. Collective."""
        self._settle_host_steps()
        with self._float_state(write_back=True):
            checkpoint.load_sharded(self._io, path)
