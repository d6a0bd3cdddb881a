"""``memkern::swiglu_layer``: memkern's SwiGLU MLP ``down(silu(gate(x)) * up(x))`` as one op
whose autograd is C++ (csrc/autograd/swiglu.cpp), the layer's one implementation, at the host
cost of torch's composition of C++ autograd nodes; the gated unit runs as
``memkern::swiglu_forward`` / ``swiglu_backward``. What it saves and recomputes per
``recompute``: the table of :mod:`memkern.nn.swiglu`.

Arguments: ``x`` ``[..., in]``; ``gate_weight``, ``up_weight`` ``[hidden, in]`` and
``down_weight`` ``[out, hidden]``, each with an optional bias; ``recompute`` ``"none"``,
``"activation"`` or ``"full"``; the ``norm_*`` arguments (:mod:`._gemm_layer`) when ``x`` is a
memkern norm's output. Under autocast the op computes in autocast's dtype (its output has that
dtype); otherwise every tensor shares ``x``'s dtype (:func:`memkern.nn.functional.swiglu`
checks).

Only the compiled extension registers its kernels (``Autograd`` and, below autograd,
``CompositeExplicitAutograd``); ``torch.compile`` traces the C++ autograd into its inner ops,
which :data:`RECOMPUTED` lists per ``recompute`` for the compiled region.
"""
from __future__ import annotations

import torch

from memkern.ops._gemm_layer import NORM_RECIPE_SCHEMA, fake_output, recomputed_ops
from memkern.ops._registry import LIBRARY, eager_entry
from memkern.ops.swiglu import swiglu_forward  # noqa: F401  (defines the op the node runs)

LIBRARY.define(
    "swiglu_layer(Tensor x, Tensor gate_weight, Tensor? gate_bias, Tensor up_weight, "
    "Tensor? up_bias, Tensor down_weight, Tensor? down_bias, str recompute, "
    f"{NORM_RECIPE_SCHEMA}) -> Tensor"
)


@torch.library.register_fake("memkern::swiglu_layer", lib=LIBRARY)
def _fake(x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, recompute,
          *norm_recipe):
    return fake_output(x, down_weight.shape[0])


swiglu_layer = torch.ops.memkern.swiglu_layer.default

RECOMPUTED = recomputed_ops("swiglu_layer")
"""``{recompute: the inner ops the op's node runs again in backward}`` (empty without the
extension)."""

# The eager entry point of memkern.nn.functional.swiglu
# (:func:`memkern.ops._registry.eager_entry`): the op's arguments but the norm_* ones, which it
# takes from x's recipe; None for a call that function refuses with its error (x not a tensor,
# mismatched shapes, mixed dtypes without autocast).
swiglu_layer_entry = eager_entry("swiglu_layer")
