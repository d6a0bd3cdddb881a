"""``memkern::mlp_layer``: memkern's two-layer MLP ``fc2(act(fc1(x)))`` as one op whose
autograd is C++ (csrc/autograd/mlp.cpp), the layer's one implementation, at the host cost of
torch's composition of C++ autograd nodes; the activations run as ``memkern::act_forward`` /
``act_backward``. What it saves and recomputes per ``recompute``: the table of
:mod:`memkern.nn.mlp`.

Arguments: ``x`` ``[..., in]``; ``fc1_weight`` ``[hidden, in]`` and ``fc2_weight``
``[out, hidden]`` (``[in, hidden]`` / ``[hidden, out]`` with ``transposed``), optional biases;
``activation`` one of :data:`memkern.ops.activation.KINDS`; ``recompute`` ``"none"``,
``"activation"`` or ``"full"``; the ``norm_*`` arguments (:mod:`._gemm_layer`) when ``x`` is
a memkern norm's output. Under autocast the op computes in autocast's dtype (its output has
that dtype); otherwise every tensor shares ``x``'s dtype (:func:`memkern.nn.functional.mlp`
checks).

Only the compiled extension registers its kernels (``Autograd`` and, below autograd,
``CompositeExplicitAutograd``); ``torch.compile`` traces the C++ autograd into its inner ops,
which :data:`RECOMPUTED` lists per ``recompute`` for the compiled region.
"""
from __future__ import annotations

import torch

from memkern.ops._gemm_layer import NORM_RECIPE_SCHEMA, fake_output, recomputed_ops
from memkern.ops._registry import LIBRARY, eager_entry
from memkern.ops.activation import act_forward  # noqa: F401  (defines the op the node runs)

LIBRARY.define(
    "mlp_layer(Tensor x, Tensor fc1_weight, Tensor? fc1_bias, Tensor fc2_weight, "
    f"Tensor? fc2_bias, str activation, str recompute, bool transposed, {NORM_RECIPE_SCHEMA}) "
    "-> Tensor"
)


@torch.library.register_fake("memkern::mlp_layer", lib=LIBRARY)
def _fake(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, activation, recompute, transposed,
          *norm_recipe):
    return fake_output(x, fc2_weight.shape[1] if transposed else fc2_weight.shape[0])


mlp_layer = torch.ops.memkern.mlp_layer.default

RECOMPUTED = recomputed_ops("mlp_layer")
"""``{recompute: the inner ops the op's node runs again in backward}`` (empty without the
extension)."""

# The eager entry point of memkern.nn.functional.mlp (:func:`memkern.ops._registry.eager_entry`):
# the op's arguments but the norm_* ones, which it takes from x's recipe; None for a call that
# function refuses with its error (x not a tensor, mismatched shapes, mixed dtypes without
# autocast).
mlp_layer_entry = eager_entry("mlp_layer")
