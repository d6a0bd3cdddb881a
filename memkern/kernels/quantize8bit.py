"""Triton side of the block-wise 8-bit optimizer-state format (:mod:`memkern.kernels.state8bit`;
map defined and justified in :mod:`memkern.ops.adamw8bit`), shared by every 8-bit optimizer
kernel: a program holds its elements as a ``[rows, QBLOCK]`` tile, one row per quantization
block, so a block's absmax is a row reduction in registers.

An 8-bit step kernel is :func:`load_qblocks` (the tile, gradients, master), :func:`load_state`
per moment, the optimizer's update, :func:`store_state` per moment and
``store_master_and_params``; :func:`launch_qblock_step` checks its arguments and launches it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from memkern.kernels import _common
from memkern.kernels._common import load_grads_and_master, load_splat
from memkern.kernels.state8bit import (
    QBLOCK,
    SIGNED_CODES,
    SIGNED_POWER,
    UNSIGNED_CODES,
    UNSIGNED_POWER,
    num_blocks,
)


@triton.jit
def block_tile(n, n_blocks, found_inf_ptr, HAS_FOUND_INF: tl.constexpr, ROWS: tl.constexpr,
               QBLOCK: tl.constexpr):
    """This program's ``ROWS`` quantization blocks: ``(rows, offs, row_mask, valid)``, the
    block indices, the ``[ROWS, QBLOCK]`` element offsets, the blocks and the elements that
    exist; both masks are off when ``found_inf`` is set (a skipped step writes nothing)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
    row_mask = rows < n_blocks
    valid = offs < n
    if HAS_FOUND_INF:
        skip = load_splat(found_inf_ptr, ROWS) != 0
        row_mask = row_mask & (skip == 0)
        valid = valid & (skip[:, None] == 0)
    return rows, offs, row_mask, valid


@triton.jit
def load_qblocks(master_ptr, grads_ptr, grad_multiplier_ptr, found_inf_ptr, n, n_blocks,
                 HAS_MULTIPLIER: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
                 BLOCK: tl.constexpr, QBLOCK: tl.constexpr):
    """This program's ``BLOCK`` elements as :func:`block_tile`'s ``(rows, offs, row_mask,
    valid)`` ``[BLOCK // QBLOCK, QBLOCK]`` tile, followed by its gradients, their multiplier
    and the float32 master weights (:func:`~memkern.kernels._common.load_grads_and_master`)."""
    rows, offs, row_mask, valid = block_tile(n, n_blocks, found_inf_ptr, HAS_FOUND_INF,
                                             BLOCK // QBLOCK, QBLOCK)
    grad, multiplier, master = load_grads_and_master(grads_ptr, grad_multiplier_ptr, master_ptr,
                                                     offs, valid, HAS_MULTIPLIER)
    return rows, offs, row_mask, valid, grad, multiplier, master


# Both directions as the CPU kernel computes them (csrc/cpu/state8bit.h, where the closed form
# is derived): products by per-row factors and one square root per code, no division per
# element (the reference's order of roundings took 10 correctly rounded divisions per element:
# the AdamW kernel compiled to 403 SASS instructions per element for sm_90, now 266;
# benchmarks/step_kernel_sass.py). Values agree with the reference's to a few ulp, codes but
# for a value within an ulp of a code boundary (the oracle tests' tolerance).
if (SIGNED_POWER, UNSIGNED_POWER) != (2, 4):
    raise ImportError(f"memkern.kernels.quantize8bit is written for the powers 2 and 4 of the "
                      f"8-bit format, not {SIGNED_POWER} and {UNSIGNED_POWER}")
_SIGNED_VALUE = tl.constexpr(2.0 ** 14 / SIGNED_CODES ** 2)  # (c |c| 2^-14) * absmax * this
_UNSIGNED_VALUE = tl.constexpr(2.0 ** 32 / UNSIGNED_CODES ** 4)  # ((c / 256)^2)^2 * absmax * this
_ROUND = tl.constexpr(1.5 * 2.0 ** 23)  # x + this - this: x rounded to an integer, ties to even
_TINY = tl.constexpr(2.0 ** -100)  # below it C^2 / absmax may overflow: scale by _TINY_SCALE
_TINY_SCALE = tl.constexpr(2.0 ** 64)
_SIGNED_SQUARES = tl.constexpr(float(SIGNED_CODES ** 2))
_UNSIGNED_SQUARES = tl.constexpr(float(UNSIGNED_CODES ** 2))


@triton.jit
def dequantize(codes, absmax, SIGNED: tl.constexpr):
    """float32 values of a ``[rows, QBLOCK]`` tile of ``codes`` (int8 when ``SIGNED``, else
    uint8) with one ``absmax`` per row: ``sign(c) (|c| / 127)^2 absmax`` as ``(c |c| 2^-14)``
    (exact) times ``absmax 2^14 / 127^2``, or ``(c / 255)^4 absmax`` as ``((c / 256)^2)^2``
    (the square exact) times ``absmax (256 / 255)^4``."""
    c = codes.to(tl.float32)
    if SIGNED:
        return ((c * tl.abs(c)) * (2.0 ** -14)) * (absmax * _SIGNED_VALUE)[:, None]
    q = c * (2.0 ** -8)
    q2 = q * q
    return (q2 * q2) * (absmax * _UNSIGNED_VALUE)[:, None]


@triton.jit
def quantize(x, valid, SIGNED: tl.constexpr):
    """``(codes as float32, absmax)`` of the rows of the float32 tile ``x`` (``valid``: the
    elements that exist; ``x >= 0`` unless ``SIGNED``); a row with a non-finite value gets NaN
    and zero codes, an all-zero row zero codes."""
    # one reduction per row for the absmax and the non-finite test: the largest |x| as integer
    # bits, where inf and NaN order above every finite value
    a = tl.where(valid, tl.abs(x), 0.0)
    largest = tl.max(a.to(tl.int32, bitcast=True), axis=1)
    any_bad = largest >= 0x7F800000
    scale = largest.to(tl.float32, bitcast=True)
    usable = (any_bad == 0) & (largest > 0)
    divisor = tl.where(usable, scale, 1.0)
    # y in [0, C^2], the quantity whose nearest k^2 is the code: C^2 |m| / absmax (below
    # 2^-100 C^2 / absmax could overflow, so |m| and absmax are scaled by 2^64 first, exactly),
    # or C^2 sqrt(v) / sqrt(absmax), the root the update divides by; one division per row
    if SIGNED:
        pre = tl.where(divisor < _TINY, _TINY_SCALE, 1.0)
        factor = tl.div_rn(tl.full(divisor.shape, _SIGNED_SQUARES, tl.float32), divisor * pre)
        y = (a * pre[:, None]) * factor[:, None]
    else:
        factor = tl.div_rn(tl.full(divisor.shape, _UNSIGNED_SQUARES, tl.float32),
                           tl.sqrt_rn(divisor))
        y = tl.sqrt_rn(a) * factor[:, None]
    # the k whose k^2 is nearest to y: the midpoint of k^2 and (k + 1)^2 is (k + 1/2)^2 + 1/4
    c = (tl.sqrt_rn(tl.abs(y - 0.25)) + _ROUND) - _ROUND
    c = tl.where(usable[:, None], c, 0.0)
    if SIGNED:
        c = tl.where(x < 0, -c, c)
    nan = tl.full(scale.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    return c, tl.where(any_bad, nan, scale)


@triton.jit
def load_state(codes_ptr, absmax_ptr, rows, offs, row_mask, valid, SIGNED: tl.constexpr):
    """One 8-bit state buffer's float32 ``[rows, QBLOCK]`` tile (:func:`block_tile`'s
    ``rows, offs, row_mask, valid``): its codes at ``offs``, its absmax at ``rows``."""
    return dequantize(tl.load(codes_ptr + offs, mask=valid, other=0),
                      tl.load(absmax_ptr + rows, mask=row_mask, other=0.0), SIGNED)


@triton.jit
def store_state(x, codes_ptr, absmax_ptr, rows, offs, row_mask, valid, SIGNED: tl.constexpr):
    """The float32 tile ``x`` quantized into one 8-bit state buffer (int8 codes when
    ``SIGNED``, else uint8) and its absmax, as :func:`load_state` reads them."""
    codes, absmax = quantize(x, valid, SIGNED)
    if SIGNED:
        tl.store(codes_ptr + offs, codes.to(tl.int8), mask=valid)
    else:
        tl.store(codes_ptr + offs, codes.to(tl.uint8), mask=valid)
    tl.store(absmax_ptr + rows, absmax, mask=row_mask)


def launch_qblock_step(op: str, kernel, master: torch.Tensor,
                       moments: list[tuple[str, torch.Tensor, torch.dtype, str, torch.Tensor]],
                       grads: torch.Tensor, params: torch.Tensor | None, step: torch.Tensor,
                       grad_multiplier: torch.Tensor | None, found_inf: torch.Tensor | None,
                       scalars: tuple, **constexprs) -> None:
    """Checks the arguments of 8-bit step op ``op`` and runs its ``kernel``, then advances
    ``step`` (unless ``found_inf`` is set).

    ``moments``: per moment ``(codes name, codes, codes dtype, absmax name, absmax)``. The
    kernel takes ``(master, codes, absmax, ... per moment, grads, params, step,
    grad_multiplier, found_inf, n, n_blocks, *scalars)`` and the constexprs ``HAS_PARAMS``,
    ``HAS_MULTIPLIER``, ``HAS_FOUND_INF``, ``BLOCK``, ``QBLOCK`` and ``constexprs``."""
    n = master.numel()
    blocks = num_blocks(n)
    _common.check_step_args(op, master, grads, params, step, grad_multiplier, found_inf)
    state = []
    for codes_name, codes, codes_dtype, absmax_name, absmax in moments:
        _common.check_buffer(op, codes_name, codes, (codes_dtype,), n)
        _common.check_buffer(op, absmax_name, absmax, _common.STATE_DTYPES, blocks)
        state += [codes, absmax]
    step_args, step_flags = _common.step_pointers(master, params, step, grad_multiplier, found_inf)
    with _common.device_guard(master):
        if n > 0:
            kernel[_common.grid(n)](
                master, *state, grads, *step_args, n, blocks, *scalars,
                **step_flags, BLOCK=_common.BLOCK, QBLOCK=QBLOCK,
                num_warps=_common.NUM_WARPS, **constexprs,
            )
        _common.advance_step_(step, found_inf)
