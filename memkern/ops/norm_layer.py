"""``memkern::norm_layer``: memkern's LayerNorm / RMSNorm over the last ``n_norm`` dimensions
as one op whose autograd is C++ (csrc/autograd/norm.cpp), the norm's one algorithm: torch's
``native_layer_norm`` (and its autograd) where that saves the same thing, else
:mod:`memkern.ops.norm`'s ``norm_forward`` / ``norm_backward`` through the dispatcher, saving
``x``, the weight and the per-row float32 (float64) ``mean`` / ``rstd`` — never the output.
Under autocast it computes in ``x``'s dtype.

Arguments: ``x`` (float tensor ending with the normalised shape), ``weight`` / ``bias``
(optional, of the normalised shape; RMSNorm takes no bias), ``n_norm`` (how many trailing
dimensions are normalised), ``eps``, ``rms`` (False: LayerNorm, True: RMSNorm).

Only the compiled extension registers its kernels (``Autograd`` and, below autograd,
``CompositeExplicitAutograd``); ``torch.compile`` traces the C++ autograd into the ops it
calls. Without the extension :mod:`memkern.nn.norm` is torch's own norm.
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

# memkern.nn.functional's whole eager norm call (:func:`memkern.ops._registry.eager_entry`),
# ``norm_layer_entry(x, normalized_shape, weight, bias, eps, rms)``: this op (torch's
# native_layer_norm called directly where the op would run that), its output carrying the
# norm's recipe (csrc/autograd/saved_input.h); None for a call the Python path handles.
norm_layer_entry = eager_entry("norm")
