"""Triton kernel of ``memkern::dropout`` (memkern/ops/dropout.py): the keep-mask is regenerated
from ``(seed, element index)`` with ``tl.randint4x`` (Philox4x32-10), so forward and backward
apply the same mask without storing it. Program ``p`` handles counters ``c`` in
``[p * BLOCK, (p + 1) * BLOCK)`` and, for each, the four elements ``c + j * n4`` (j = 0..3),
which use output word ``j`` of the counter — the layout the reference defines.

Needs triton >= 3.4 (the floor in pyproject.toml): from 3.4.0 ``tl.randint4x`` takes an int64
offset as the counter's low and high 32-bit words, as the reference does; 3.3 runs the 64-bit
Philox variant on it, which gives other masks.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from memkern.kernels import _nn_common as C
from memkern.kernels._common import f32, round_to
from memkern.ops.dropout import scale, threshold

_BLOCK = 256  # counters per program: 4 * _BLOCK elements


@triton.jit
def _apply(x_ptr, y_ptr, offs, n, r, thresh, scale):
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    keep = r.to(tl.int64) >= thresh
    y = tl.where(keep, x * scale, 0.0)
    tl.store(y_ptr + offs, round_to(y, y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dropout_kernel(x_ptr, seed_ptr, y_ptr, n, n4, thresh, scale, BLOCK: tl.constexpr):
    counter = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(seed_ptr)
    r0, r1, r2, r3 = tl.randint4x(seed, counter)
    live = counter < n4
    # elements past n (and counters past n4) are masked out: offs >= n there
    _apply(x_ptr, y_ptr, tl.where(live, counter, n), n, r0, thresh, scale)
    _apply(x_ptr, y_ptr, tl.where(live, counter + n4, n), n, r1, thresh, scale)
    _apply(x_ptr, y_ptr, tl.where(live, counter + 2 * n4, n), n, r2, thresh, scale)
    _apply(x_ptr, y_ptr, tl.where(live, counter + 3 * n4, n), n, r3, thresh, scale)


def dropout(x: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    C.check("dropout", "x", x)
    y = torch.empty_like(x)
    n = x.numel()
    if n:
        n4 = -(-n // 4)
        with C.device_guard(x):
            _dropout_kernel[C.grid(n4, _BLOCK)](
                x, seed.reshape(1), y, n, n4, threshold(p), f32(scale(p)), BLOCK=_BLOCK,
                num_warps=C.NUM_WARPS,
            )
    return y
