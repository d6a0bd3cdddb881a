"""Triton kernels of ``memkern::l2_norm``: ``sqrt(sum(float32(grads)**2))`` as a 0-dim float32
tensor (see memkern/ops/l2_norm.py).

Deterministic two-stage reduction: each program of the first kernel sums the squares of a
fixed chunk into one float32 partial; one program of the second kernel sums the partials in
a fixed order and takes the square root. No atomics, so a given length always gives the same
bits. NaN and inf propagate through the sums (inf**2 = inf, NaN anywhere gives NaN).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from memkern.kernels import _common

CHUNK_BLOCKS = 8
"""Blocks of ``_common.BLOCK`` elements summed by one program of the first stage."""


@triton.jit
def _sum_squares_kernel(grads_ptr, partials_ptr, n, BLOCK: tl.constexpr,
                        CHUNK_BLOCKS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    start = pid * (BLOCK * CHUNK_BLOCKS)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.static_range(CHUNK_BLOCKS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(grads_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(partials_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def _finish_kernel(partials_ptr, out_ptr, num_partials, BLOCK: tl.constexpr):
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, num_partials, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(partials_ptr + offs, mask=offs < num_partials, other=0.0)
    tl.store(out_ptr, tl.sqrt_rn(tl.sum(acc, axis=0)))


def l2_norm(grads: torch.Tensor) -> torch.Tensor:
    _common.check_buffer("l2_norm", "grads", grads, _common.GRAD_DTYPES)
    n = grads.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.float32, device=grads.device)
    out = torch.empty((), dtype=torch.float32, device=grads.device)
    chunk = _common.BLOCK * CHUNK_BLOCKS
    num_partials = triton.cdiv(n, chunk)
    partials = torch.empty(num_partials, dtype=torch.float32, device=grads.device)
    with _common.device_guard(grads):
        _sum_squares_kernel[(num_partials,)](
            grads, partials, n, BLOCK=_common.BLOCK, CHUNK_BLOCKS=CHUNK_BLOCKS,
            num_warps=_common.NUM_WARPS,
        )
        _finish_kernel[(1,)](partials, out, num_partials, BLOCK=_common.BLOCK,
                             num_warps=_common.NUM_WARPS)
    return out
