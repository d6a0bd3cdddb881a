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

With more than one process the phases above become: reduce the gradients and the window's
item count across ranks, (1-2) on the local shard plus one small all-reduce of the squared
norm and ``found_inf``, (3) on the local shard of the state, then all-gather the weights
(:meth:`ShardedOptimizer._reduce_gradients` and :meth:`ShardedOptimizer._gather_parameters`
are where those collectives go). Only the single-process case exists so far.
"""
from __future__ import annotations

import inspect
import math
import warnings
from typing import Any

import torch

from memkern import ops
from memkern.amp.loss_scaler import LossScaler
from memkern.optim.flat_state import FlatOptimizer
from memkern.optim.fused_adamw import AdamW
from memkern.optim.fused_sgd import SGD

ALGORITHMS = {"adamw": AdamW, "sgd": SGD}


def _scaler_for(loss_scale: Any) -> LossScaler:
    if isinstance(loss_scale, LossScaler):
        return loss_scale
    if loss_scale is None:
        return LossScaler(init_scale=1.0, dynamic=False)
    if isinstance(loss_scale, str) and loss_scale == "dynamic":
        return LossScaler()
    if (isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool)
            and math.isfinite(loss_scale) and loss_scale > 0):
        return LossScaler(init_scale=float(loss_scale), min_scale=float(loss_scale),
                          dynamic=False)
    raise ValueError(
        "memkern.ShardedOptimizer: loss_scale must be None (no scaling), 'dynamic', a finite "
        f"number > 0 (a static scale) or a memkern.LossScaler, got {loss_scale!r}"
    )


def _world_size(process_group: Any) -> int:
    if process_group is not None:
        return process_group.size()
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


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
        zero_stage: 1 (optimizer state sharded) or 2 (gradients too); the same thing in one
            process.
        process_group: None: the default group when ``torch.distributed`` is initialised,
            else one process. More than one process is not implemented yet.
        accumulation_steps: micro-batches per optimizer step (>= 1).
        loss_scale: None (no scaling), ``"dynamic"`` (``LossScaler()``'s defaults), a number
            (a static scale) or a :class:`~memkern.LossScaler` for custom settings.
        max_grad_norm: clip the window's gradient to this total L2 norm (None: no clipping).
        offload: None, or ``"cpu"`` (not implemented yet).
        bucket_size_mb: size of the communication buckets across ranks (> 0).

    ``step()`` and ``backward()`` never wait for the device; the properties
    :attr:`loss_scale`, :attr:`grad_norm` and :attr:`skipped_steps` read it when called.
    LR schedulers work as with torch optimizers (step them when :meth:`step` is not False).
    """

    # It scales and checks its own gradients: torch.amp.GradScaler must not drive it.
    _step_supports_amp_scaling = False

    def __init__(self, params: Any, optimizer: str = "adamw", *, lr: float,
                 grad_dtype: torch.dtype | None = None, zero_stage: int = 1,
                 process_group: Any = None, accumulation_steps: int = 1, loss_scale: Any = None,
                 max_grad_norm: float | None = None, offload: str | None = None,
                 bucket_size_mb: float = 25, **hyperparams: Any) -> None:
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
        if offload == "cpu":
            raise NotImplementedError(f"{name}: offload='cpu' is not implemented yet; use "
                                      "offload=None")
        world_size = _world_size(process_group)
        if world_size > 1:
            raise NotImplementedError(
                f"{name}: sharding across {world_size} processes is not implemented yet; only "
                "one process (process_group=None without torch.distributed, or a group of one)"
            )
        self.algorithm = algorithm
        super().__init__(params, algorithm.defaults(lr=lr, **hyperparams), grad_dtype=grad_dtype)
        self.optimizer_name = optimizer
        self.zero_stage = zero_stage
        self.process_group = process_group
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.offload = offload
        self.bucket_size_mb = bucket_size_mb
        self.scaler = _scaler_for(loss_scale)
        device = self.grad_buffer.device
        self.scaler.scale_tensor(device)  # the scaler's state lives with the gradients
        # The open window: micro-batches so far, how they are normalised ("mean" | "items"),
        # and their total num_items on the device (float64: exact counts up to 2**53).
        self._micro_batches = 0
        self._window_mode: str | None = None
        self._num_items = torch.zeros((), dtype=torch.float64, device=device)
        self._skipped = torch.zeros((), dtype=torch.int64, device=device)
        self._grad_norm: torch.Tensor | None = None
        self._grads_dirty = False  # the buffer holds gradients that zero_grad() has not cleared
        self._warned_unzeroed = False
        self._checked_batch_norm = accumulation_steps == 1

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
        mode = "mean" if num_items is None else "items"
        if self._window_mode not in (None, mode):
            raise ValueError(
                f"{name}: this accumulation window's earlier micro-batches were passed "
                + ("with num_items and this one without" if mode == "mean" else
                   "without num_items and this one with")
                + "; pass num_items on every micro-batch of a window or on none"
            )
        if num_items is not None:
            self._add_items(num_items)
        if self._micro_batches == 0 and self._grads_dirty and not self._warned_unzeroed:
            self._warned_unzeroed = True
            warnings.warn(
                f"{name}: a new accumulation window starts on the previous window's gradients, "
                "which were never zeroed: call zero_grad() after step()",
                RuntimeWarning,
                stacklevel=2,
            )
        if not self._checked_batch_norm:
            self._checked_batch_norm = True
            self._warn_if_batch_norm(loss)
        self.scaler.scale(loss).backward()
        self._window_mode = mode
        self._micro_batches += 1
        self._grads_dirty = True

    def _add_items(self, num_items: int | float | torch.Tensor) -> None:
        name = "memkern.ShardedOptimizer.backward"
        if isinstance(num_items, torch.Tensor):
            if num_items.numel() != 1 or num_items.dtype in (torch.bool, torch.complex64,
                                                             torch.complex128):
                raise ValueError(f"{name}: num_items must be a one-element integer or float "
                                 f"tensor, got {num_items.dtype} of shape "
                                 f"{tuple(num_items.shape)}")
            n = num_items.detach().reshape(()).to(self._num_items.device, non_blocking=True)
            # Checked where the value lives: on a GPU an asynchronous device-side assert.
            torch._assert_async(n > 0, f"{name}: num_items must be > 0")
            self._num_items.add_(n)
        elif isinstance(num_items, (int, float)) and not isinstance(num_items, bool):
            if not (math.isfinite(num_items) and num_items > 0):
                raise ValueError(f"{name}: num_items must be > 0 (the number of items the loss "
                                 f"sums over), got {num_items}")
            self._num_items.add_(num_items)
        else:
            raise TypeError(f"{name}: num_items must be an int, a float or a one-element "
                            f"tensor, got {type(num_items).__name__}")

    def _warn_if_batch_norm(self, loss: torch.Tensor) -> None:
        """Warns once when the graph holds a BatchNorm in training mode (walked on the first
        backward only): its statistics are per micro-batch, so accumulated micro-batches are
        not one large batch."""
        seen, stack = set(), [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if "BatchNorm" in type(node).__name__ and getattr(node, "_saved_training", True):
                warnings.warn(
                    "memkern.ShardedOptimizer: the model has BatchNorm layers in training mode "
                    f"and accumulates gradients over {self.accumulation_steps} micro-batches: "
                    "BatchNorm normalises each micro-batch with its own statistics (and updates "
                    "its running statistics per micro-batch), so the result is not that of one "
                    "large batch. Consider GroupNorm/LayerNorm, or larger micro-batches.",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return
            stack.extend(child for child, _ in node.next_functions)

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
        if self._micro_batches == 0:
            if force:
                raise RuntimeError(
                    "memkern.ShardedOptimizer.step(force=True): nothing was accumulated since "
                    "the last step; call backward() first, or step() without force"
                )
            return False
        if self._micro_batches < self.accumulation_steps and not force:
            return False
        self.grad_buffer.claim_grads()
        self._reduce_gradients()
        norm = self._scaled_grad_norm()
        nonfinite = ~torch.isfinite(norm)
        found_inf = nonfinite.float()
        grad_multiplier = self._grad_multiplier(norm)
        self._apply_update(grad_multiplier, found_inf)
        self._gather_parameters()
        self.scaler.update(found_inf)
        self._skipped.add_(nonfinite)
        if self._window_mode == "items":
            self._num_items.zero_()
        self._micro_batches, self._window_mode = 0, None
        return ~nonfinite

    def _reduce_gradients(self) -> None:
        """Across ranks: reduce(-scatter) the gradient buffer and the window's item count.
        One process has nothing to reduce."""

    def _scaled_grad_norm(self) -> torch.Tensor:
        """L2 norm of the accumulated (scaled, un-normalised) gradients: one read-only pass
        per flat buffer. Non-finite exactly when some gradient is (or when the squares
        overflow float32, i.e. scaled gradients above ~1e19)."""
        norms = [ops.l2_norm(b.grads) for b in self.grad_buffer.buckets]
        return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))

    def _grad_multiplier(self, norm: torch.Tensor) -> torch.Tensor:
        """``1 / (scale · normaliser) · clip_coef`` as a one-element float32 device tensor;
        also records the true gradient norm for :attr:`grad_norm`."""
        normaliser = self._num_items if self._window_mode == "items" else self._micro_batches
        inv_scale = self.scaler.inv_scale(norm.device)
        unscale = (inv_scale.double() / normaliser).float()
        self._grad_norm = norm * unscale
        if self.max_grad_norm is None:
            return unscale
        clip_coef = (self.max_grad_norm / (self._grad_norm + 1e-6)).clamp_(max=1.0)
        return unscale * clip_coef

    def _gather_parameters(self) -> None:
        """Across ranks: all-gather the updated weights of every shard. One process holds
        them all."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the gradient buffer, unless an accumulation window is open.

        Inside an open window (micro-batches accumulated, the window's step not reached) it
        does nothing, so ``backward(); step(); zero_grad()`` on every micro-batch accumulates
        correctly. ``set_to_none`` is ignored: the gradients stay views of the buffer.
        """
        if self._micro_batches > 0:
            return
        self.grad_buffer.zero_()
        self._grads_dirty = False

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
        return self._micro_batches

    # ------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The optimizer state in ``torch.optim`` format plus a ``"memkern"`` entry: the loss
        scaler, the skipped-step count and the open window (micro-batch count, normalisation
        mode, item total and, while the window is open, the accumulated gradients per
        parameter index). Saved mid-window and loaded into a fresh optimizer, training
        continues exactly. Reads the device (not for the step loop)."""
        state_dict = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        window_open = self._micro_batches > 0
        state_dict["memkern"] = {
            "loss_scaler": self.scaler.state_dict(),
            "skipped_steps": self.skipped_steps,
            "window": {
                "micro_batches": self._micro_batches,
                "mode": self._window_mode,
                "num_items": float(self._num_items.item()),
                "grads": ({i: self.grad_buffer.grad(p) for i, p in enumerate(params)}
                          if window_open else None),
            },
        }
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads :meth:`state_dict`'s output (or a plain torch-format optimizer state dict,
        which restores the optimizer state only and leaves no window open)."""
        super().load_state_dict(state_dict)
        front = state_dict.get("memkern")
        self.grad_buffer.zero_()
        self._micro_batches, self._window_mode = 0, None
        self._num_items.zero_()
        self._grads_dirty = False
        if front is None:
            return
        if front["loss_scaler"]:
            self.scaler.load_state_dict(front["loss_scaler"])
        self._skipped.fill_(front["skipped_steps"])
        window = front["window"]
        if window["micro_batches"]:
            params = [p for g in self.param_groups for p in g["params"]]
            for i, grad in window["grads"].items():
                self.grad_buffer.grad(params[i]).copy_(grad)
            self._micro_batches = window["micro_batches"]
            self._window_mode = window["mode"]
            self._num_items.fill_(window["num_items"])
            self._grads_dirty = True
