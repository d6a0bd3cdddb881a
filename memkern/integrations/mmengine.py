"""memkern in MMEngine's ``Runner``: an optimizer wrapper, a patch hook and a model wrapper.

Importing this module registers them in MMEngine's registries (in a config file:
``custom_imports=dict(imports=['memkern.integrations.mmengine'])``):

* ``MemkernOptimWrapper`` (``OPTIM_WRAPPERS``): MMEngine's ``OptimWrapper`` stepping a
  :class:`memkern.optim.ShardedOptimizer` — flat 16-bit gradients, the fused step with
  clipping and loss scaling folded in, 8-bit state, ZeRO-1/2 across ranks, CPU offload::

      optim_wrapper = dict(type='MemkernOptimWrapper',
                           optimizer=dict(type='AdamW', lr=1e-3, weight_decay=0.01),
                           accumulative_counts=4, clip_grad=dict(max_norm=1.0),
                           dtype='bfloat16', state_precision='8bit', zero_stage=2)

  MMEngine's own bookkeeping is kept: ``update_params``, ``should_update``, ``should_sync``,
  ``initialize_count_status`` (the last window shorter than ``accumulative_counts`` when the
  run's iterations are not a multiple of it), ``get_lr``, param schedulers and checkpoints.
* ``MemkernPatchHook`` (``HOOKS``): ``custom_hooks=[dict(type='MemkernPatchHook')]`` patches
  the ``Runner``'s model with :func:`memkern.patch` before the run and logs what was swapped.
* ``MemkernDataParallel`` (``MODEL_WRAPPERS``): across processes (``launcher='pytorch'``),
  ``model_wrapper_cfg=dict(type='MemkernDataParallel')`` in place of MMEngine's
  ``DistributedDataParallel``: the optimizer reduces the gradients itself, once per window,
  and no second copy of the gradients is kept for DDP's buckets.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmengine.optim import OptimWrapper
from mmengine.registry import HOOKS, MODEL_WRAPPERS, OPTIM_WRAPPERS
from torch import nn
from torch.distributed.fsdp._common_utils import _is_fsdp_flattened  # (see _is_fsdp1_parameter)

from memkern.amp.loss_scaler import LossScaler
from memkern.nn.patch import patch as patch_model
from memkern.nn.patch import patch_report
from memkern.optim.sharded import ShardedOptimizer

NAME = "memkern MemkernOptimWrapper"

# torch optimizer -> (ShardedOptimizer's algorithm, the param-group keys it takes besides lr)
_ALGORITHMS = {
    torch.optim.AdamW: ("adamw", ("betas", "eps", "weight_decay")),
    torch.optim.Adam: ("adamw", ("betas", "eps", "weight_decay")),
    torch.optim.SGD: ("sgd", ("momentum", "dampening", "weight_decay", "nesterov")),
}
# param-group options memkern's step does not have, and the value that means "not used"
_UNSUPPORTED_OPTIONS = {"amsgrad": False, "maximize": False}
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _is_fsdp1_parameter(p: torch.Tensor) -> bool:
    """Whether ``p`` is a parameter FSDP1 (``FullyShardedDataParallel``) flattened. torch marks
    them with a private attribute and has no public query; this is the one place that reads
    it."""
    return _is_fsdp_flattened(p)


def _param_groups(optimizer: torch.optim.Optimizer, state_precision: str
                  ) -> tuple[str, list[dict[str, Any]]]:
    """The algorithm and the param groups of a ShardedOptimizer doing what the torch optimizer
    MMEngine built from the config would do (its trainable parameters only)."""
    kind = next((k for k in _ALGORITHMS if type(optimizer) is k), None)
    if kind is None:
        raise ValueError(
            f"{NAME}: optimizer type {type(optimizer).__name__} has no memkern equivalent; use "
            "optimizer=dict(type='AdamW', ...) or dict(type='SGD', ...) (or 'Adam' with "
            "weight_decay=0)")
    algorithm, keys = _ALGORITHMS[kind]
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        for option, unused in _UNSUPPORTED_OPTIONS.items():
            if group.get(option, unused) != unused:
                raise ValueError(f"{NAME}: {option}={group[option]!r} (param group {index}) is "
                                 f"not supported by memkern's {algorithm} step; leave it at "
                                 f"{unused!r}")
        if (kind is torch.optim.Adam and group["weight_decay"] != 0
                and not group.get("decoupled_weight_decay", False)):
            raise ValueError(
                f"{NAME}: Adam with weight_decay={group['weight_decay']} (param group {index}) "
                "adds the decay to the gradient, which memkern's AdamW does not; use "
                "type='AdamW' (decoupled decay), or weight_decay=0")
        params = [p for p in group["params"] if p.requires_grad]
        if params:
            groups.append({"params": params, "lr": group["lr"],
                           "state_precision": state_precision,
                           **{k: group[k] for k in keys}})
    if not groups:
        raise ValueError(f"{NAME}: the optimizer holds no parameter that requires grad")
    return algorithm, groups


def _max_grad_norm(clip_grad: dict | None) -> float | None:
    """``clip_grad`` (MMEngine's: the arguments of ``clip_grad_norm_``) as the optimizer's
    ``max_grad_norm``: the L2 norm of all gradients, clipped inside the fused step."""
    if clip_grad is None:
        return None
    if not isinstance(clip_grad, dict):
        raise ValueError(f"{NAME}: clip_grad must be None or dict(max_norm=...), got "
                         f"{clip_grad!r}")
    options = dict(clip_grad)
    if options.pop("type", "norm") != "norm":
        raise ValueError(f"{NAME}: clip_grad type {clip_grad['type']!r} is not supported: "
                         "memkern clips by the total L2 norm (type='norm')")
    if "max_norm" not in options:
        raise ValueError(f"{NAME}: clip_grad must be None or dict(max_norm=...), got "
                         f"{clip_grad!r}")
    max_norm = options.pop("max_norm")
    if float(options.pop("norm_type", 2.0)) != 2.0:
        raise ValueError(f"{NAME}: clip_grad norm_type={clip_grad['norm_type']!r} is not "
                         "supported: memkern clips by the L2 norm (norm_type=2)")
    if options.pop("error_if_nonfinite", False):
        raise ValueError(f"{NAME}: clip_grad error_if_nonfinite=True is not supported: a "
                         "non-finite window is skipped (counted in skipped_steps) instead")
    if options:
        raise ValueError(f"{NAME}: clip_grad keys {sorted(options)} are not supported")
    return max_norm


@OPTIM_WRAPPERS.register_module()
class MemkernOptimWrapper(OptimWrapper):
    """MMEngine's ``OptimWrapper`` over a :class:`memkern.optim.ShardedOptimizer`.

    Args:
        optimizer: the torch optimizer MMEngine built from the config's ``optimizer`` dict:
            ``AdamW``, ``SGD`` (momentum, dampening, Nesterov, weight decay), or ``Adam`` with
            ``weight_decay=0``. Its param groups (``paramwise_cfg`` included) and
            hyper-parameters become the ``ShardedOptimizer``'s; parameters that do not require
            grad are left out. ``optim_wrapper.optimizer`` is the ``ShardedOptimizer``.
        accumulative_counts: micro-batches per step, as for ``OptimWrapper``. The window's
            gradient is the mean of its micro-batches' (MMEngine divides each loss by the
            count; memkern divides the summed gradient once, in the fused step). The run's
            last window is shorter when its iterations are not a multiple, as MMEngine makes
            it (``initialize_count_status``), and is the mean of the micro-batches it holds.
        clip_grad: ``dict(max_norm=...)``: clip the window's gradient to this total L2 norm,
            inside the fused step (``type='value'`` and other norms are refused). The norm
            before clipping is logged as ``train/grad_norm``, as ``OptimWrapper`` does.
        dtype: None, ``'bfloat16'`` or ``'float16'``: the parameters the optimizer steps are
            cast to it in place (it keeps their float32 master weights) and ``optim_context``
            runs the forward under ``torch.autocast`` of that dtype, so float32 inputs and
            buffers mix with the 16-bit weights; what ``AmpOptimWrapper(dtype=...)`` does with
            float32 weights and autocast, without the float32 weights on the device.
        loss_scale: ``'auto'`` (``'dynamic'`` with ``dtype='float16'``, else None), None (no
            scaling), ``'dynamic'``, a number (a static scale) or a dict of
            :class:`memkern.LossScaler` arguments (``init_scale``, ``growth_factor``,
            ``backoff_factor``, ``growth_interval``: ``GradScaler``'s names). One inf check and
            one scale update per window; a window with inf/NaN gradients is skipped, as
            ``AmpOptimWrapper`` skips it.
        state_precision, offload, zero_stage, grad_dtype, bucket_size_mb: memkern's
            options, passed to ``ShardedOptimizer`` (``'8bit'`` state, ``offload='cpu'``,
            ZeRO stage 1 or 2 across processes).

    Across processes the optimizer reduces the gradients, once per window: wrap the model
    with ``MemkernDataParallel``. Under MMEngine's ``DistributedDataParallel`` every forward
    runs in its ``no_sync()`` (``optim_context``), so DDP reduces nothing. FSDP1
    (``MMFullyShardedDataParallel``) is refused: see ``docs/integrations.md``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, accumulative_counts: int = 1,
                 clip_grad: dict | None = None, dtype: str | None = None,
                 loss_scale: Any = "auto", state_precision: str = "32bit",
                 offload: str | None = None, zero_stage: int = 1,
                 grad_dtype: str | torch.dtype | None = None, bucket_size_mb: float = 25) -> None:
        if not (isinstance(accumulative_counts, int) and accumulative_counts >= 1):
            raise ValueError(f"{NAME}: accumulative_counts must be an int >= 1, got "
                             f"{accumulative_counts!r}")
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"{NAME}: dtype must be None, 'bfloat16' or 'float16', got "
                             f"{dtype!r}")
        self.cast_dtype = _DTYPES.get(dtype)
        if loss_scale == "auto":
            loss_scale = "dynamic" if self.cast_dtype is torch.float16 else None
        if isinstance(loss_scale, dict):
            loss_scale = LossScaler(**loss_scale)
        flattened = [p for g in optimizer.param_groups for p in g["params"]
                     if _is_fsdp1_parameter(p)]
        if flattened:
            raise ValueError(
                f"{NAME}: the model is sharded by FSDP1 (MMFullyShardedDataParallel), which "
                "reduces and shards the gradients for an optimizer of its own; shard with FSDP2 "
                "(torch.distributed.fsdp.fully_shard) and step with memkern.optim.FusedAdamW "
                "instead (docs/distributed.md)")
        algorithm, groups = _param_groups(optimizer, state_precision)
        if self.cast_dtype is not None:
            for group in groups:
                for p in group["params"]:
                    p.data = p.data.to(self.cast_dtype)
        sharded = ShardedOptimizer(
            groups, algorithm, lr=groups[0]["lr"], accumulation_steps=accumulative_counts,
            max_grad_norm=_max_grad_norm(clip_grad), loss_scale=loss_scale, offload=offload,
            zero_stage=zero_stage, bucket_size_mb=bucket_size_mb,
            grad_dtype=getattr(torch, grad_dtype) if isinstance(grad_dtype, str) else grad_dtype)
        super().__init__(sharded, accumulative_counts=accumulative_counts)
        self.clips = clip_grad is not None
        # The inner count when the optimizer's state was last saved or loaded: a resume at that
        # count continues the open window exactly (its gradients are in the state).
        self._saved_count: int | None = None

    # ------------------------------------------------------------------ the training step
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss as it is: the optimizer divides the window's summed gradient by its number
        of micro-batches (MMEngine's ``loss / accumulative_counts``, or ``/ remainder`` in
        the last window), once, in the fused step."""
        return loss

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Adds the micro-batch's gradient to the window (``ShardedOptimizer.backward``:
        scaled by the loss scale, into the flat gradient buffer)."""
        if kwargs:
            raise TypeError(f"{NAME}.backward: options {sorted(kwargs)} are not supported "
                            "(ShardedOptimizer.backward takes the loss only)")
        self.optimizer.backward(loss)
        self._inner_count += 1

    def step(self, **kwargs: Any) -> None:
        """Closes the window and steps (called by ``update_params`` when ``should_update()``,
        the window's last micro-batch or the run's last iteration): unscale, normalise,
        clip and the AdamW/SGD update in one fused pass."""
        if kwargs:
            raise TypeError(f"{NAME}.step: options {sorted(kwargs)} are not supported")
        self.optimizer.step(force=True)
        if self.clips:
            self.message_hub.update_scalar("train/grad_norm", self.optimizer.grad_norm)

    def zero_grad(self, **kwargs: Any) -> None:
        """Zeroes the flat gradient buffer (``set_to_none`` is ignored: the gradients stay its
        views)."""
        self.optimizer.zero_grad()

    @contextlib.contextmanager
    def optim_context(self, model: nn.Module) -> Iterator[None]:
        """The forward's context: autocast to ``dtype`` when it is set, and a
        ``DistributedDataParallel`` model's ``no_sync()`` on every micro-batch, since the
        optimizer reduces the gradients itself (DDP would reduce them a second time)."""
        with contextlib.ExitStack() as stack:
            if hasattr(model, "no_sync"):
                stack.enter_context(model.no_sync())
            if self.cast_dtype is not None:
                device = self.optimizer.param_groups[0]["params"][0].device.type
                stack.enter_context(torch.autocast(device, dtype=self.cast_dtype))
            yield

    # --------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """The optimizer's full state (float32 masters, moments, loss scale, the open window's
        gradients) and the inner count it was saved at."""
        state = super().state_dict()
        state["memkern_inner_count"] = self._inner_count
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        self._saved_count = state_dict.pop("memkern_inner_count", None)
        super().load_state_dict(state_dict)

    def initialize_count_status(self, model: nn.Module, init_counts: int,
                                max_counts: int) -> None:
        """MMEngine's, without its warning that a resume in the middle of a window loses that
        window's gradients: the optimizer's state holds them, and the window continues."""
        window_kept = init_counts == self._saved_count
        self._saved_count = None
        if not window_kept:
            super().initialize_count_status(model, init_counts, max_counts)
            return
        # (ShardedOptimizer warns about BatchNorm under accumulation itself.)
        self._inner_count = init_counts
        self._max_counts = max_counts
        self._remainder_counts = max_counts % self._accumulative_counts


@HOOKS.register_module()
class MemkernPatchHook(Hook):
    """Patches the ``Runner``'s model with :func:`memkern.patch` before the run and logs
    :func:`memkern.nn.patch_report` (what was swapped, what was left alone and why).

    ``custom_hooks=[dict(type='MemkernPatchHook', recompute='full')]``: keyword arguments go to
    ``memkern.patch``. The model is patched in place after MMEngine built it, its optimizer
    wrapper and its DDP wrapper: ``patch`` keeps every parameter (identity, values, names), so
    the optimizer steps the same tensors. A model under FSDP1 cannot be patched afterwards
    (its layers hold flattened views): patch it in its constructor.
    """

    priority = "VERY_HIGH"

    def __init__(self, **patch_kwargs: Any) -> None:
        self.patch_kwargs = patch_kwargs

    def before_run(self, runner: Any) -> None:
        model = runner.model.module if is_model_wrapper(runner.model) else runner.model
        patch_model(model, **self.patch_kwargs)
        runner.logger.info(str(patch_report(model)))


@MODEL_WRAPPERS.register_module()
class MemkernDataParallel(nn.Module):
    """A model wrapper for several processes whose gradients ``MemkernOptimWrapper`` reduces
    (ZeRO-1/2 of :class:`memkern.optim.ShardedOptimizer`): ``model_wrapper_cfg=dict(
    type='MemkernDataParallel')``. It reduces nothing itself and keeps no gradient buckets;
    every rank starts from rank 0's weights (the optimizer broadcasts them, as DDP does).
    ``train_step``, ``val_step`` and ``test_step`` are the model's own."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def train_step(self, data: Any, optim_wrapper: OptimWrapper) -> dict[str, torch.Tensor]:
        if not isinstance(optim_wrapper, MemkernOptimWrapper):
            raise TypeError("memkern MemkernDataParallel: the gradients are reduced by "
                            "MemkernOptimWrapper, which this run does not use (got "
                            f"{type(optim_wrapper).__name__}); use it, or MMEngine's "
                            "DistributedDataParallel wrapper")
        return self.module.train_step(data, optim_wrapper)

    def val_step(self, data: Any) -> list:
        return self.module.val_step(data)

    def test_step(self, data: Any) -> list:
        return self.module.test_step(data)
