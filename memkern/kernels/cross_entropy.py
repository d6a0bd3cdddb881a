"""Triton kernels of ``memkern::cross_entropy_rows_`` and ``memkern::cross_entropy_block_grad_``
(memkern/ops/cross_entropy.py): the GPU path where the CUDA kernels were not built.

Rows: one program per row. Pass 1 streams the row in ``BLOCK_V`` tiles keeping a running max
and rescaled sum of exponentials (the online softmax normaliser) and the row sum (label
smoothing), and reads the target logit; pass 2 (``COMPUTE_GRAD``) writes
``scale * (softmax - (1 - eps) onehot - eps / V)`` over the logits. Block gradient: one program
per row and tile of columns, from the row's log-sum-exp. Soft-capping (``SOFTCAP``) applies
``cap * tanh(z / cap)`` on the fly and the chain-rule factor ``1 - tanh^2`` to the gradient.

Per-row statistics (the rows op's ``outputs``), each a constexpr: ``ENTROPY`` keeps one more
running sum in pass 1, ``sum exp(z - max) (z - max)`` rescaled with the normaliser's, and the
entropy is ``log(sum) - moment / sum`` (csrc/cuda/kernels/cross_entropy_math.h's order);
``IS_TOP1`` compares the target logit with the row maximum (or, with a NaN in the row, asks
for a NaN: torch's argmax) and, for a target at the maximum, reads the columns before it once
more; ``MEAN_LOGIT`` is the row sum over ``V``. The block gradient's ``ENTROPY`` adds
``-entropy_scale * p (log p + entropy)`` before the cap's factor.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from memkern.kernels import _nn_common as C
from memkern.kernels._common import f32, round_to
from memkern.kernels.row_stats import (
    ENTROPY_ROW,
    IS_TOP1_ROW,
    MEAN_LOGIT_ROW,
    ROW_ENTROPY,
    ROW_IS_TOP1,
    ROW_MEAN_LOGIT,
)

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
def _ce_kernel(z_ptr, t_ptr, s_ptr, loss_ptr, lse_ptr, stats_ptr, stats_stride, V, ignore_index,
               eps, eps_over_v, one_minus_eps, cap, HAS_SCALE: tl.constexpr,
               COMPUTE_GRAD: tl.constexpr, SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr,
               IS_TOP1: tl.constexpr, MEAN_LOGIT: tl.constexpr, ENTROPY_AT: tl.constexpr,
               IS_TOP1_AT: tl.constexpr, MEAN_LOGIT_AT: tl.constexpr, BLOCK_V: tl.constexpr):
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
    moment = tl.full((), 0.0, tl.float32)
    nan_seen = tl.full((), 0, tl.int32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + cols0
        mask = cols < V
        z = _capped(tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32), cap, SOFTCAP)
        z = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        # Shift by 0 while every logit so far is -inf (exp(-inf - -inf) would be NaN): s is 0
        # then, and exp(z - 0) = 0 for the -inf logits.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        e = tl.exp(z - shift)
        r = tl.exp(m - shift)
        if ENTROPY:  # 0 while only -inf was seen; a term whose exponential is 0 adds 0
            moment = (tl.where(s == 0.0, 0.0, r * (moment + s * (m - shift)))
                      + tl.sum(tl.where(e == 0.0, 0.0, e * (z - shift)), axis=0))
        if IS_TOP1:
            nan_seen = tl.maximum(nan_seen, tl.max((z != z).to(tl.int32), axis=0))
        s = s * r + tl.sum(e, axis=0)
        zsum += tl.sum(tl.where(mask, z, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(s)
    z_t = _capped(tl.load(z_row + t_safe).to(tl.float32), cap, SOFTCAP)
    if ENTROPY:
        entropy = tl.log(s) - moment / s
        tl.store(stats_ptr + ENTROPY_AT * stats_stride + row, tl.where(valid, entropy, 0.0))
    if MEAN_LOGIT:
        tl.store(stats_ptr + MEAN_LOGIT_AT * stats_stride + row, tl.where(valid, zsum / V, 0.0))
    if IS_TOP1:
        # at the maximum (a NaN in a row with one); then no column before the target is
        at_max = tl.where(nan_seen > 0, z_t != z_t, z_t == m)
        earlier = tl.full((), 0, tl.int32)
        for v0 in range(0, tl.where(in_range & at_max, t_safe, 0), BLOCK_V):
            cols = v0 + cols0
            mask = cols < t_safe
            z = _capped(tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32), cap,
                        SOFTCAP)
            hit = tl.where(nan_seen > 0, z != z, z == m)
            earlier += tl.sum((mask & hit).to(tl.int32), axis=0)
        top1 = valid & in_range & at_max & (earlier == 0)
        tl.store(stats_ptr + IS_TOP1_AT * stats_stride + row, tl.where(top1, 1.0, 0.0))
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
def _entropy_term(z, lse, entropy, cap, SOFTCAP: tl.constexpr):
    """``p (log p + entropy)`` (0 where ``p`` is), times the cap's factor; ``z`` uncapped."""
    if SOFTCAP:
        u = z / cap
        e = tl.exp(-2.0 * tl.abs(u))
        logp = cap * _tanh(u, e) - lse
    else:
        logp = z - lse
    p = tl.exp(logp)
    term = tl.where(p == 0.0, 0.0, p * (logp + entropy))
    if SOFTCAP:
        term = term * (4.0 * e / ((1.0 + e) * (1.0 + e)))
    return term


@triton.jit
def _block_grad_kernel(z_ptr, lse_ptr, t_ptr, s_ptr, s_stride, h_ptr, hs_ptr, hs_stride, W,
                       class_offset, num_classes, ignore_index, eps_over_v, one_minus_eps, cap,
                       SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
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
    g = _grad(z, lse, class_offset + cols == t, hit, eps_over_v, cap, SOFTCAP) * scale
    if ENTROPY:
        g -= tl.load(hs_ptr + row * hs_stride) * _entropy_term(z, lse, tl.load(h_ptr + row),
                                                               cap, SOFTCAP)
    tl.store(z_ptr + row * W + cols, round_to(tl.where(valid, g, 0.0),
                                              z_ptr.dtype.element_ty), mask=mask)


def _block_v(V: int) -> int:
    return min(triton.next_power_of_2(max(V, 1)), MAX_BLOCK_V)


def cross_entropy_rows_(logits, target, row_scale, ignore_index, label_smoothing, compute_grad,
                        softcap=0.0, outputs=0, stats=None):
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
            logits, target, row_scale if row_scale is not None else loss, loss, lse,
            stats if outputs else loss, stats.stride(0) if outputs else 0, V,
            ignore_index, f32(eps), f32(eps / V), f32(1.0 - eps), f32(softcap),
            HAS_SCALE=row_scale is not None, COMPUTE_GRAD=bool(compute_grad),
            SOFTCAP=softcap > 0.0, ENTROPY=bool(outputs & ROW_ENTROPY),
            IS_TOP1=bool(outputs & ROW_IS_TOP1), MEAN_LOGIT=bool(outputs & ROW_MEAN_LOGIT),
            ENTROPY_AT=ENTROPY_ROW, IS_TOP1_AT=IS_TOP1_ROW, MEAN_LOGIT_AT=MEAN_LOGIT_ROW,
            BLOCK_V=block_v, num_warps=8 if block_v >= 2048 else 4,
        )
    return loss, lse


def cross_entropy_block_grad_(logits, lse, target, row_scale, class_offset, num_classes,
                              ignore_index, label_smoothing, softcap=0.0, entropy=None,
                              entropy_scale=None):
    C.check("cross_entropy_block_grad_", "logits", logits)
    n, w = logits.shape
    if n == 0 or w == 0:
        return
    eps = float(label_smoothing)
    block = _block_v(w)
    with C.device_guard(logits):
        with_entropy = entropy is not None
        _block_grad_kernel[(n, triton.cdiv(w, block))](
            logits, lse, target, row_scale, row_scale.stride(0),
            entropy if with_entropy else lse, entropy_scale if with_entropy else lse,
            entropy_scale.stride(0) if with_entropy else 0, w, class_offset, num_classes,
            ignore_index, f32(eps / num_classes), f32(1.0 - eps), f32(softcap),
            SOFTCAP=softcap > 0.0, ENTROPY=with_entropy, BLOCK=block,
            num_warps=8 if block >= 2048 else 4,
        )
