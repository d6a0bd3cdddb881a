"""Linear layer whose weight gradient is accumulated straight into ``weight.grad``.

What is saved for backward: the input (or, when the input is a memkern norm's output, the
norm's input and parameters, to rebuild it — see :mod:`._saved`) and the weight itself (a
parameter, not an activation; under autocast the low-precision copy is made again in
backward instead of being kept). Nothing else.

``transposed=True`` takes the weight stored ``[in, out]`` (GPT-2's ``Conv1D``), computing
``x @ weight + bias``.

Host time per call: with one dtype and no autocast the call runs with C++ autograd, through
the op's direct entry point (:data:`memkern.ops.linear_layer.linear_layer_entry`) — as
``F.linear`` when there is no ``weight.grad`` yet and the input is not a norm's recomputable
output (memkern's Linear then saves and computes exactly what torch's does), else as the
``memkern::linear_layer`` op (:mod:`memkern.ops.linear_layer`, this algorithm in C++, with the
recipe the entry finds on the input) when the extension is built. The Python Function below
serves the rest (autocast, mixed dtypes, ``torch.compile``, no extension, the output of a norm
that ran on the Python path).
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from memkern._extension import check_same_rule_in_cpp
from memkern.nn.functional import _common, _grad, _saved
from memkern.ops.linear_layer import linear_layer_entry


def _is_torch_linear(has_recipe: bool, transposed: bool, weight_has_grad: bool) -> bool:
    """Whether a call of one dtype without autocast is ``F.linear`` itself: memkern does nothing
    differently (no recipe to save instead of ``x``, not transposed, no ``weight.grad`` to add
    into)."""
    return not has_recipe and not transposed and not weight_has_grad


# The C++ entry decides by the same rule (csrc/python_entries.cpp).
check_same_rule_in_cpp(__name__, _is_torch_linear, "linear_is_torch_linear",
                       itertools.product((False, True), repeat=3))


class LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, transposed):
        dtype = _common.compute_dtype(x, weight, bias)
        with _common.no_autocast(x.device.type):
            xc = x.to(dtype)
            w = weight.to(dtype)
            x2 = _common.rows(xc)
            wt = w if transposed else w.t()
            out = torch.mm(x2, wt) if bias is None else torch.addmm(bias.to(dtype), x2, wt)
        saver = _saved.Saver()
        saver.add(xc if ctx.needs_input_grad[1] else None)
        saver.add(weight, recompute=False)
        saver.save(ctx)
        ctx.dtype = dtype
        ctx.transposed = transposed
        ctx.x_shape = x.shape
        ctx.x_dtype = x.dtype
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.target = _grad.grad_target(weight) if ctx.needs_input_grad[1] else None
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        xc, weight = _saved.load(ctx)
        dtype = ctx.dtype
        with _common.no_autocast(grad_out.device.type):
            g = _common.rows(grad_out.to(dtype))
            dx = dw = db = None
            if ctx.needs_input_grad[0]:
                w = weight.to(dtype)
                dx = torch.mm(g, w.t() if ctx.transposed else w)
                dx = dx.view(ctx.x_shape).to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                x2 = _common.rows(xc)
                if ctx.transposed:
                    dw = _grad.weight_grad(ctx.target, x2.t(), g, weight.dtype)
                else:
                    dw = _grad.weight_grad(ctx.target, g.t(), x2, weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = g.sum(0).to(ctx.bias_dtype)
        return dx, dw, db, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           transposed: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``x @ weight + bias`` with ``transposed=True``), saving
    only the input for backward and accumulating the weight gradient into ``weight.grad``."""
    if linear_layer_entry is not None and not torch.compiler.is_compiling():
        out = linear_layer_entry(x, weight, bias, transposed)
        if out is not None:
            return out
    in_features = weight.shape[0] if transposed else weight.shape[-1]
    if x.shape[-1:] != (in_features,):
        raise ValueError(
            f"memkern.nn.functional.linear: input has {x.shape[-1] if x.dim() else 'no'} features "
            f"(shape {tuple(x.shape)}) but the weight {tuple(weight.shape)} expects {in_features}"
        )
    if (x.dtype == weight.dtype and (bias is None or bias.dtype == x.dtype)
            and not _common.autocast_enabled(x.device.type)
            and not torch.compiler.is_compiling()
            and _is_torch_linear(_saved.has_recipe(x), transposed, weight.grad is not None)):
        return F.linear(x, weight, bias)
    if x.dim() == 1:
        return LinearFunction.apply(x.unsqueeze(0), weight, bias, transposed).squeeze(0)
    return LinearFunction.apply(x, weight, bias, transposed)
