"""The two-layer MLP ``fc2(act(fc1(x)))`` with a choice of what is kept for backward.

What is saved for backward, by ``recompute`` (besides the weights, which are parameters):

=============  ==========================  =====================================================
recompute      saved                       recomputed in backward
=============  ==========================  =====================================================
"none"         x, pre = fc1(x), h = act    nothing (what ``nn.Sequential(Linear, act, Linear)``
                                           saves)
"activation"   x, pre                      h = act(pre)  (an elementwise op)
"full"         x                           pre = fc1(x) (a GEMM) and h
=============  ==========================  =====================================================

``x`` itself is not stored when it is a memkern norm's output (:mod:`._saved`). Weight
gradients are accumulated straight into existing ``.grad`` buffers (:mod:`._grad`).
``transposed=True`` takes both weights stored ``[in, out]`` (GPT-2's ``Conv1D``).

Host time per call: with one dtype, no autocast and the default backend, the call runs as the
``memkern::mlp_layer`` op (:mod:`memkern.ops.mlp_layer`: this algorithm with C++ autograd, the
input's recipe passed along) when the extension is built; :class:`MLPFunction` serves the rest
(autocast, mixed dtypes, a forced backend, ``torch.compile``, no extension).
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from memkern import backend, ops
from memkern._extension import check_same_in_cpp
from memkern.nn.functional import _common, _grad, _saved
from memkern.ops.activation import KINDS as ACTIVATIONS
from memkern.ops.mlp_layer import mlp_layer_entry

RECOMPUTE = ("none", "activation", "full")
check_same_in_cpp(__name__, {"RECOMPUTE": RECOMPUTE})


def _mm(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    wt = w if transposed else w.t()
    return torch.mm(a, wt) if b is None else torch.addmm(b, a, wt)


def _dgrad(g: torch.Tensor, w: torch.Tensor, transposed: bool) -> torch.Tensor:
    return torch.mm(g, w.t() if transposed else w)


def _wgrad(target, g: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, transposed: bool):
    if transposed:
        return _grad.weight_grad(target, a.t(), g, weight.dtype)
    return _grad.weight_grad(target, g.t(), a, weight.dtype)


class MLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, activation, recompute, transposed):
        dtype = _common.compute_dtype(x, w1, b1, w2, b2)
        with _common.no_autocast(x.device.type):
            xc = x.to(dtype)
            x2 = _common.rows(xc)
            pre = _mm(x2, w1.to(dtype), _common.cast(b1, dtype), transposed)
            h = ops.act_forward(pre, activation)
            out = _mm(h, w2.to(dtype), _common.cast(b2, dtype), transposed)
        saver = _saved.Saver()
        saver.add(xc)
        saver.add(pre if recompute != "full" else None, recompute=False)
        saver.add(h if recompute == "none" else None, recompute=False)
        saver.add(w1, recompute=False)
        saver.add(w2, recompute=False)
        saver.add(b1, recompute=False)
        saver.save(ctx)
        ctx.cfg = (activation, recompute, transposed, dtype, x.shape, x.dtype)
        ctx.bias_dtypes = (None if b1 is None else b1.dtype, None if b2 is None else b2.dtype)
        ctx.targets = (_grad.grad_target(w1), _grad.grad_target(w2))
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        activation, recompute, transposed, dtype, x_shape, x_dtype = ctx.cfg
        xc, pre, h, w1, w2, b1 = _saved.load(ctx)
        need = ctx.needs_input_grad
        with _common.no_autocast(grad_out.device.type):
            x2 = _common.rows(xc)
            w1c, w2c = w1.to(dtype), w2.to(dtype)
            g = _common.rows(grad_out.to(dtype))
            if pre is None:  # "full": the first GEMM again
                pre = _mm(x2, w1c, _common.cast(b1, dtype), transposed)
            if h is None and need[3]:  # "activation"/"full": the activation again (for dW2)
                h = ops.act_forward(pre, activation)
            dw2 = _wgrad(ctx.targets[1], g, h, w2, transposed) if need[3] else None
            db2 = g.sum(0).to(ctx.bias_dtypes[1]) if need[4] else None
            del h
            dpre = ops.act_backward(_dgrad(g, w2c, transposed), pre, activation)
            del pre
            dw1 = _wgrad(ctx.targets[0], dpre, x2, w1, transposed) if need[1] else None
            db1 = dpre.sum(0).to(ctx.bias_dtypes[0]) if need[2] else None
            dx = _dgrad(dpre, w1c, transposed).view(x_shape).to(x_dtype) if need[0] else None
        return dx, dw1, db1, dw2, db2, None, None, None


def check_args(activation: str, recompute: str, where: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"{where}: activation={activation!r} is not supported; use one of {ACTIVATIONS}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"{where}: recompute={recompute!r} is not one of {RECOMPUTE}")


def mlp(x: torch.Tensor, fc1_weight: torch.Tensor, fc1_bias: torch.Tensor | None,
        fc2_weight: torch.Tensor, fc2_bias: torch.Tensor | None, *, activation: str = "gelu",
        recompute: str = "activation", transposed: bool = False) -> torch.Tensor:
    """``fc2(act(fc1(x)))`` saving, per ``recompute``, what the module docstring lists."""
    check_args(activation, recompute, "memkern.nn.functional.mlp")
    if (mlp_layer_entry is not None and backend.requested() is None
            and not torch.compiler.is_compiling()):
        out = mlp_layer_entry(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, activation,
                              recompute, transposed)
        if out is not None:
            return out
    in_features = fc1_weight.shape[0] if transposed else fc1_weight.shape[1]
    if x.shape[-1:] != (in_features,):
        raise ValueError(
            f"memkern.nn.functional.mlp: input shape {tuple(x.shape)} does not end with "
            f"fc1's in_features={in_features}"
        )
    if x.dim() == 1:
        return mlp(x.unsqueeze(0), fc1_weight, fc1_bias, fc2_weight, fc2_bias,
                   activation=activation, recompute=recompute, transposed=transposed).squeeze(0)
    args = (x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, activation, recompute, transposed)
    if recompute == "none":
        return MLPFunction.apply(*args)
    # compiled: what the Function recomputes in backward, recomputed ("full": every op)
    recomputed = {torch.ops.memkern.act_forward.default} if recompute == "activation" else None
    return _saved.compiled_region(MLPFunction.apply, *args, recomputed=recomputed)
