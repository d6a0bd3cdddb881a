"""``memkern::adamw_step_``: one fused, mixed-precision AdamW step over flat buffers.

Arguments (all 1-D contiguous buffers of the same length on one device)
    master           float32 master weights, updated in place.
    exp_avg          float32 first moment, updated in place.
    exp_avg_sq       float32 second moment, updated in place.
    grads            float32/bfloat16/float16 gradients (read only).
    params           optional float32/bfloat16/float16 model weights, overwritten with
                     ``round(master)`` in the same pass (None when ``master`` *is* the model's
                     float32 weight).
    step             one-element float32 step counter, advanced by one in place.
    grad_multiplier  optional one-element float32: each gradient is multiplied by it before
                     use (inverse loss scale × clip coefficient × 1/normaliser).
    found_inf        optional one-element float32: when non-zero nothing at all is written,
                     the step counter included (a skipped step is bit-identical).
    lr, beta1, beta2, eps, weight_decay   as ``torch.optim.AdamW``.

The math is ``torch.optim.AdamW``'s, with ``t = step + 1``::

    g      = float32(grads) * grad_multiplier
    master = master * (1 - lr * weight_decay)
    m      = lerp(m, g, 1 - beta1)
    v      = v * beta2 + (1 - beta2) * g * g
    master = master - (lr / (1 - beta1**t)) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)
    params = round(master);  step = t

No host sync: step, grad_multiplier and found_inf are read on the device.

Two orders of the same math. The reference (:func:`update`) follows ``torch.optim.AdamW``'s,
as written above, operation by operation; in float64 it is the tests' oracle. The compiled
backends — CPU, CUDA and Triton alike — follow csrc/math/adamw.h's: ``sqrt(1 - beta2**t)``
moved out of the denominator (one division per element instead of two), the step's factors
rounded once from float64, each product that feeds a sum fused with it; they agree with each
other bit for bit and with torch within a few float32 ulp (tests/test_flat_ops.py).
"""
from __future__ import annotations

import torch

from memkern.ops import _checks
from memkern.ops._registry import Op

SCHEMA = (
    "(Tensor(a!) master, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor grads, "
    "Tensor(d!)? params, Tensor(e!) step, Tensor? grad_multiplier, Tensor? found_inf, "
    "float lr, float beta1, float beta2, float eps, float weight_decay) -> ()"
)


def _check(master, exp_avg, exp_avg_sq, grads, params, step, grad_multiplier, found_inf,
           lr, beta1, beta2, eps, weight_decay, op: str = "adamw_step_") -> torch.device:
    """``op``: the op named in the errors (``adamw8bit_step_`` checks its common arguments
    here)."""
    state_dtypes = (torch.float32, torch.float64)
    _checks.flat(op, "master", master, state_dtypes)
    _checks.flat(op, "exp_avg", exp_avg, (master.dtype,), like=master)
    _checks.flat(op, "exp_avg_sq", exp_avg_sq, (master.dtype,), like=master)
    _checks.step_inputs(op, master, grads, params, step, grad_multiplier, found_inf)
    if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
        raise ValueError(f"memkern.{op}: betas must be in [0, 1), got ({beta1}, {beta2})")
    if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
        raise ValueError(
            f"memkern.{op}: lr, eps and weight_decay must be >= 0, got lr={lr}, eps={eps}, "
            f"weight_decay={weight_decay}"
        )
    return master.device


def _fake(*args) -> None:
    _check(*args)


def update(master, exp_avg, exp_avg_sq, grads, step, grad_multiplier, lr, beta1, beta2, eps,
           weight_decay) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The AdamW math in plain torch, in ``master.dtype`` and in ``torch.optim.AdamW``'s order
    of operations (not csrc/math/adamw.h's; see the module docstring): returns the new master,
    ``m`` and ``v`` (nothing is written). Shared by this op's reference and the 8-bit one's."""
    compute = master.dtype
    g = grads.to(compute)
    if grad_multiplier is not None:
        g = g * grad_multiplier.reshape(()).to(compute)
    t = step.reshape(()).to(torch.float64) + 1
    step_size = (lr / (1 - beta1**t)).to(compute)
    bias_correction2_sqrt = torch.sqrt(1 - beta2**t).to(compute)

    new_master = master * (1 - lr * weight_decay)
    new_m = torch.lerp(exp_avg, g, 1 - beta1)
    new_v = exp_avg_sq * beta2 + (1 - beta2) * g * g
    denom = new_v.sqrt() / bias_correction2_sqrt + eps
    return new_master - step_size * new_m / denom, new_m, new_v


def reference(master, exp_avg, exp_avg_sq, grads, params, step, grad_multiplier, found_inf,
              lr, beta1, beta2, eps, weight_decay) -> None:
    """Plain torch, computed in ``master.dtype`` (float64 masters make it the test oracle)."""
    new_master, new_m, new_v = update(master, exp_avg, exp_avg_sq, grads, step, grad_multiplier,
                                      lr, beta1, beta2, eps, weight_decay)
    _checks.commit_step_(found_inf, [(master, new_master), (exp_avg, new_m), (exp_avg_sq, new_v)],
                         master, params, step)


adamw_step_ = Op(
    "adamw_step_",
    SCHEMA,
    check=_check,
    fake=_fake,
    reference=reference,
    triton="memkern.kernels.adamw.adamw_step_",
    compiled_kernels=True,
)
