"""``memkern::mlp_layer``: memkern's two-layer MLP ``fc2(act(fc1(x)))`` as one op whose
autograd is C++ (csrc/autograd/mlp.cpp), at the host cost of torch's composition of C++
autograd nodes: what it computes, saves and recomputes is
:class:`memkern.nn.functional.mlp.MLPFunction`'s (see that module for the ``recompute``
table), the activations running as ``memkern::act_forward`` / ``act_backward``.

Arguments: ``x`` ``[..., in]``; ``fc1_weight`` ``[hidden, in]`` and ``fc2_weight``
``[out, hidden]`` (``[in, hidden]`` / ``[hidden, out]`` with ``transposed``), optional biases;
``activation`` one of :data:`memkern.ops.activation.KINDS`; ``recompute`` ``"none"``,
``"activation"`` or ``"full"``; the ``norm_*`` arguments (:mod:`._norm_recipe`) when ``x`` is
a memkern norm's output. One dtype for every tensor, no autocast.

Only the compiled extension registers its kernels (``Autograd`` and, below autograd,
``CompositeExplicitAutograd``); without it :mod:`memkern.nn.functional.mlp` runs the Python
``autograd.Function``.
"""
from __future__ import annotations

import torch

from memkern.ops import _norm_recipe
from memkern.ops._registry import LIBRARY, eager_entry

LIBRARY.define(
    "mlp_layer(Tensor x, Tensor fc1_weight, Tensor? fc1_bias, Tensor fc2_weight, "
    f"Tensor? fc2_bias, str activation, str recompute, bool transposed, {_norm_recipe.SCHEMA}) "
    "-> Tensor"
)


@torch.library.register_fake("memkern::mlp_layer", lib=LIBRARY)
def _fake(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, activation, recompute, transposed,
          *norm_recipe):
    out_features = fc2_weight.shape[1] if transposed else fc2_weight.shape[0]
    return x.new_empty((*x.shape[:-1], out_features))


mlp_layer = torch.ops.memkern.mlp_layer.default

# The eager entry point of memkern.nn.functional.mlp (:func:`memkern.ops._registry.eager_entry`): the
# op's arguments but the norm_* ones, which it takes from x's recipe; None when the op does not
# serve the call.
mlp_layer_entry = eager_entry("mlp_layer")
