"""``memkern::lora_layer``: a LoRA adapter added to its layer's output, ``base + scaling *
(dropout(x) @ A^T @ B^T + b_B)``, as one op whose autograd is C++ (csrc/autograd/lora.cpp).

Arguments: ``base`` ``[..., out]`` (the wrapped layer's output), ``x`` ``[..., in]`` (its
input), ``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``, ``lora_B_bias`` ``[out]`` or None,
``scaling``, ``p`` (the adapter's dropout probability; 0: none), ``seed`` (int64, one element,
on ``x``'s device; None draws one as :mod:`memkern.ops.dropout_layer` does), and the ``norm_*``
arguments (:mod:`._gemm_layer`) when ``x`` is a memkern norm's output: the op then saves the
norm's tensors instead of ``x``. The adapter computes in autocast's dtype when autocast is on,
else in ``lora_A``'s (``x`` cast to it); the output has ``base``'s dtype.

Only the compiled extension registers its kernels (``Autograd`` and, below autograd,
``CompositeExplicitAutograd``); ``torch.compile`` traces the C++ autograd into torch's GEMMs and
``memkern::dropout``.
"""
from __future__ import annotations

import torch

from memkern.ops._gemm_layer import NORM_RECIPE_SCHEMA
from memkern.ops._registry import LIBRARY, eager_entry

LIBRARY.define("lora_layer(Tensor base, Tensor x, Tensor lora_A, Tensor lora_B, "
               "Tensor? lora_B_bias, float scaling, float p, Tensor? seed, "
               f"{NORM_RECIPE_SCHEMA}) -> Tensor")


@torch.library.register_fake("memkern::lora_layer", lib=LIBRARY)
def _fake(base, x, lora_A, lora_B, lora_B_bias, scaling, p, seed, *norm_recipe):
    return torch.empty_like(base)


lora_layer = torch.ops.memkern.lora_layer.default

# The op's eager entry point from Python, ``(base, x, lora_A, lora_B, lora_B_bias, scaling, p)``
# (csrc/autograd/lora.cpp): the norm_* arguments taken from the recipe a memkern norm left on x,
# a seed drawn when p > 0, the call through a typed dispatcher handle; None for a call
# memkern.nn.functional.lora refuses with its error.
lora_layer_entry = eager_entry("lora_layer")
