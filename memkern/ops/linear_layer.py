"""``memkern::linear_layer``: memkern's Linear (``x @ W^T + b``; ``x @ W + b`` with ``transposed``)
as one op whose autograd is C++ (csrc/autograd/linear.cpp): the weight gradient is added
straight into ``W.grad`` when that exists (see :mod:`memkern.nn.functional._grad`), at the host
cost of ``nn.Linear``'s call.

When ``x`` is a memkern norm's output, the ``norm_*`` arguments (:mod:`._norm_recipe`) say how
to rebuild it, and the op saves those tensors instead of ``x``.

Only the compiled extension registers its kernels (``Autograd`` and, below autograd,
``CompositeExplicitAutograd``); without it :mod:`memkern.nn.functional.linear` runs the same
algorithm as a Python ``autograd.Function``. Callers pass one dtype for ``x``, ``W`` and ``b``
and no autocast (the Python Function handles those).
"""
from __future__ import annotations

import torch

from memkern.ops import _norm_recipe
from memkern.ops._registry import LIBRARY, eager_entry

LIBRARY.define(f"linear_layer(Tensor x, Tensor weight, Tensor? bias, bool transposed, "
               f"{_norm_recipe.SCHEMA}) -> Tensor")


@torch.library.register_fake("memkern::linear_layer", lib=LIBRARY)
def _fake(x, weight, bias, transposed, *norm_recipe):
    out_features = weight.shape[1] if transposed else weight.shape[0]
    return x.new_empty((*x.shape[:-1], out_features))


linear_layer = torch.ops.memkern.linear_layer.default

# The op's eager entry point from Python (csrc/python_entries.cpp): the same arguments but the
# norm_* ones, which it takes from the recipe a memkern norm left on x
# (memkern.nn.functional._saved), the call through a typed dispatcher handle instead of the
# boxed torch.ops path. It returns
# torch.nn.functional.linear's result when there is no W.grad, no recipe and no transpose, and
# None when the op does not serve the call (mixed dtypes, autocast, a shape mismatch).
linear_layer_entry = eager_entry("linear_layer")
