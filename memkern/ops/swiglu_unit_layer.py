"""``memkern::swiglu_unit_layer``: SwiGLU's gated unit ``silu(gate) * up`` on its own, as one op
whose autograd is C++ (csrc/autograd/swiglu_unit.cpp): it saves ``gate`` and ``up``, never its
output, and in eager mode its output carries a recipe naming them (:mod:`._gemm_layer`'s
:data:`~memkern.ops._gemm_layer.SWIGLU_UNIT`), so the down projection consuming it saves them
instead of it. The math is :mod:`memkern.ops.swiglu`'s ``swiglu_forward`` / ``swiglu_backward``.

Arguments: ``gate``, ``up``: one shape, dtype and device, floating point.

Only the compiled extension registers its kernels (``Autograd`` and, below autograd,
``CompositeExplicitAutograd``); ``torch.compile`` traces the C++ autograd into the two kernel
ops.
"""
from __future__ import annotations

import torch

from memkern.ops._registry import LIBRARY, eager_entry
from memkern.ops.swiglu import swiglu_forward  # noqa: F401  (defines the op the node runs)

LIBRARY.define("swiglu_unit_layer(Tensor gate, Tensor up) -> Tensor")


@torch.library.register_fake("memkern::swiglu_unit_layer", lib=LIBRARY)
def _fake(gate, up):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


swiglu_unit_layer = torch.ops.memkern.swiglu_unit_layer.default

# The op's eager entry point from Python, ``(gate, up)`` (csrc/autograd/swiglu_unit.cpp): the
# call through a typed dispatcher handle, its output carrying the unit's recipe; None for a call
# memkern.nn.functional.swiglu_unit refuses with its error.
swiglu_unit_layer_entry = eager_entry("swiglu_unit_layer")
