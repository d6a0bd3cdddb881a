"""Triton kernel of ``memkern::sgd_step_``: one fused SGD step over flat buffers (see
memkern/ops/sgd.py for the contract). The math is csrc/math/sgd.h's, the CPU and CUDA
kernels': the same operations in the same order, each product that feeds a sum fused with it
(``tl.fma``), so the three backends give the same bits.

``step`` (for the first-step rule of the momentum buffer), ``grad_multiplier`` and
``found_inf`` are read on the device; a set ``found_inf`` masks off every load and store. A
second one-program kernel advances ``step`` after the main kernel has read it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from memkern.kernels import _common
from memkern.kernels._common import load_grads_and_master, load_splat, store_master_and_params


@triton.jit
def sgd_update(master, buf, grad, multiplier, first, lr, momentum, one_minus_dampening,
               weight_decay, HAS_MOMENTUM: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr,
               NESTEROV: tl.constexpr):
    """csrc/math/sgd.h's ``sgd_element`` on float32 blocks, from the raw gradient and its
    multiplier: returns the new master and momentum buffer (``buf`` unchanged without momentum;
    ``first``: the step counter is 0, when torch starts the buffer from ``d``). A term that is
    off is skipped (0 * inf would make an inf master NaN). Shared with the 8-bit kernel
    (memkern/kernels/sgd8bit.py)."""
    d = grad * multiplier
    if HAS_WEIGHT_DECAY:
        d = tl.fma(tl.cast(weight_decay, tl.float32), master, d)
    if HAS_MOMENTUM:
        momentum = tl.cast(momentum, tl.float32)
        buf = tl.where(first, d, tl.fma(momentum, buf,
                                        tl.cast(one_minus_dampening, tl.float32) * d))
        if NESTEROV:
            d = tl.fma(momentum, buf, d)
        else:
            d = buf
    return tl.fma(-tl.cast(lr, tl.float32), d, master), buf


@triton.jit
def _sgd_kernel(
    master_ptr, momentum_buffer_ptr, grads_ptr, params_ptr,
    step_ptr, grad_multiplier_ptr, found_inf_ptr, n,
    lr, momentum, one_minus_dampening, weight_decay,
    HAS_MOMENTUM: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr, NESTEROV: tl.constexpr,
    HAS_PARAMS: tl.constexpr, HAS_MULTIPLIER: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if HAS_FOUND_INF:
        mask = mask & (load_splat(found_inf_ptr, BLOCK) == 0)

    grad, multiplier, master = load_grads_and_master(grads_ptr, grad_multiplier_ptr, master_ptr,
                                                     offs, mask, HAS_MULTIPLIER)
    buf = master  # a placeholder without momentum: sgd_update neither reads nor changes it
    first = load_splat(step_ptr, BLOCK) == 0
    if HAS_MOMENTUM:
        buf = tl.load(momentum_buffer_ptr + offs, mask=mask, other=0.0)
    master, buf = sgd_update(master, buf, grad, multiplier, first, lr, momentum,
                             one_minus_dampening, weight_decay, HAS_MOMENTUM, HAS_WEIGHT_DECAY,
                             NESTEROV)
    if HAS_MOMENTUM:
        tl.store(momentum_buffer_ptr + offs, buf, mask=mask)

    store_master_and_params(master, master_ptr, params_ptr, offs, mask, HAS_PARAMS)


def sgd_step_(master, momentum_buffer, grads, params, step, grad_multiplier, found_inf,
              lr, momentum, dampening, weight_decay, nesterov) -> None:
    op = "sgd_step_"
    n = master.numel()
    _common.check_buffer(op, "master", master, _common.STATE_DTYPES)
    has_momentum = momentum != 0.0
    if has_momentum:
        if momentum_buffer is None:
            raise ValueError(f"memkern.{op} (triton): momentum={momentum} needs a momentum_buffer")
        _common.check_buffer(op, "momentum_buffer", momentum_buffer, _common.STATE_DTYPES, n)
    _common.check_buffer(op, "grads", grads, _common.GRAD_DTYPES, n)
    if params is not None:
        _common.check_buffer(op, "params", params, _common.GRAD_DTYPES, n)
    for name, t in (("step", step), ("grad_multiplier", grad_multiplier), ("found_inf", found_inf)):
        _common.check_scalar(op, name, t, master.device)

    step_args, step_flags = _common.step_pointers(master, params, step, grad_multiplier, found_inf)
    with _common.device_guard(master):
        if n > 0:
            _sgd_kernel[_common.grid(n)](
                master, momentum_buffer if has_momentum else master, grads, *step_args,
                n,
                _common.f32(lr), _common.f32(momentum), _common.f32(1.0 - dampening),
                _common.f32(weight_decay),
                HAS_MOMENTUM=has_momentum,
                HAS_WEIGHT_DECAY=weight_decay != 0.0,
                NESTEROV=bool(nesterov),
                **step_flags,
                BLOCK=_common.BLOCK,
                num_warps=_common.NUM_WARPS,
            )
        _common.advance_step_(step, found_inf)
