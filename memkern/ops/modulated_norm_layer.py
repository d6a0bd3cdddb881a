"""``memkern::modulated_norm_layer``: adaLN's modulated LayerNorm (DiT's adaLN-Zero blocks),
``layer_norm(x) * (1 + scale) + shift``, as one op whose autograd is C++
(csrc/autograd/modulated_norm.cpp).

Arguments: ``x`` ``[batch, ..., features]`` (float), normalised over its last dimension without
affine parameters; ``scale``, ``shift`` ``[batch, features]``, per sample, broadcast over the
dimensions between, of ``x``'s dtype; ``eps``.

What is saved for backward: ``x``, its per-row ``mean`` and ``rstd`` (as torch's LayerNorm),
``scale`` and ``shift`` (``[batch, features]`` each) — never the normalised input nor the
output. Its eager entry (:data:`modulated_norm_layer_entry`) leaves the output's recipe
(:data:`memkern.ops._gemm_layer.MODULATED_LAYER_NORM`): a memkern Linear/MLP consuming the
output saves ``x``, ``scale`` and ``shift`` instead and rebuilds it in backward.

Only the compiled extension registers its kernels (``Autograd`` and, below autograd,
``CompositeExplicitAutograd``), made of ATen ops: any device; ``torch.compile`` traces them.
"""
from __future__ import annotations

import torch

from memkern.ops._registry import LIBRARY, eager_entry

LIBRARY.define("modulated_norm_layer(Tensor x, Tensor scale, Tensor shift, float eps) -> Tensor")


@torch.library.register_fake("memkern::modulated_norm_layer", lib=LIBRARY)
def _fake(x, scale, shift, eps):
    return torch.empty_like(x)


modulated_norm_layer = torch.ops.memkern.modulated_norm_layer.default

# The eager entry point (:func:`memkern.ops._registry.eager_entry`), ``modulated_norm_layer_entry(x,
# scale, shift, eps)``: the op, its output carrying its recipe; None when the Python path must
# take the call (autocast on x's device, mixed dtypes, shapes that do not fit).
modulated_norm_layer_entry = eager_entry("modulated_norm")
