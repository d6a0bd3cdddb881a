"""Triton kernel of ``memkern::adamw8bit_step_``: the AdamW step with block-wise 8-bit moments
(see memkern/ops/adamw8bit.py for the contract and the quantization map).

A program takes ``BLOCK`` elements as a ``[BLOCK // QBLOCK, QBLOCK]`` tile, one row per
quantization block (the format's helpers: :mod:`memkern.kernels.quantize8bit`): codes and
absmax in, dequantize, :func:`~memkern.kernels.adamw.adamw_update`, absmax and codes out,
master and the rounded params out, in one pass.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from memkern.kernels import _common
from memkern.kernels._common import round_to
from memkern.kernels.adamw import adamw_update, hyper_args
from memkern.kernels.quantize8bit import block_tile, dequantize, quantize
from memkern.kernels.state8bit import QBLOCK, num_blocks


@triton.jit
def _adamw8bit_kernel(
    master_ptr, exp_avg_ptr, exp_avg_absmax_ptr, exp_avg_sq_ptr, exp_avg_sq_absmax_ptr,
    grads_ptr, params_ptr, step_ptr, grad_multiplier_ptr, found_inf_ptr, n, n_blocks,
    lr_hi, lr_lo, beta1_hi, beta1_lo, beta2_hi, beta2_lo,
    decay, one_minus_beta1, beta2, one_minus_beta2, eps,
    HAS_PARAMS: tl.constexpr, HAS_MULTIPLIER: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
    LERP_SMALL_WEIGHT: tl.constexpr, BLOCK: tl.constexpr, QBLOCK: tl.constexpr,
):
    ROWS: tl.constexpr = BLOCK // QBLOCK
    rows, offs, row_mask, valid = block_tile(n, n_blocks, found_inf_ptr, HAS_FOUND_INF, ROWS,
                                             QBLOCK)

    g = tl.load(grads_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    if HAS_MULTIPLIER:
        g = g * tl.load(grad_multiplier_ptr)
    master = tl.load(master_ptr + offs, mask=valid, other=0.0)
    m = dequantize(tl.load(exp_avg_ptr + offs, mask=valid, other=0),
                   tl.load(exp_avg_absmax_ptr + rows, mask=row_mask, other=0.0), True)
    v = dequantize(tl.load(exp_avg_sq_ptr + offs, mask=valid, other=0),
                   tl.load(exp_avg_sq_absmax_ptr + rows, mask=row_mask, other=0.0), False)

    master, m, v = adamw_update(master, m, v, g, step_ptr, lr_hi, lr_lo, beta1_hi, beta1_lo,
                                beta2_hi, beta2_lo, decay, one_minus_beta1, beta2,
                                one_minus_beta2, eps, LERP_SMALL_WEIGHT)

    m_codes, m_absmax = quantize(m, valid, True)
    v_codes, v_absmax = quantize(v, valid, False)
    tl.store(master_ptr + offs, master, mask=valid)
    tl.store(exp_avg_ptr + offs, m_codes.to(tl.int8), mask=valid)
    tl.store(exp_avg_sq_ptr + offs, v_codes.to(tl.uint8), mask=valid)
    tl.store(exp_avg_absmax_ptr + rows, m_absmax, mask=row_mask)
    tl.store(exp_avg_sq_absmax_ptr + rows, v_absmax, mask=row_mask)
    if HAS_PARAMS:
        tl.store(params_ptr + offs, round_to(master, params_ptr.dtype.element_ty), mask=valid)


def adamw8bit_step_(master, exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax, grads,
                    params, step, grad_multiplier, found_inf, lr, beta1, beta2, eps,
                    weight_decay) -> None:
    op = "adamw8bit_step_"
    n = master.numel()
    blocks = num_blocks(n)
    _common.check_step_args(op, master, grads, params, step, grad_multiplier, found_inf)
    _common.check_buffer(op, "exp_avg", exp_avg, (torch.int8,), n)
    _common.check_buffer(op, "exp_avg_sq", exp_avg_sq, (torch.uint8,), n)
    _common.check_buffer(op, "exp_avg_absmax", exp_avg_absmax, _common.STATE_DTYPES, blocks)
    _common.check_buffer(op, "exp_avg_sq_absmax", exp_avg_sq_absmax, _common.STATE_DTYPES,
                         blocks)

    scalars, flags = hyper_args(lr, beta1, beta2, eps, weight_decay)
    with _common.device_guard(master):
        if n > 0:
            _adamw8bit_kernel[_common.grid(n)](
                master, exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax, grads,
                params if params is not None else master,
                step,
                grad_multiplier if grad_multiplier is not None else step,
                found_inf if found_inf is not None else step,
                n, blocks, *scalars,
                HAS_PARAMS=params is not None,
                HAS_MULTIPLIER=grad_multiplier is not None,
                HAS_FOUND_INF=found_inf is not None,
                BLOCK=_common.BLOCK, QBLOCK=QBLOCK,
                num_warps=_common.NUM_WARPS,
                **flags,
            )
        _common.advance_step_(step, found_inf)
