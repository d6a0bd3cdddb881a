"""The SwiGLU MLP ``down(silu(gate(x)) * up(x))`` (Llama's MLP), with a choice of what is kept.

What is saved for backward, by ``recompute`` (besides the weights, which are parameters):

=============  ============================  ==================================================
recompute      saved                         recomputed in backward
=============  ============================  ==================================================
"none"         x, gate(x), up(x), h          nothing (torch's unfused module also keeps
                                             silu(gate(x)))
"activation"   x, gate(x), up(x)             h = silu(gate) * up  (an elementwise op)
"full"         x                             gate(x), up(x) (two GEMMs) and h
=============  ============================  ==================================================

``x`` itself is not stored when it is a memkern norm's output (:mod:`._saved`).

Host time per call: with one dtype, no autocast and the default backend, the call runs as the
``memkern::swiglu_layer`` op (:mod:`memkern.ops.swiglu_layer`: this algorithm with C++
autograd, the input's recipe passed along) when the extension is built;
:class:`SwiGLUFunction` serves the rest (autocast, mixed dtypes, a forced backend,
``torch.compile``, no extension).
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from memkern import backend, ops
from memkern.nn.functional import _common, _grad, _saved
from memkern.nn.functional.mlp import RECOMPUTE
from memkern.ops.swiglu_layer import swiglu_layer_entry


def _lin(a, w, b):
    return torch.mm(a, w.t()) if b is None else torch.addmm(b, a, w.t())


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, wg, bg, wu, bu, wd, bd, recompute):
        dtype = _common.compute_dtype(x, wg, bg, wu, bu, wd, bd)
        with _common.no_autocast(x.device.type):
            xc = x.to(dtype)
            x2 = _common.rows(xc)
            gate = _lin(x2, wg.to(dtype), _common.cast(bg, dtype))
            up = _lin(x2, wu.to(dtype), _common.cast(bu, dtype))
            h = ops.swiglu_forward(gate, up)
            out = _lin(h, wd.to(dtype), _common.cast(bd, dtype))
        keep = recompute != "full"
        saver = _saved.Saver()
        saver.add(xc)
        saver.add(gate if keep else None, recompute=False)
        saver.add(up if keep else None, recompute=False)
        saver.add(h if recompute == "none" else None, recompute=False)
        for p in (wg, bg, wu, bu, wd):
            saver.add(p, recompute=False)
        saver.save(ctx)
        ctx.cfg = (dtype, x.shape, x.dtype)
        ctx.bias_dtypes = tuple(None if b is None else b.dtype for b in (bg, bu, bd))
        ctx.targets = tuple(_grad.grad_target(w) for w in (wg, wu, wd))
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        dtype, x_shape, x_dtype = ctx.cfg
        xc, gate, up, h, wg, bg, wu, bu, wd = _saved.load(ctx)
        need = ctx.needs_input_grad
        with _common.no_autocast(grad_out.device.type):
            x2 = _common.rows(xc)
            g = _common.rows(grad_out.to(dtype))
            if gate is None:  # "full": both GEMMs again
                gate = _lin(x2, wg.to(dtype), _common.cast(bg, dtype))
                up = _lin(x2, wu.to(dtype), _common.cast(bu, dtype))
            if h is None and need[5]:  # the gated unit again (for dW_down)
                h = ops.swiglu_forward(gate, up)
            dwd = _grad.weight_grad(ctx.targets[2], g.t(), h, wd.dtype) if need[5] else None
            dbd = g.sum(0).to(ctx.bias_dtypes[2]) if need[6] else None
            del h
            dgate, dup = ops.swiglu_backward(torch.mm(g, wd.to(dtype)), gate, up)
            del gate, up
            dwg = _grad.weight_grad(ctx.targets[0], dgate.t(), x2, wg.dtype) if need[1] else None
            dbg = dgate.sum(0).to(ctx.bias_dtypes[0]) if need[2] else None
            dwu = _grad.weight_grad(ctx.targets[1], dup.t(), x2, wu.dtype) if need[3] else None
            dbu = dup.sum(0).to(ctx.bias_dtypes[1]) if need[4] else None
            dx = None
            if need[0]:
                dx = torch.mm(dgate, wg.to(dtype))
                dx.addmm_(dup, wu.to(dtype))
                dx = dx.view(x_shape).to(x_dtype)
        return dx, dwg, dbg, dwu, dbu, dwd, dbd, None


def swiglu(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor,
           down_weight: torch.Tensor, gate_bias: torch.Tensor | None = None,
           up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None, *,
           recompute: str = "activation") -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` saving, per ``recompute``, what the module docstring lists."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"memkern.nn.functional.swiglu: recompute={recompute!r} is not one of {RECOMPUTE}")
    if (swiglu_layer_entry is not None and backend.requested() is None
            and not torch.compiler.is_compiling()):
        out = swiglu_layer_entry(x, gate_weight, gate_bias, up_weight, up_bias, down_weight,
                                 down_bias, recompute)
        if out is not None:
            return out
    if x.shape[-1:] != gate_weight.shape[1:]:
        raise ValueError(
            f"memkern.nn.functional.swiglu: input shape {tuple(x.shape)} does not end with "
            f"gate_proj's in_features={gate_weight.shape[1]}"
        )
    if x.dim() == 1:
        return swiglu(x.unsqueeze(0), gate_weight, up_weight, down_weight, gate_bias, up_bias,
                      down_bias, recompute=recompute).squeeze(0)
    args = (x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, recompute)
    if recompute == "none":
        return SwiGLUFunction.apply(*args)
    # compiled: what the Function recomputes in backward, recomputed ("full": every op)
    recomputed = ({torch.ops.memkern.swiglu_forward.default} if recompute == "activation"
                  else None)
    return _saved.compiled_region(SwiGLUFunction.apply, *args, recomputed=recomputed)
