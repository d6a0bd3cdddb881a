"""``memkern::linear_layer``: memkern's Linear (``x @ W^T + b``; ``x @ W + b`` with ``transposed``)
as one op whose autograd is C++ (csrc/autograd/linear.cpp): the weight gradient is added
straight into ``W.grad`` when that exists (csrc/autograd/weight_grad.h), at the host
cost of ``nn.Linear``'s call.

When ``x`` is a memkern norm's output, the ``norm_*`` arguments (:mod:`._gemm_layer`) say how
to rebuild it, and the op saves those tensors instead of ``x``.

Only the compiled extension registers its kernels (``Autograd`` and, below autograd,
``CompositeExplicitAutograd``); ``torch.compile`` traces the C++ autograd into torch's GEMMs.
Under autocast the op computes in autocast's dtype (its output has that dtype); otherwise
``x``, ``W`` and ``b`` share one dtype (:func:`memkern.nn.functional.linear` checks).
"""
from __future__ import annotations

import torch

from memkern.ops._gemm_layer import NORM_RECIPE_SCHEMA, fake_output
from memkern.ops._registry import LIBRARY, eager_entry

LIBRARY.define(f"linear_layer(Tensor x, Tensor weight, Tensor? bias, bool transposed, "
               f"{NORM_RECIPE_SCHEMA}) -> Tensor")


@torch.library.register_fake("memkern::linear_layer", lib=LIBRARY)
def _fake(x, weight, bias, transposed, *norm_recipe):
    return fake_output(x, weight.shape[1] if transposed else weight.shape[0])


linear_layer = torch.ops.memkern.linear_layer.default

# The op's eager entry point from Python (csrc/autograd/linear.cpp): the same arguments but the
# norm_* ones, which it takes from the recipe a memkern norm left on x, the call through a
# typed dispatcher handle instead of the boxed torch.ops path. It returns
# torch.nn.functional.linear's result when memkern would do nothing differently (one dtype, no
# autocast, no recipe, no W.grad, not transposed), and None for a call
# memkern.nn.functional.linear refuses with its error (x not a tensor, mismatched shapes, mixed
# dtypes without autocast).
linear_layer_entry = eager_entry("linear_layer")
