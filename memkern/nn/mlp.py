"""MLP blocks with a choice of what is recomputed in backward."""
from __future__ import annotations

import torch
from torch import nn

from memkern.nn.dropout import Dropout
from memkern.nn.functional.mlp import check_args, mlp
from memkern.nn.functional.swiglu import swiglu
from memkern.nn.linear import Linear


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


class SwiGLU(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``: the Llama MLP.

    ``recompute`` — what is saved for backward (weights aside): ``"none"``: ``x``, ``gate``,
    ``up`` and ``h``; ``"activation"`` (default): ``x``, ``gate`` and ``up`` (``h`` is recomputed,
    elementwise); ``"full"``: ``x`` only (both input GEMMs are recomputed too). ``x`` is not stored
    when it is a memkern norm's output. Submodules ``gate_proj``, ``up_proj``, ``down_proj``.
    """

    def __init__(self, in_features: int, hidden_features: int, out_features: int | None = None,
                 bias: bool = False, recompute: str = "activation", device=None, dtype=None) -> None:
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
