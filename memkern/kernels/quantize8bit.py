"""Triton side of the block-wise 8-bit optimizer-state format (:mod:`memkern.kernels.state8bit`;
map defined and justified in :mod:`memkern.ops.adamw8bit`), shared by every 8-bit optimizer
kernel: a program holds its elements as a ``[rows, QBLOCK]`` tile, one row per quantization
block, so a block's absmax is a row reduction in registers.
"""
from __future__ import annotations

import triton
import triton.language as tl

from memkern.kernels._common import load_splat
from memkern.kernels.state8bit import (SIGNED_CODES, SIGNED_POWER, UNSIGNED_CODES,
                                       UNSIGNED_POWER)

_SIGNED_CODES = tl.constexpr(SIGNED_CODES)
_SIGNED_POWER = tl.constexpr(SIGNED_POWER)
_UNSIGNED_CODES = tl.constexpr(UNSIGNED_CODES)
_UNSIGNED_POWER = tl.constexpr(UNSIGNED_POWER)


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
def _power_of(q, POWER: tl.constexpr):
    q = q * q
    if POWER == 4:
        q = q * q
    return q


@triton.jit
def _relative_value(c, SIGNED: tl.constexpr):
    """``(|c| / C) ** p`` of the float32 codes ``c``: a code's value over its block's absmax."""
    if SIGNED:
        return _power_of(tl.div_rn(tl.abs(c), tl.full(c.shape, _SIGNED_CODES, tl.float32)),
                         _SIGNED_POWER)
    return _power_of(tl.div_rn(c, tl.full(c.shape, _UNSIGNED_CODES, tl.float32)),
                     _UNSIGNED_POWER)


@triton.jit
def dequantize(codes, absmax, SIGNED: tl.constexpr):
    """float32 values of a ``[rows, QBLOCK]`` tile of ``codes`` (int8 when ``SIGNED``, else
    uint8) with one ``absmax`` per row."""
    c = codes.to(tl.float32)
    x = _relative_value(c, SIGNED) * absmax[:, None]
    if SIGNED:
        x = tl.where(c < 0, -x, x)
    return x


@triton.jit
def quantize(x, valid, SIGNED: tl.constexpr):
    """``(codes as float32, absmax)`` of the rows of the float32 tile ``x`` (``valid``: the
    elements that exist; ``x >= 0`` unless ``SIGNED``); a row with a non-finite value gets NaN
    and zero codes, an all-zero row zero codes."""
    a = tl.abs(x)
    finite = a <= 3.4028234663852886e38  # false for inf and NaN
    a = tl.where(valid & finite, a, 0.0)
    scale = tl.max(a, axis=1)
    any_bad = tl.max(tl.where(valid & (finite == 0), 1, 0), axis=1) > 0
    usable = (any_bad == 0) & (scale > 0)
    rel = tl.div_rn(a, tl.where(usable, scale, 1.0)[:, None])
    r = tl.sqrt_rn(rel)
    if SIGNED:
        lo = tl.floor(r * _SIGNED_CODES)
    else:
        lo = tl.floor(tl.sqrt_rn(r) * _UNSIGNED_CODES)
    # the code of nearer value of lo and lo + 1 (the lower one on a tie), as the reference
    above = rel - _relative_value(lo, SIGNED) > _relative_value(lo + 1.0, SIGNED) - rel
    c = tl.where(usable[:, None], tl.where(above, lo + 1.0, lo), 0.0)
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
