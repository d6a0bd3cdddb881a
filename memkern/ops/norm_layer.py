"""``memkern::norm_layer``: memkern's LayerNorm / RMSNorm over the last ``n_norm`` dimensions
as one op whose autograd is C++ (csrc/autograd/norm.cpp): it runs :mod:`memkern.ops.norm`'s
``norm_forward`` / ``norm_backward`` through the dispatcher and saves ``x``, the weight and the
per-row float32 (float64) ``mean`` / ``rstd`` — never the output — at the host cost of a C++
autograd node.

Arguments: ``x`` (float tensor ending with the normalised shape), ``weight`` / ``bias``
(optional, of the normalised shape; RMSNorm takes no bias), ``n_norm`` (how many trailing
dimensions are normalised), ``eps``, ``rms`` (False: LayerNorm, True: RMSNorm).

Only the compiled extension registers its kernels (``Autograd`` and, below autograd,
``CompositeExplicitAutograd``); without it :mod:`memkern.nn.functional.norm` runs the same
algorithm as a Python ``autograd.Function``.
"""
from __future__ import annotations

import torch

from memkern.ops._registry import LIBRARY, eager_entry

LIBRARY.define("norm_layer(Tensor x, Tensor? weight, Tensor? bias, int n_norm, float eps, "
               "bool rms) -> Tensor")


@torch.library.register_fake("memkern::norm_layer", lib=LIBRARY)
def _fake(x, weight, bias, n_norm, eps, rms):
    return torch.empty_like(x)


norm_layer = torch.ops.memkern.norm_layer.default

# The eager entry points of the norms (:func:`memkern.ops._registry.eager_entry`): the op's,
# with its arguments; and memkern.nn.functional's whole norm call, ``norm_entry(x,
# normalized_shape, weight, bias, eps, rms)``: torch's native_layer_norm where it saves what
# this op does, else this op, its output carrying the norm's recipe
# (:mod:`memkern.nn.functional._saved`); None when the Python path must take the call.
norm_layer_entry = eager_entry("norm_layer")
norm_entry = eager_entry("norm")
