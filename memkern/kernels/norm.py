"""Triton kernels of ``memkern::norm_forward`` / ``memkern::norm_backward`` (memkern/ops/norm.py).

Forward: one program per row (the whole row in one block, so ``D <= MAX_D``), statistics in
float32. Backward: ``G`` programs each take a contiguous range of rows, write ``dx`` row by row
and keep running ``sum(dy * xhat)`` / ``sum(dy)`` in registers, stored as one partial row each;
the ``[G, D]`` partials are summed with torch. Wider rows fall back to the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from memkern.kernels import _nn_common as C
from memkern.kernels._common import round_to
from memkern.ops.norm import backward_reference, forward_reference

MAX_D = 65536


@triton.jit
def _forward_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, D, eps,
                    RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        xm = x
    else:
        mean = tl.sum(x, axis=0) / D
        xm = tl.where(mask, x - mean, 0.0)
        tl.store(mean_ptr + row, mean)
    rstd = 1.0 / tl.sqrt(tl.sum(xm * xm, axis=0) / D + eps)
    tl.store(rstd_ptr + row, rstd)
    y = xm * rstd
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * D + cols, round_to(y, y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr,
                     rows, D, rows_per_program,
                     RMS: tl.constexpr, HAS_W: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    start = pid * rows_per_program
    stop = tl.minimum(start + rows_per_program, rows)
    for r in range(start, stop):
        row = tl.full((), 0, tl.int64) + r  # int64 offsets (r is a Python int when interpreted)
        x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        if RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(mask, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
        if HAS_W:
            g = dy * w
        else:
            g = dy
        c1 = tl.sum(g * xhat, axis=0) / D
        if RMS:
            dx = (g - xhat * c1) * rstd
        else:
            c2 = tl.sum(g, axis=0) / D
            dx = (g - xhat * c1 - c2) * rstd
        tl.store(dx_ptr + row * D + cols, round_to(dx, dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
        db_acc += dy
    if HAS_W:
        tl.store(dw_ptr + pid * D + cols, dw_acc, mask=mask)
        tl.store(db_ptr + pid * D + cols, db_acc, mask=mask)


def norm_forward(x, weight, bias, eps, rms):
    C.check("norm_forward", "x", x)
    rows, D = x.shape
    if D > MAX_D:
        return forward_reference(x, weight, bias, eps, rms)
    y = torch.empty_like(x)
    mean = x.new_empty((0 if rms else rows,), dtype=torch.float32)
    rstd = x.new_empty((rows,), dtype=torch.float32)
    if rows and D:
        with C.device_guard(x):
            _forward_kernel[(rows,)](
                x, weight if weight is not None else x, bias if bias is not None else x,
                y, mean if not rms else rstd, rstd, D, eps,
                RMS=rms, HAS_W=weight is not None, HAS_B=bias is not None,
                BLOCK_D=triton.next_power_of_2(D), num_warps=_warps(D),
            )
    return y, mean, rstd


def norm_backward(dy, x, weight, mean, rstd, rms):
    C.check("norm_backward", "x", x)
    C.check("norm_backward", "dy", dy)
    rows, D = x.shape
    if D > MAX_D:
        return backward_reference(dy, x, weight, mean, rstd, rms)
    dx = torch.empty_like(x)
    programs = max(1, min(rows, 4 * _sm_count(x)))
    rows_per_program = triton.cdiv(rows, programs) if rows else 1
    programs = triton.cdiv(rows, rows_per_program) if rows else 0
    has_w = weight is not None
    partial = x.new_empty((programs if has_w else 0, D), dtype=torch.float32)
    partial_b = torch.empty_like(partial)
    if programs and D:
        with C.device_guard(x):
            _backward_kernel[(programs,)](
                dy, x, weight if has_w else x, mean if not rms else rstd, rstd, dx,
                partial if has_w else dx, partial_b if has_w else dx,
                rows, D, rows_per_program, RMS=rms, HAS_W=has_w,
                BLOCK_D=triton.next_power_of_2(D), num_warps=_warps(D),
            )
    if not has_w:
        return dx, x.new_empty((0,), dtype=torch.float32), x.new_empty((0,), dtype=torch.float32)
    return dx, partial.sum(0), partial_b.sum(0)


def _warps(D: int) -> int:
    return 4 if D <= 2048 else (8 if D <= 8192 else 16)


def _sm_count(t: torch.Tensor) -> int:
    if t.is_cuda:
        return torch.cuda.get_device_properties(t.device).multi_processor_count
    return 4
