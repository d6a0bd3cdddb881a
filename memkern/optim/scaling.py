"""Loss scaling and clipping of :class:`~memkern.optim.ShardedOptimizer`'s window gradient:
the ``loss_scale`` argument as a :class:`~memkern.LossScaler` and the one multiplier the
optimizer kernels apply to every gradient. (The window gradient's norm, which is also its inf
check, is the gradients' part's: :meth:`~memkern.optim.grad_placement.GradPlacement.window_norm`.)

All on the device, without a host read: the window's gradient is the scaled sum of its
micro-batch gradients, and the kernels multiply it by
``1 / (scale · normaliser) · clip_coef``, with torch's
``clip_coef = min(1, max_grad_norm / (true_norm + 1e-6))``.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from memkern.amp.loss_scaler import LossScaler


def loss_scaler_for(loss_scale: Any) -> LossScaler:
    """The scaler of a ``loss_scale`` argument: None (no scaling: a static scale of 1),
    ``"dynamic"``, a number (a static scale) or a :class:`~memkern.LossScaler`."""
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


def unclipped_multiplier(scaler: LossScaler, normaliser: torch.Tensor | int,
                         device: torch.device) -> torch.Tensor:
    """``1 / (scale · normaliser)``, the multiplier of a window that is not clipped: a
    one-element float32 tensor on ``device``. Known before the window's gradients are (offload
    steps with it during the last backward pass); :func:`grad_multiplier` multiplies it by the
    clip coefficient, so a coefficient of 1 leaves it bit for bit as it is."""
    return (scaler.inv_scale(device).double() / normaliser).float()


def grad_multiplier(scaler: LossScaler, norm: torch.Tensor, normaliser: torch.Tensor | int,
                    max_grad_norm: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(multiplier, true_norm)``: ``1 / (scale · normaliser) · clip_coef`` as a one-element
    float32 device tensor, and the window gradient's norm unscaled and normalised (before
    clipping; inf/NaN when the window overflowed)."""
    unscale = unclipped_multiplier(scaler, normaliser, norm.device)
    true_norm = norm * unscale
    if max_grad_norm is None:
        return unscale, true_norm
    clip_coef = (max_grad_norm / (true_norm + 1e-6)).clamp_(max=1.0)
    return unscale * clip_coef, true_norm
