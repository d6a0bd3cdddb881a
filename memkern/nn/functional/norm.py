"""LayerNorm and RMSNorm that save the input and per-row statistics only.

What is saved for backward: the input ``x``, ``mean`` (LayerNorm) and ``rstd`` — float32, one
per row — and the weight (a parameter). Never the normalised output: the output is marked
recomputable (:mod:`._saved`), so a memkern Linear/MLP consuming it saves ``x`` and the
parameters instead (storage the norm already holds) and rebuilds it in backward.

LayerNorm runs torch's own ``native_layer_norm`` (and its C++ autograd) wherever that saves the
same thing — float32 statistics, never the output: float32/float64 inputs, and 16-bit inputs
on CUDA — since that is the cheapest path on the host and on the device; it keeps the
``memkern::norm_*`` ops for 16-bit inputs on the CPU (where torch's statistics would be 16-bit)
and for RMSNorm (torch has no fused RMSNorm autograd on every device).

Host time per call: in eager mode on the default backend the whole call — checks, the choice
above, the recipe — is one C++ entry (:data:`memkern.ops.norm_layer.norm_entry`); the Python
code below serves the rest (autocast, a forced backend, ``torch.compile``, no extension) and
raises the errors.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.autograd.function import once_differentiable

from memkern import backend, ops
from memkern._extension import check_same_rule_in_cpp
from memkern.nn.functional import _common, _saved
from memkern.ops import _norm_recipe
from memkern.ops.norm_layer import norm_entry, norm_layer_entry


def _flat(x: torch.Tensor, n_norm: int) -> torch.Tensor:
    return x.reshape(-1, math.prod(x.shape[x.dim() - n_norm:]) if n_norm else 1)


class NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, n_norm, eps, rms):
        x2 = _flat(x, n_norm).contiguous()
        w = weight.reshape(-1) if weight is not None else None
        b = bias.reshape(-1) if bias is not None else None
        y, mean, rstd = ops.norm_forward(x2, w, b, eps, rms)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.n_norm, ctx.rms, ctx.has_bias = n_norm, rms, bias is not None
        return y.view(x.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        x2 = _flat(x, ctx.n_norm).contiguous()
        w = weight.reshape(-1) if weight is not None else None
        dy2 = _flat(dy, ctx.n_norm).to(x.dtype).contiguous()
        dx, dw, db = ops.norm_backward(dy2, x2, w, mean, rstd, ctx.rms)
        dweight = dbias = None
        if weight is not None and ctx.needs_input_grad[1]:
            dweight = dw.to(weight.dtype).view(weight.shape)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            dbias = db.to(weight.dtype).view(weight.shape)
        return dx.view(x.shape), dweight, dbias, None, None, None


def _norm_autograd(x, weight, bias, n_norm, eps, rms):
    """NormFunction's algorithm: with C++ autograd (``memkern::norm_layer``) when the extension
    is built, on the default backend, outside ``torch.compile``; else the Python Function."""
    if (norm_layer_entry is not None and backend.requested() is None
            and not torch.compiler.is_compiling()):
        return norm_layer_entry(x, weight, bias, n_norm, eps, rms)
    return NormFunction.apply(x, weight, bias, n_norm, eps, rms)


_HALF = (torch.bfloat16, torch.float16)


def _native_layer_norm_saves_statistics(dtype: torch.dtype, on_cuda: bool) -> bool:
    """Whether torch's ``native_layer_norm`` saves what the memkern op does for an input of
    ``dtype`` (with parameters of its dtype): float32 statistics (float64 for float64), never
    the output; on the CPU its 16-bit statistics would be 16-bit."""
    return dtype in (torch.float32, torch.float64) or (on_cuda and dtype in _HALF)


# The C++ entry decides by the same rule (csrc/python_entries.cpp).
check_same_rule_in_cpp(__name__, _native_layer_norm_saves_statistics,
                       "native_layer_norm_saves_statistics",
                       [(d, cuda) for d in (*_HALF, torch.float32, torch.float64)
                        for cuda in (False, True)])


def _native_layer_norm_ok(x: torch.Tensor, weight, bias) -> bool:
    """Whether torch's ``native_layer_norm`` saves exactly what the memkern op does."""
    return (_native_layer_norm_saves_statistics(x.dtype, x.is_cuda)
            and (weight is None or weight.dtype == x.dtype)
            and (bias is None or bias.dtype == x.dtype))


def _native_layer_norm(shape: tuple[int, ...], eps: float):
    def rebuild(x, weight, bias):
        return torch.native_layer_norm(x, shape, weight, bias, eps)[0]
    return rebuild


def _recompute(n_norm: int, eps: float, rms: bool):
    def rebuild(x, weight, bias):
        y, _, _ = ops.norm_forward(
            _flat(x, n_norm).contiguous(),
            weight.reshape(-1) if weight is not None else None,
            bias.reshape(-1) if bias is not None else None, eps, rms,
        )
        return y.view(x.shape)
    return rebuild


def _norm(x, normalized_shape, weight, bias, eps, rms, name):
    if (norm_entry is not None and not torch.compiler.is_compiling()
            and backend.requested() is None):
        y = norm_entry(x, normalized_shape, weight, bias, eps, rms)  # _norm_saving_input in C++
        if y is not None:
            return y
    # The modules pass a tuple: the common case costs no conversion (torch.Size == tuple).
    shape = (normalized_shape if type(normalized_shape) is tuple
             else tuple(normalized_shape) if isinstance(normalized_shape, Sequence)
             else (normalized_shape,))
    if x.shape[x.dim() - len(shape):] != shape:  # also when x has fewer dimensions
        raise ValueError(
            f"memkern.nn.functional.{name}: input shape {tuple(x.shape)} does not end with "
            f"normalized_shape {shape}"
        )
    if (weight is not None and weight.shape != shape) or (bias is not None and bias.shape != shape):
        pname, p = ("weight", weight) if weight is not None and weight.shape != shape else ("bias", bias)
        raise ValueError(
            f"memkern.nn.functional.{name}: {pname} has shape {tuple(p.shape)}, expected {shape}"
        )
    # compiled: the whole norm recomputed in backward (a consumer never saves its output)
    return _saved.compiled_region(_norm_saving_input, x, shape, weight, bias, float(eps), rms)


def _norm_saving_input(x, shape, weight, bias, eps, rms):
    if not rms and _native_layer_norm_ok(x, weight, bias):
        kind, rebuild = _norm_recipe.NATIVE_LAYER_NORM, _native_layer_norm(shape, eps)
        if _common.autocast_enabled(x.device.type):  # autocast would save a float32 copy of x
            with torch.autocast(x.device.type, enabled=False):
                y = rebuild(x, weight, bias)
        else:
            y = rebuild(x, weight, bias)
    else:
        kind = _norm_recipe.RMS_NORM if rms else _norm_recipe.LAYER_NORM
        rebuild = _recompute(len(shape), eps, rms)
        y = _norm_autograd(x, weight, bias, len(shape), eps, rms)
    if y.requires_grad and torch.is_grad_enabled():
        _saved.mark_recomputable(y, rebuild, (x, weight, bias), kind=kind, dims=len(shape), eps=eps)
    return y


def layer_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm`` saving ``x``, ``mean`` and ``rstd`` only."""
    return _norm(x, normalized_shape, weight, bias, eps, False, "layer_norm")


def rms_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
             eps: float | None = None) -> torch.Tensor:
    """``F.rms_norm`` saving ``x`` and ``rstd`` only (``eps=None``: ``torch.finfo(x.dtype).eps``,
    as torch)."""
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    return _norm(x, normalized_shape, weight, None, eps, True, "rms_norm")
