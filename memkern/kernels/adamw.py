"""Triton kernel of ``memkern::adamw_step_``: one fused AdamW step over flat buffers (see
memkern/ops/adamw.py for the contract; the math is ``torch.optim.AdamW``'s, in its order).

One pass reads grads, master, m and v, and writes master, m, v and (optionally) the low-
precision params rounded from the new master. ``step``, ``grad_multiplier`` and
``found_inf`` are read on the device; when ``found_inf`` is set every load and store is
masked off, so a skipped step touches nothing. The bias corrections ``1 - beta**t`` are
computed per program in float64 from the step read from memory (``beta`` passed as a float32
``hi + lo`` pair: float32 alone would put a relative error of ~1e-5 on ``1 - 0.999``). A
second one-program kernel advances ``step`` after the main kernel has read it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from memkern.kernels import _common
from memkern.kernels._common import (load_grads_and_master, load_splat, pow_f64,
                                     store_master_and_params)


@triton.jit
def adamw_update(master, m, v, g, step_ptr, lr_hi, lr_lo, beta1_hi, beta1_lo, beta2_hi, beta2_lo,
                 decay, one_minus_beta1, beta2, one_minus_beta2, eps,
                 LERP_SMALL_WEIGHT: tl.constexpr):
    """The AdamW math on float32 blocks: returns the new ``(master, m, v)``. The scalars are
    :func:`hyper_args`'s; ``t = step + 1`` is read from ``step_ptr``."""
    # Scalars (the same in every program). t = step + 1, a whole number.
    t = (tl.load(step_ptr) + 1.0).to(tl.int64)
    lr = tl.cast(lr_hi, tl.float64) + tl.cast(lr_lo, tl.float64)
    bias_correction1 = 1.0 - pow_f64(tl.cast(beta1_hi, tl.float64) + tl.cast(beta1_lo, tl.float64), t)
    bias_correction2 = 1.0 - pow_f64(tl.cast(beta2_hi, tl.float64) + tl.cast(beta2_lo, tl.float64), t)
    step_size = (lr / bias_correction1).to(tl.float32)
    bias_correction2_sqrt = tl.sqrt(bias_correction2).to(tl.float32)
    decay = tl.cast(decay, tl.float32)
    w = tl.cast(one_minus_beta1, tl.float32)
    beta2 = tl.cast(beta2, tl.float32)
    one_minus_beta2 = tl.cast(one_minus_beta2, tl.float32)
    eps = tl.cast(eps, tl.float32)

    master = master * decay
    if LERP_SMALL_WEIGHT:  # torch.lerp's two formulas, chosen by |weight| < 0.5
        m = m + w * (g - m)
    else:
        m = g - (g - m) * (1.0 - w)
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    master = master - step_size * tl.div_rn(m, denom)
    return master, m, v


def hyper_args(lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float) -> tuple[list[float], dict[str, bool]]:
    """:func:`adamw_update`'s scalar arguments from the op's hyper-parameters, and its
    ``LERP_SMALL_WEIGHT`` flag."""
    w = _common.f32(1.0 - beta1)
    scalars = [*_common.split_f64(lr), *_common.split_f64(beta1), *_common.split_f64(beta2),
               _common.f32(1.0 - lr * weight_decay), w, _common.f32(beta2),
               _common.f32(1.0 - beta2), _common.f32(eps)]
    return scalars, {"LERP_SMALL_WEIGHT": abs(w) < 0.5}


@triton.jit
def _adamw_kernel(
    master_ptr, exp_avg_ptr, exp_avg_sq_ptr, grads_ptr, params_ptr,
    step_ptr, grad_multiplier_ptr, found_inf_ptr, n,
    lr_hi, lr_lo, beta1_hi, beta1_lo, beta2_hi, beta2_lo,
    decay, one_minus_beta1, beta2, one_minus_beta2, eps,
    HAS_PARAMS: tl.constexpr, HAS_MULTIPLIER: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
    LERP_SMALL_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if HAS_FOUND_INF:
        mask = mask & (load_splat(found_inf_ptr, BLOCK) == 0)

    g, master = load_grads_and_master(grads_ptr, grad_multiplier_ptr, master_ptr, offs, mask,
                                      HAS_MULTIPLIER)
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)

    master, m, v = adamw_update(master, m, v, g, step_ptr, lr_hi, lr_lo, beta1_hi, beta1_lo,
                                beta2_hi, beta2_lo, decay, one_minus_beta1, beta2,
                                one_minus_beta2, eps, LERP_SMALL_WEIGHT)

    tl.store(exp_avg_ptr + offs, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
    store_master_and_params(master, master_ptr, params_ptr, offs, mask, HAS_PARAMS)


def adamw_step_(master, exp_avg, exp_avg_sq, grads, params, step, grad_multiplier, found_inf,
                lr, beta1, beta2, eps, weight_decay) -> None:
    op = "adamw_step_"
    n = master.numel()
    _common.check_step_args(op, master, grads, params, step, grad_multiplier, found_inf)
    _common.check_buffer(op, "exp_avg", exp_avg, _common.STATE_DTYPES, n)
    _common.check_buffer(op, "exp_avg_sq", exp_avg_sq, _common.STATE_DTYPES, n)

    scalars, flags = hyper_args(lr, beta1, beta2, eps, weight_decay)
    step_args, step_flags = _common.step_pointers(master, params, step, grad_multiplier, found_inf)
    with _common.device_guard(master):
        if n > 0:
            _adamw_kernel[_common.grid(n)](
                master, exp_avg, exp_avg_sq, grads, *step_args,
                n, *scalars,
                **step_flags,
                BLOCK=_common.BLOCK,
                num_warps=_common.NUM_WARPS,
                **flags,
            )
        _common.advance_step_(step, found_inf)
