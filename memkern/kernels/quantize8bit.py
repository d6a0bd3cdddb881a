"""Triton side of the block-wise 8-bit optimizer-state format (:mod:`memkern.kernels.state8bit`;
map defined and justified in :mod:`memkern.ops.adamw8bit`), shared by every 8-bit optimizer
kernel: a program holds its elements as a ``[rows, QBLOCK]`` tile, one row per quantization
block, so a block's absmax is a row reduction in registers.
"""
from __future__ import annotations

import triton
import triton.language as tl

from memkern.kernels._common import load_splat
from memkern.kernels.state8bit import SIGNED_CODES, UNSIGNED_CODES

_SIGNED_CODES = tl.constexpr(SIGNED_CODES)
_UNSIGNED_CODES = tl.constexpr(UNSIGNED_CODES)


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
def _code_square(c, SIGNED: tl.constexpr):
    """``(|c| / C) ** 2`` of the float32 codes ``c``: the quantity a code is the nearest of
    (``|m| / absmax``, or ``sqrt(v / absmax)``)."""
    if SIGNED:
        q = tl.div_rn(tl.abs(c), tl.full(c.shape, _SIGNED_CODES, tl.float32))
    else:
        q = tl.div_rn(c, tl.full(c.shape, _UNSIGNED_CODES, tl.float32))
    return q * q


@triton.jit
def _relative_value(c, SIGNED: tl.constexpr):
    """``(|c| / C) ** p`` of the float32 codes ``c``: a code's value over its block's absmax
    (p = 2 for signed codes, 4 for unsigned ones)."""
    q2 = _code_square(c, SIGNED)
    if SIGNED:
        return q2
    return q2 * q2


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
    # the nearer of lo and lo + 1 (the lower one on a tie) in (|c| / C) ** 2: |m| / absmax, or
    # sqrt(v / absmax), the root the update divides by; as the reference
    if SIGNED:
        rounded = rel
        lo = tl.floor(tl.sqrt_rn(rel) * _SIGNED_CODES)
    else:
        rounded = tl.sqrt_rn(rel)
        lo = tl.floor(tl.sqrt_rn(rounded) * _UNSIGNED_CODES)
    above = rounded - _code_square(lo, SIGNED) > _code_square(lo + 1.0, SIGNED) - rounded
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
