"""The SwiGLU MLP ``down(silu(gate(x)) * up(x))`` (Llama's MLP), with a choice of what is kept.

The algorithm is one op with C++ autograd, ``memkern::swiglu_layer``
(:mod:`memkern.ops.swiglu_layer`, csrc/autograd/swiglu.cpp), for eager calls and
``torch.compile`` alike. What it saves for backward, by ``recompute`` (besides the weights,
which are parameters):

=============  ============================  ==================================================
recompute      saved                         recomputed in backward
=============  ============================  ==================================================
"none"         x, gate(x), up(x), h          nothing (torch's unfused module also keeps
                                             silu(gate(x)))
"activation"   x, gate(x), up(x)             h = silu(gate) * up  (an elementwise op)
"full"         x                             gate(x), up(x) (two GEMMs) and h
=============  ============================  ==================================================

Under autocast the layer computes in autocast's dtype: ``x`` is saved as cast, and the
weights' low-precision copies are made again in backward rather than kept. ``x`` itself is not
stored when it is a memkern norm's output (the norm's input and parameters are, to rebuild
it). Weight gradients are accumulated straight into existing ``.grad`` buffers.

In eager mode the call goes through the op's typed entry point
(:data:`memkern.ops.swiglu_layer.swiglu_layer_entry`). Under ``torch.compile`` the op runs in a
selective-checkpoint region that recomputes the inner ops its node recomputes
(:data:`memkern.ops.swiglu_layer.RECOMPUTED`, stated by the node); without it the compiler
would keep them. Without the compiled extension this is torch's ``F.linear`` and ``F.silu``
(:mod:`memkern.nn.functional`).

:func:`swiglu` is ``memkern.nn.functional.swiglu``; :class:`SwiGLU` the module (Llama's MLP).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memkern.nn import _autocast, _saved
from memkern.nn.linear import Linear
from memkern.nn.mlp import RECOMPUTE, check_args
from memkern.ops.swiglu_layer import RECOMPUTED, swiglu_layer, swiglu_layer_entry


def swiglu(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor,
           down_weight: torch.Tensor, gate_bias: torch.Tensor | None = None,
           up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None, *,
           recompute: str = "activation") -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` saving, per ``recompute``, what the module docstring
    lists."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"memkern.nn.functional.swiglu: recompute={recompute!r} is not one of "
                         f"{RECOMPUTE}")
    if swiglu_layer_entry is None:
        h = F.silu(F.linear(x, gate_weight, gate_bias)) * F.linear(x, up_weight, up_bias)
        return F.linear(h, down_weight, down_bias)
    if not torch.compiler.is_compiling():
        out = swiglu_layer_entry(x, gate_weight, gate_bias, up_weight, up_bias, down_weight,
                                 down_bias, recompute)
        if out is not None:
            return out
    if x.shape[-1:] != gate_weight.shape[1:]:
        raise ValueError(
            f"memkern.nn.functional.swiglu: input shape {tuple(x.shape)} does not end with "
            f"gate_proj's in_features={gate_weight.shape[1]}"
        )
    _autocast.compute_dtype(x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias)
    return _saved.compiled_region(swiglu_layer, x, gate_weight, gate_bias, up_weight, up_bias,
                                  down_weight, down_bias, recompute,
                                  recomputed=RECOMPUTED[recompute])


class SwiGLU(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``: the Llama MLP.

    ``recompute`` — what is saved for backward (weights aside): ``"none"``: ``x``, ``gate``,
    ``up`` and ``h``; ``"activation"`` (default): ``x``, ``gate`` and ``up`` (``h`` is recomputed,
    elementwise); ``"full"``: ``x`` only (both input GEMMs are recomputed too). ``x`` is not stored
    when it is a memkern norm's output. Submodules ``gate_proj``, ``up_proj``, ``down_proj``.
    """

    def __init__(self, in_features: int, hidden_features: int, out_features: int | None = None,
                 bias: bool = False, recompute: str = "activation", device=None,
                 dtype=None) -> None:
        super().__init__()
        check_args("silu", recompute, "memkern.nn.SwiGLU")
        out_features = in_features if out_features is None else out_features
        self.recompute = recompute
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.gate_proj = Linear(in_features, hidden_features, **kw)
        self.up_proj = Linear(in_features, hidden_features, **kw)
        self.down_proj = Linear(hidden_features, out_features, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight,
                      self.gate_proj.bias, self.up_proj.bias, self.down_proj.bias,
                      recompute=self.recompute)

    def extra_repr(self) -> str:
        return f"recompute={self.recompute!r}"
