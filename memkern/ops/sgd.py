"""``memkern::sgd_step_``: one fused, mixed-precision SGD step over flat buffers.

Arguments (all 1-D contiguous buffers of the same length on one device)
    master           float32 master weights, updated in place.
    momentum_buffer  float32, updated in place; required when ``momentum != 0``, else None.
    grads            float32/bfloat16/float16 gradients (read only).
    params           optional float32/bfloat16/float16 model weights, overwritten with
                     ``round(master)`` in the same pass.
    step             one-element float32 step counter, advanced by one in place; the momentum
                     buffer is initialised from the gradient when it is 0, as torch does.
    grad_multiplier  optional one-element float32 gradient multiplier.
    found_inf        optional one-element float32: when non-zero nothing at all is written.
    lr, momentum, dampening, weight_decay, nesterov   as ``torch.optim.SGD``.

The math is ``torch.optim.SGD``'s::

    d = float32(grads) * grad_multiplier + weight_decay * master
    if momentum != 0:
        buf = d                                   if step == 0
              momentum * buf + (1 - dampening) * d otherwise
        d   = d + momentum * buf if nesterov else buf
    master = master - lr * d;  params = round(master);  step = step + 1

A term that is off (``weight_decay == 0``, no momentum) is not computed: an infinite master
stays infinite, as in torch. The reference (:func:`update`) follows ``torch.optim.SGD``'s order
of operations, each product and sum rounded; in float64 it is the tests' oracle. The compiled
backends — CPU, CUDA and Triton alike — follow csrc/math/sgd.h's, which rounds each product
that feeds a sum together with it (an fma): they agree with each other bit for bit and with
torch within an ulp per operation (tests/test_flat_ops.py).
"""
from __future__ import annotations

import torch

from memkern.ops import _checks
from memkern.ops._registry import Op

SCHEMA = (
    "(Tensor(a!) master, Tensor(b!)? momentum_buffer, Tensor grads, Tensor(c!)? params, "
    "Tensor(d!) step, Tensor? grad_multiplier, Tensor? found_inf, float lr, float momentum, "
    "float dampening, float weight_decay, bool nesterov) -> ()"
)


def _check(master, momentum_buffer, grads, params, step, grad_multiplier, found_inf,
           lr, momentum, dampening, weight_decay, nesterov, op: str = "sgd_step_") -> torch.device:
    """``op``: the op named in the errors (``sgd8bit_step_`` checks its common arguments
    here)."""
    _checks.flat(op, "master", master, (torch.float32, torch.float64))
    if momentum != 0.0:
        if momentum_buffer is None:
            raise ValueError(f"memkern.{op}: momentum={momentum} needs a momentum_buffer")
        _checks.flat(op, "momentum_buffer", momentum_buffer, (master.dtype,), like=master)
    _checks.step_inputs(op, master, grads, params, step, grad_multiplier, found_inf)
    if lr < 0.0 or momentum < 0.0 or weight_decay < 0.0:
        raise ValueError(
            f"memkern.{op}: lr, momentum and weight_decay must be >= 0, got lr={lr}, "
            f"momentum={momentum}, weight_decay={weight_decay}"
        )
    if nesterov and (momentum <= 0.0 or dampening != 0.0):
        raise ValueError(f"memkern.{op}: nesterov needs momentum > 0 and dampening == 0")
    return master.device


def _fake(*args) -> None:
    _check(*args)


def update(master, momentum_buffer, grads, step, grad_multiplier, lr, momentum, dampening,
           weight_decay, nesterov) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The SGD math in plain torch, in ``master.dtype`` and in ``torch.optim.SGD``'s order of
    operations (not csrc/math/sgd.h's; see the module docstring): returns the new master and
    momentum buffer (None without momentum); nothing is written. Shared by this op's reference
    and the 8-bit one's."""
    compute = master.dtype
    d = grads.to(compute)
    if grad_multiplier is not None:
        d = d * grad_multiplier.reshape(()).to(compute)
    if weight_decay != 0.0:
        d = d + weight_decay * master
    new_buf = None
    if momentum != 0.0:
        first = step.reshape(()) == 0
        new_buf = torch.where(first, d, momentum * momentum_buffer + (1 - dampening) * d)
        d = d + momentum * new_buf if nesterov else new_buf
    return master - lr * d, new_buf


def reference(master, momentum_buffer, grads, params, step, grad_multiplier, found_inf,
              lr, momentum, dampening, weight_decay, nesterov) -> None:
    """Plain torch, computed in ``master.dtype`` (float64 masters make it the test oracle)."""
    new_master, new_buf = update(master, momentum_buffer, grads, step, grad_multiplier, lr,
                                 momentum, dampening, weight_decay, nesterov)
    updates = [] if new_buf is None else [(momentum_buffer, new_buf)]
    updates.append((master, new_master))
    _checks.commit_step_(found_inf, updates, master, params, step)


sgd_step_ = Op(
    "sgd_step_",
    SCHEMA,
    check=_check,
    fake=_fake,
    reference=reference,
    triton="memkern.kernels.sgd.sgd_step_",
    compiled_kernels=True,
)
