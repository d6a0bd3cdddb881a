"""Triton kernels of ``memkern::cross_entropy_rows_`` and ``memkern::cross_entropy_block_grad_``
(memkern/ops/cross_entropy.py): the GPU path where the CUDA kernels were not built.

Rows: one program per row. Pass 1 streams the row in ``BLOCK_V`` tiles keeping a running max
and rescaled sum of exponentials (the online softmax normaliser) and the row sum (label
smoothing), and reads the target logit; pass 2 (``COMPUTE_GRAD``) writes
``scale * (softmax - (1 - eps) onehot - eps / V)`` over the logits. Block gradient: one program
per row and tile of columns, from the row's log-sum-exp. Soft-capping (``SOFTCAP``) applies
``cap * tanh(z / cap)`` on the fly and the chain-rule factor ``1 - tanh^2`` to the gradient.
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
def _tanh(u, e):
    # odd-symmetric (1 - e) / (1 + e) with e = exp(-2|u|) <= 1: no overflow; its absolute error
    # (a float32 ulp of 1) is what the capped logit cap * tanh needs
    t = (1.0 - e) / (1.0 + e)
    return tl.where(u < 0, -t, t)


@triton.jit
def _capped(z, cap, SOFTCAP: tl.constexpr):
    if SOFTCAP:
        u = z / cap
        z = cap * _tanh(u, tl.exp(-2.0 * tl.abs(u)))
    return z


@triton.jit
def _ce_kernel(z_ptr, t_ptr, s_ptr, loss_ptr, lse_ptr, V, ignore_index, eps, eps_over_v,
               one_minus_eps, cap, HAS_SCALE: tl.constexpr, COMPUTE_GRAD: tl.constexpr,
               SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr):
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
        z = _capped(tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32), cap, SOFTCAP)
        z = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        # Shift by 0 while every logit so far is -inf (exp(-inf - -inf) would be NaN): s is 0
        # then, and exp(z - 0) = 0 for the -inf logits.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(z - shift), axis=0)
        zsum += tl.sum(tl.where(mask, z, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(s)
    z_t = _capped(tl.load(z_row + t_safe).to(tl.float32), cap, SOFTCAP)
    smoothing = tl.where(eps > 0.0, eps * (zsum / V), 0.0)  # 0, not 0 * -inf, without it
    loss = lse - tl.where(in_range, one_minus_eps * z_t, 0.0) - smoothing
    tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
    tl.store(lse_ptr + row, tl.where(valid, lse, 0.0))
    if COMPUTE_GRAD:
        scale = tl.where(valid, 1.0, 0.0)
        if HAS_SCALE:
            scale = scale * tl.load(s_ptr + row)
        hit = tl.where(in_range, one_minus_eps, 0.0)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + cols0
            mask = cols < V
            z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
            g = _grad(z, lse, cols == t_safe, hit, eps_over_v, cap, SOFTCAP)
            tl.store(z_row + cols, round_to(tl.where(valid, g * scale, 0.0),
                                            z_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grad(z, lse, is_target, hit, eps_over_v, cap, SOFTCAP: tl.constexpr):
    """The gradient before the row scale: softmax - eps / V - (1 - eps) onehot, then (with a
    cap) times 1 - tanh^2 = 4 e / (1 + e)^2; ``z`` is the uncapped logit."""
    if SOFTCAP:
        u = z / cap
        e = tl.exp(-2.0 * tl.abs(u))
        g = tl.exp(cap * _tanh(u, e) - lse) - eps_over_v - tl.where(is_target, hit, 0.0)
        g = g * (4.0 * e / ((1.0 + e) * (1.0 + e)))
    else:
        g = tl.exp(z - lse) - eps_over_v - tl.where(is_target, hit, 0.0)
    return g


@triton.jit
def _block_grad_kernel(z_ptr, lse_ptr, t_ptr, s_ptr, s_stride, W, class_offset, num_classes,
                       ignore_index, eps_over_v, one_minus_eps, cap, SOFTCAP: tl.constexpr,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < W
    t = tl.load(t_ptr + row)
    valid = t != ignore_index
    in_range = valid & (t >= 0) & (t < num_classes)
    hit = tl.where(in_range, one_minus_eps, 0.0)
    lse = tl.load(lse_ptr + row)
    scale = tl.where(valid, tl.load(s_ptr + row * s_stride), 0.0)
    z = tl.load(z_ptr + row * W + cols, mask=mask, other=0.0).to(tl.float32)
    g = _grad(z, lse, class_offset + cols == t, hit, eps_over_v, cap, SOFTCAP)
    tl.store(z_ptr + row * W + cols, round_to(tl.where(valid, g * scale, 0.0),
                                              z_ptr.dtype.element_ty), mask=mask)


def _block_v(V: int) -> int:
    return min(triton.next_power_of_2(max(V, 1)), MAX_BLOCK_V)


def cross_entropy_rows_(logits, target, row_scale, ignore_index, label_smoothing, compute_grad,
                        softcap=0.0):
    C.check("cross_entropy_rows_", "logits", logits)
    n, V = logits.shape
    loss = logits.new_empty((n,), dtype=torch.float32)
    lse = logits.new_empty((n,), dtype=torch.float32)
    if n == 0:
        return loss, lse
    eps = float(label_smoothing)
    block_v = _block_v(V)
    with C.device_guard(logits):
        _ce_kernel[(n,)](
            logits, target, row_scale if row_scale is not None else loss, loss, lse, V,
            ignore_index, f32(eps), f32(eps / V), f32(1.0 - eps), f32(softcap),
            HAS_SCALE=row_scale is not None, COMPUTE_GRAD=bool(compute_grad),
            SOFTCAP=softcap > 0.0, BLOCK_V=block_v, num_warps=8 if block_v >= 2048 else 4,
        )
    return loss, lse


def cross_entropy_block_grad_(logits, lse, target, row_scale, class_offset, num_classes,
                              ignore_index, label_smoothing, softcap=0.0):
    C.check("cross_entropy_block_grad_", "logits", logits)
    n, w = logits.shape
    if n == 0 or w == 0:
        return
    eps = float(label_smoothing)
    block = _block_v(w)
    with C.device_guard(logits):
        _block_grad_kernel[(n, triton.cdiv(w, block))](
            logits, lse, target, row_scale, row_scale.stride(0), w, class_offset, num_classes,
            ignore_index, f32(eps / num_classes), f32(1.0 - eps), f32(softcap),
            SOFTCAP=softcap > 0.0, BLOCK=block, num_warps=8 if block >= 2048 else 4,
        )
