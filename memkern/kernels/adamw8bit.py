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

from memkern.kernels._common import store_master_and_params
from memkern.kernels.adamw import adamw_update, hyper_args
from memkern.kernels.quantize8bit import launch_qblock_step, load_qblocks, load_state, store_state


@triton.jit
def _adamw8bit_kernel(
    master_ptr, exp_avg_ptr, exp_avg_absmax_ptr, exp_avg_sq_ptr, exp_avg_sq_absmax_ptr,
    grads_ptr, params_ptr, step_ptr, grad_multiplier_ptr, found_inf_ptr, n, n_blocks,
    lr_hi, lr_lo, beta1_hi, beta1_lo, beta2_hi, beta2_lo, eps_hi, eps_lo,
    decay, lerp_factor, beta2, one_minus_beta2,
    HAS_PARAMS: tl.constexpr, HAS_MULTIPLIER: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
    LERP_SMALL_WEIGHT: tl.constexpr, BLOCK: tl.constexpr, QBLOCK: tl.constexpr,
):
    rows, offs, row_mask, valid, grad, multiplier, master = load_qblocks(
        master_ptr, grads_ptr, grad_multiplier_ptr, found_inf_ptr, n, n_blocks, HAS_MULTIPLIER,
        HAS_FOUND_INF, BLOCK, QBLOCK)
    m = load_state(exp_avg_ptr, exp_avg_absmax_ptr, rows, offs, row_mask, valid, True)
    v = load_state(exp_avg_sq_ptr, exp_avg_sq_absmax_ptr, rows, offs, row_mask, valid, False)

    master, m, v = adamw_update(master, m, v, grad, multiplier, step_ptr, lr_hi, lr_lo,
                                beta1_hi, beta1_lo, beta2_hi, beta2_lo, eps_hi, eps_lo, decay,
                                lerp_factor, beta2, one_minus_beta2, LERP_SMALL_WEIGHT)

    store_state(m, exp_avg_ptr, exp_avg_absmax_ptr, rows, offs, row_mask, valid, True)
    store_state(v, exp_avg_sq_ptr, exp_avg_sq_absmax_ptr, rows, offs, row_mask, valid, False)
    store_master_and_params(master, master_ptr, params_ptr, offs, valid, HAS_PARAMS)


def adamw8bit_step_(master, exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax, grads,
                    params, step, grad_multiplier, found_inf, lr, beta1, beta2, eps,
                    weight_decay) -> None:
    scalars, flags = hyper_args(lr, beta1, beta2, eps, weight_decay)
    launch_qblock_step(
        "adamw8bit_step_", _adamw8bit_kernel, master,
        [("exp_avg", exp_avg, torch.int8, "exp_avg_absmax", exp_avg_absmax),
         ("exp_avg_sq", exp_avg_sq, torch.uint8, "exp_avg_sq_absmax", exp_avg_sq_absmax)],
        grads, params, step, grad_multiplier, found_inf, scalars, **flags)
