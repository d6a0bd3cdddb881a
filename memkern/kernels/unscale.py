"""Triton kernel of ``memkern::unscale_``: ``grads = round(float32(grads) * inv_scale)`` in
place, raising ``found_inf`` when an input element is inf or NaN (see memkern/ops/unscale.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from memkern.kernels import _common
from memkern.kernels._common import round_to


@triton.jit
def _unscale_kernel(grads_ptr, found_inf_ptr, inv_scale_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(grads_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inv_scale = tl.load(inv_scale_ptr)
    non_finite = (x != x) | (tl.abs(x) == float("inf"))
    # Each program that saw a non-finite value stores 1.0; nobody ever clears the flag.
    tl.store(found_inf_ptr, 1.0, mask=tl.max(non_finite.to(tl.int32), axis=0) != 0)
    tl.store(grads_ptr + offs, round_to(x * inv_scale, grads_ptr.dtype.element_ty), mask=mask)


def unscale_(grads: torch.Tensor, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    op = "unscale_"
    _common.check_buffer(op, "grads", grads, _common.GRAD_DTYPES)
    _common.check_scalar(op, "found_inf", found_inf, grads.device)
    _common.check_scalar(op, "inv_scale", inv_scale, grads.device)
    n = grads.numel()
    if n == 0:
        return
    with _common.device_guard(grads):
        _unscale_kernel[_common.grid(n)](
            grads, found_inf, inv_scale, n, BLOCK=_common.BLOCK, num_warps=_common.NUM_WARPS
        )
