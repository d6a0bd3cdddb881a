"""Triton kernel of ``memkern::adamw_step_``: one fused AdamW step over flat buffers (see
memkern/ops/adamw.py for the contract). The math is csrc/math/adamw.h's, the CPU and CUDA
kernels': the same operations in the same order (one division per element, each product that
feeds a sum fused with it by ``tl.fma``), so the backends agree bit for bit but for the step's
float64 factors, whose ``beta ** t`` is computed here by repeated squaring (the C library's
``pow`` may differ in the last double bit, which the rounding to float32 almost always
removes).

One pass reads grads, master, m and v, and writes master, m, v and (optionally) the low-
precision params rounded from the new master. ``step``, ``grad_multiplier`` and
``found_inf`` are read on the device; when ``found_inf`` is set every load and store is
masked off, so a skipped step touches nothing. The bias corrections ``1 - beta**t`` are
computed per program in float64 from the step read from memory (``lr``, ``eps`` and ``beta``
passed as float32 ``hi + lo`` pairs: float32 alone would put a relative error of ~1e-5 on
``1 - 0.999``). A
second one-program kernel advances ``step`` after the main kernel has read it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from memkern.kernels import _common
from memkern.kernels._common import (
    load_grads_and_master,
    load_splat,
    pow_f64,
    store_master_and_params,
)


@triton.jit
def adamw_update(master, m, v, grad, multiplier, step_ptr, lr_hi, lr_lo, beta1_hi, beta1_lo,
                 beta2_hi, beta2_lo, eps_hi, eps_lo, decay, lerp_factor, beta2, one_minus_beta2,
                 LERP_SMALL_WEIGHT: tl.constexpr):
    """csrc/math/adamw.h's ``adamw_element`` on float32 blocks, from the raw gradient and its
    multiplier: returns the new ``(master, m, v)``. The scalars are :func:`hyper_args`'s;
    ``t = step + 1`` is read from ``step_ptr``."""
    # adamw_set_step: the step's factors in float64, rounded once to float32.
    t = (tl.load(step_ptr) + 1.0).to(tl.int64)
    lr = tl.cast(lr_hi, tl.float64) + tl.cast(lr_lo, tl.float64)
    eps = tl.cast(eps_hi, tl.float64) + tl.cast(eps_lo, tl.float64)
    beta1_t = pow_f64(tl.cast(beta1_hi, tl.float64) + tl.cast(beta1_lo, tl.float64), t)
    beta2_t = pow_f64(tl.cast(beta2_hi, tl.float64) + tl.cast(beta2_lo, tl.float64), t)
    bias_correction2_sqrt = tl.sqrt(1.0 - beta2_t)
    scaled_step_size = (lr * bias_correction2_sqrt / (1.0 - beta1_t)).to(tl.float32)
    scaled_eps = (eps * bias_correction2_sqrt).to(tl.float32)

    # adamw_moments: torch.lerp's two formulas, chosen by |1 - beta1| < 0.5
    g = grad * multiplier
    g_minus_m = tl.fma(grad, multiplier, -m)
    if LERP_SMALL_WEIGHT:
        m = tl.fma(lerp_factor, g_minus_m, m)
    else:
        m = tl.fma(lerp_factor, g_minus_m, g)
    v = tl.fma(one_minus_beta2 * g, g, v * beta2)
    # adamw_master: one division
    step = tl.div_rn(scaled_step_size * m, tl.sqrt_rn(v) + scaled_eps)
    return tl.fma(master, decay, -step), m, v


def hyper_args(lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float) -> tuple[list[float], dict[str, bool]]:
    """:func:`adamw_update`'s scalar arguments from the op's hyper-parameters, rounded as
    ``adamw_coefficients`` (csrc/math/adamw.h) rounds them, and its ``LERP_SMALL_WEIGHT``
    flag."""
    w = _common.f32(1.0 - beta1)
    small = abs(w) < 0.5
    scalars = [*_common.split_f64(lr), *_common.split_f64(beta1), *_common.split_f64(beta2),
               *_common.split_f64(eps), _common.f32(1.0 - lr * weight_decay),
               w if small else _common.f32(w - 1.0), _common.f32(beta2), _common.f32(1.0 - beta2)]
    return scalars, {"LERP_SMALL_WEIGHT": small}


@triton.jit
def _adamw_kernel(
    master_ptr, exp_avg_ptr, exp_avg_sq_ptr, grads_ptr, params_ptr,
    step_ptr, grad_multiplier_ptr, found_inf_ptr, n,
    lr_hi, lr_lo, beta1_hi, beta1_lo, beta2_hi, beta2_lo, eps_hi, eps_lo,
    decay, lerp_factor, beta2, one_minus_beta2,
    HAS_PARAMS: tl.constexpr, HAS_MULTIPLIER: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
    LERP_SMALL_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if HAS_FOUND_INF:
        mask = mask & (load_splat(found_inf_ptr, BLOCK) == 0)

    grad, multiplier, master = load_grads_and_master(grads_ptr, grad_multiplier_ptr, master_ptr,
                                                     offs, mask, HAS_MULTIPLIER)
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)

    master, m, v = adamw_update(master, m, v, grad, multiplier, step_ptr, lr_hi, lr_lo,
                                beta1_hi, beta1_lo, beta2_hi, beta2_lo, eps_hi, eps_lo, decay,
                                lerp_factor, beta2, one_minus_beta2, LERP_SMALL_WEIGHT)

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
