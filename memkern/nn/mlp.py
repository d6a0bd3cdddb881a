"""The two-layer MLP ``fc2(act(fc1(x)))`` with a choice of what is kept for backward.

The algorithm is one op with C++ autograd, ``memkern::mlp_layer`` (:mod:`memkern.ops.mlp_layer`,
csrc/autograd/mlp.cpp), for eager calls and ``torch.compile`` alike. What it saves for
backward, by ``recompute`` (besides the weights, which are parameters):

=============  ==========================  =====================================================
recompute      saved                       recomputed in backward
=============  ==========================  =====================================================
"none"         x, pre = fc1(x), h = act    nothing (what ``nn.Sequential(Linear, act, Linear)``
                                           saves)
"activation"   x, pre                      h = act(pre)  (an elementwise op)
"full"         x                           pre = fc1(x) (a GEMM) and h
=============  ==========================  =====================================================

Under autocast the layer computes in autocast's dtype: ``x`` is saved as cast, and the
weights' low-precision copies are made again in backward rather than kept. ``x`` itself is not
stored when it is a memkern norm's output (the norm's input and parameters are, to rebuild
it). Weight gradients are accumulated straight into existing ``.grad`` buffers.
``transposed=True`` takes both weights stored ``[in, out]`` (GPT-2's ``Conv1D``).

In eager mode the call goes through the op's typed entry point
(:data:`memkern.ops.mlp_layer.mlp_layer_entry`). Under ``torch.compile`` the op runs in a
selective-checkpoint region that recomputes the inner ops its node recomputes
(:data:`memkern.ops.mlp_layer.RECOMPUTED`, stated by the node); without it the compiler would
keep them. Without the compiled extension this is torch's ``F.linear``, activation,
``F.linear`` (:mod:`memkern.nn.functional`).

:func:`mlp` is ``memkern.nn.functional.mlp``; :class:`MLP` the module (GPT-2's block, then
dropout). ``RECOMPUTE`` and :func:`check_args` serve :mod:`memkern.nn.swiglu` too.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memkern._extension import check_same_in_cpp
from memkern.nn import _autocast, _saved
from memkern.nn.dropout import Dropout
from memkern.nn.linear import Linear
from memkern.ops.activation import KINDS as ACTIVATIONS
from memkern.ops.activation import forward_reference as activation_reference
from memkern.ops.mlp_layer import RECOMPUTED, mlp_layer, mlp_layer_entry

RECOMPUTE = ("none", "activation", "full")
check_same_in_cpp(__name__, {"RECOMPUTE": RECOMPUTE})


def check_args(activation: str, recompute: str, where: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"{where}: activation={activation!r} is not supported; use one of "
                         f"{ACTIVATIONS}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"{where}: recompute={recompute!r} is not one of {RECOMPUTE}")


def mlp(x: torch.Tensor, fc1_weight: torch.Tensor, fc1_bias: torch.Tensor | None,
        fc2_weight: torch.Tensor, fc2_bias: torch.Tensor | None, *, activation: str = "gelu",
        recompute: str = "activation", transposed: bool = False) -> torch.Tensor:
    """``fc2(act(fc1(x)))`` saving, per ``recompute``, what the module docstring lists."""
    check_args(activation, recompute, "memkern.nn.functional.mlp")
    if mlp_layer_entry is None:
        w1, w2 = (fc1_weight.t(), fc2_weight.t()) if transposed else (fc1_weight, fc2_weight)
        return F.linear(activation_reference(F.linear(x, w1, fc1_bias), activation), w2, fc2_bias)
    if not torch.compiler.is_compiling():
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
    # raises for mixed dtypes
    _autocast.compute_dtype(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias)
    return _saved.compiled_region(mlp_layer, x, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
                                  activation, recompute, transposed,
                                  recomputed=RECOMPUTED[recompute])


class MLP(nn.Module):
    """``fc2(activation(fc1(x)))``, then dropout: the transformer MLP (GPT-2 style).

    ``activation``: ``"gelu"`` | ``"gelu_tanh"`` | ``"relu"`` | ``"silu"``.
    ``recompute`` — what is saved for backward (weights aside):

    * ``"none"``: ``x``, the pre-activation and the activation (as torch's unfused layers);
    * ``"activation"`` (default): ``x`` and the pre-activation; the activation is re-applied
      in backward (an elementwise op);
    * ``"full"``: ``x`` only; the first GEMM is recomputed too.

    ``x`` is not stored when it is a memkern norm's output. Dropout keeps no mask.
    Submodules ``fc1``, ``fc2`` (:class:`memkern.nn.Linear`), ``dropout``.
    """

    def __init__(self, in_features: int, hidden_features: int, out_features: int | None = None,
                 activation: str = "gelu", bias: bool = True, dropout: float = 0.0,
                 recompute: str = "activation", device=None, dtype=None) -> None:
        super().__init__()
        check_args(activation, recompute, "memkern.nn.MLP")
        out_features = in_features if out_features is None else out_features
        self.activation = activation
        self.recompute = recompute
        self.fc1 = Linear(in_features, hidden_features, bias=bias, device=device, dtype=dtype)
        self.fc2 = Linear(hidden_features, out_features, bias=bias, device=device, dtype=dtype)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = mlp(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias,
                activation=self.activation, recompute=self.recompute)
        return self.dropout(y)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, recompute={self.recompute!r}"

