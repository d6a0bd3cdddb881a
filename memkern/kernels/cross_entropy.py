"""Triton kernel of ``memkern::cross_entropy_rows_`` (memkern/ops/cross_entropy.py).

One program per row. Pass 1 streams the row in ``BLOCK_V`` tiles keeping a running max and
rescaled sum of exponentials (the online softmax normaliser), the row sum (label smoothing) and
reads the target logit; pass 2 (``COMPUTE_GRAD``) writes ``scale * (softmax - (1 - eps) onehot
- eps / V)`` over the logits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from memkern.kernels import _nn_common as C
from memkern.kernels._common import f32, round_to

MAX_BLOCK_V = 4096
"""Widest tile of a row (classes per loop step). The same on the GPU and under the CPU
interpreter, so the interpreter runs the very constexprs that a GPU compiles."""


@triton.jit
def _ce_kernel(z_ptr, t_ptr, s_ptr, loss_ptr, V, ignore_index, eps, eps_over_v, one_minus_eps,
               HAS_SCALE: tl.constexpr, COMPUTE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * V
    t = tl.load(t_ptr + row)
    valid = t != ignore_index
    in_range = valid & (t >= 0) & (t < V)
    t_safe = tl.where(in_range, t, 0)
    cols0 = tl.arange(0, BLOCK_V)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    zsum = tl.full((), 0.0, tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + cols0
        mask = cols < V
        z = tl.load(z_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        # Shift by 0 while every logit so far is -inf (exp(-inf - -inf) would be NaN): s is 0
        # then, and exp(z - 0) = 0 for the -inf logits.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(z - shift), axis=0)
        zsum += tl.sum(tl.where(mask, z, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(s)
    z_t = tl.load(z_row + t_safe).to(tl.float32)
    smoothing = tl.where(eps > 0.0, eps * (zsum / V), 0.0)  # 0, not 0 * -inf, without it
    loss = lse - tl.where(in_range, one_minus_eps * z_t, 0.0) - smoothing
    tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
    if COMPUTE_GRAD:
        scale = tl.where(valid, 1.0, 0.0)
        if HAS_SCALE:
            scale = scale * tl.load(s_ptr + row)
        hit = tl.where(in_range, one_minus_eps, 0.0)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + cols0
            mask = cols < V
            z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(z - lse) - eps_over_v - tl.where(cols == t_safe, hit, 0.0)
            tl.store(z_row + cols, round_to(g * scale, z_ptr.dtype.element_ty), mask=mask)


def cross_entropy_rows_(logits, target, row_scale, ignore_index, label_smoothing, compute_grad):
    C.check("cross_entropy_rows_", "logits", logits)
    n, V = logits.shape
    loss = logits.new_empty((n,), dtype=torch.float32)
    if n == 0:
        return loss
    eps = float(label_smoothing)
    block_v = min(triton.next_power_of_2(max(V, 1)), MAX_BLOCK_V)
    with C.device_guard(logits):
        _ce_kernel[(n,)](
            logits, target, row_scale if row_scale is not None else loss, loss, V, ignore_index,
            f32(eps), f32(eps / V), f32(1.0 - eps),
            HAS_SCALE=row_scale is not None, COMPUTE_GRAD=bool(compute_grad), BLOCK_V=block_v,
            num_warps=8 if block_v >= 2048 else 4,
        )
    return loss
