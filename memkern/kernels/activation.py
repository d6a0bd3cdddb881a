"""Triton kernels of ``memkern::act_forward`` / ``memkern::act_backward``
(memkern/ops/activation.py).

The tanh-approximate GELU is written with ``1 + tanh(u) = 2 * sigmoid(2u)``, which has no
cancellation where ``tanh(u)`` is close to -1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from memkern.kernels import _nn_common as C
from memkern.kernels._common import round_to
from memkern.ops.activation import KINDS

# Globals read inside @triton.jit code must be tl.constexpr: compiled Triton rejects plain
# Python floats there (the interpreter accepts them, so only the AOT compile test sees it).
_SQRT1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_C = tl.constexpr(0.044715)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def act_value(x, KIND: tl.constexpr):
    """The activation of float32 ``x``; KIND indexes memkern.ops.activation.KINDS."""
    if KIND == 0:
        return 0.5 * x * (1.0 + tl.erf(x * _SQRT1_2))
    elif KIND == 1:
        u = _SQRT_2_OVER_PI * (x + _GELU_C * x * x * x)
        return x * _sigmoid(2.0 * u)
    elif KIND == 2:
        return tl.where(x < 0.0, 0.0, x)
    else:
        return x * _sigmoid(x)


@triton.jit
def act_grad(g, x, KIND: tl.constexpr):
    """``g * act'(x)`` for float32 ``g``, ``x``."""
    if KIND == 0:
        cdf = 0.5 * (1.0 + tl.erf(x * _SQRT1_2))
        pdf = tl.exp(-0.5 * x * x) * _INV_SQRT_2PI
        return g * (cdf + x * pdf)
    elif KIND == 1:
        u = _SQRT_2_OVER_PI * (x + _GELU_C * x * x * x)
        s = _sigmoid(2.0 * u)
        du = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_C * x * x)
        return g * (s + 2.0 * x * s * (1.0 - s) * du)
    elif KIND == 2:
        return tl.where(x <= 0.0, 0.0, g)  # as threshold_backward: NaN passes the gradient
    else:
        s = _sigmoid(x)
        return g * (s * (1.0 + x * (1.0 - s)))


@triton.jit
def _forward_kernel(x_ptr, y_ptr, n, KIND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, round_to(act_value(x, KIND), y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(g_ptr, x_ptr, dx_ptr, n, KIND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dx_ptr + offs, round_to(act_grad(g, x, KIND), dx_ptr.dtype.element_ty), mask=mask)


def act_forward(x: torch.Tensor, kind: str) -> torch.Tensor:
    C.check("act_forward", "x", x)
    y = torch.empty_like(x)
    n = x.numel()
    if n:
        with C.device_guard(x):
            _forward_kernel[C.grid(n)](x, y, n, KIND=KINDS.index(kind), BLOCK=C.BLOCK,
                                       num_warps=C.NUM_WARPS)
    return y


def act_backward(grad: torch.Tensor, x: torch.Tensor, kind: str) -> torch.Tensor:
    C.check("act_backward", "x", x)
    C.check("act_backward", "grad", grad)
    dx = torch.empty_like(x)
    n = x.numel()
    if n:
        with C.device_guard(x):
            _backward_kernel[C.grid(n)](grad, x, dx, n, KIND=KINDS.index(kind), BLOCK=C.BLOCK,
                                        num_warps=C.NUM_WARPS)
    return dx
