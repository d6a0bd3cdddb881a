"""``memkern::swiglu_layer``: memkern's SwiGLU MLP ``down(silu(gate(x)) * up(x))`` as one op
whose autograd is C++ (csrc/autograd/swiglu.cpp), at the host cost of torch's composition of
C++ autograd nodes: what it computes, saves and recomputes is
:class:`memkern.nn.functional.swiglu.SwiGLUFunction`'s (see that module for the ``recompute``
table), the gated unit running as ``memkern::swiglu_forward`` / ``swiglu_backward``.

Arguments: ``x`` ``[..., in]``; ``gate_weight``, ``up_weight`` ``[hidden, in]`` and
``down_weight`` ``[out, hidden]``, each with an optional bias; ``recompute`` ``"none"``,
``"activation"`` or ``"full"``; the ``norm_*`` arguments (:mod:`._norm_recipe`) when ``x`` is a
memkern norm's output. One dtype for every tensor, no autocast.

Only the compiled extension registers its kernels (``Autograd`` and, below autograd,
``CompositeExplicitAutograd``); without it :mod:`memkern.nn.functional.swiglu` runs the Python
``autograd.Function``.
"""
from __future__ import annotations

import torch

from memkern.ops import _norm_recipe
from memkern.ops._registry import LIBRARY, eager_entry

LIBRARY.define(
    "swiglu_layer(Tensor x, Tensor gate_weight, Tensor? gate_bias, Tensor up_weight, "
    "Tensor? up_bias, Tensor down_weight, Tensor? down_bias, str recompute, "
    f"{_norm_recipe.SCHEMA}) -> Tensor"
)


@torch.library.register_fake("memkern::swiglu_layer", lib=LIBRARY)
def _fake(x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, recompute,
          *norm_recipe):
    return x.new_empty((*x.shape[:-1], down_weight.shape[0]))


swiglu_layer = torch.ops.memkern.swiglu_layer.default

# The eager entry point of memkern.nn.functional.swiglu (:func:`memkern.ops._registry.eager_entry`): the
# op's arguments but the norm_* ones, which it takes from x's recipe; None when the op does not
# serve the call.
swiglu_layer_entry = eager_entry("swiglu_layer")
