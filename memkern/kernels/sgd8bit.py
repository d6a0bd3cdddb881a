"""Triton kernel of ``memkern::sgd8bit_step_``: the SGD step with a block-wise 8-bit momentum
buffer (see memkern/ops/sgd8bit.py for the contract; the map is AdamW's first moment's).

A program takes ``BLOCK`` elements as a ``[BLOCK // QBLOCK, QBLOCK]`` tile, one row per
quantization block (the format's helpers: :mod:`memkern.kernels.quantize8bit`): codes and
absmax in, dequantize, :func:`~memkern.kernels.sgd.sgd_update`, absmax and codes out, master
and the rounded params out, in one pass.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from memkern.kernels import _common
from memkern.kernels._common import load_splat, store_master_and_params
from memkern.kernels.quantize8bit import launch_qblock_step, load_qblocks, load_state, store_state
from memkern.kernels.sgd import sgd_update


@triton.jit
def _sgd8bit_kernel(
    master_ptr, codes_ptr, absmax_ptr, grads_ptr, params_ptr, step_ptr, grad_multiplier_ptr,
    found_inf_ptr, n, n_blocks, lr, momentum, one_minus_dampening, weight_decay,
    HAS_WEIGHT_DECAY: tl.constexpr, NESTEROV: tl.constexpr, HAS_PARAMS: tl.constexpr,
    HAS_MULTIPLIER: tl.constexpr, HAS_FOUND_INF: tl.constexpr, BLOCK: tl.constexpr,
    QBLOCK: tl.constexpr,
):
    rows, offs, row_mask, valid, grad, multiplier, master = load_qblocks(
        master_ptr, grads_ptr, grad_multiplier_ptr, found_inf_ptr, n, n_blocks, HAS_MULTIPLIER,
        HAS_FOUND_INF, BLOCK, QBLOCK)
    buf = load_state(codes_ptr, absmax_ptr, rows, offs, row_mask, valid, True)
    first = (load_splat(step_ptr, BLOCK // QBLOCK) == 0)[:, None]

    master, buf = sgd_update(master, buf, grad, multiplier, first, lr, momentum,
                             one_minus_dampening, weight_decay, True, HAS_WEIGHT_DECAY, NESTEROV)

    store_state(buf, codes_ptr, absmax_ptr, rows, offs, row_mask, valid, True)
    store_master_and_params(master, master_ptr, params_ptr, offs, valid, HAS_PARAMS)


def sgd8bit_step_(master, momentum_buffer, momentum_absmax, grads, params, step,
                  grad_multiplier, found_inf, lr, momentum, dampening, weight_decay,
                  nesterov) -> None:
    op = "sgd8bit_step_"
    if not momentum > 0.0:
        raise ValueError(f"memkern.{op} (triton): momentum must be > 0, got {momentum}; "
                         "use sgd_step_ without a momentum buffer")
    f32 = _common.f32
    launch_qblock_step(
        op, _sgd8bit_kernel, master,
        [("momentum_buffer", momentum_buffer, torch.int8, "momentum_absmax", momentum_absmax)],
        grads, params, step, grad_multiplier, found_inf,
        (f32(lr), f32(momentum), f32(1.0 - dampening), f32(weight_decay)),
        HAS_WEIGHT_DECAY=weight_decay != 0.0, NESTEROV=bool(nesterov))
