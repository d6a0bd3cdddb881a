"""``memkern::dropout_layer``: ``mk.nn.Dropout``'s forward as one op whose autograd is C++
(csrc/autograd/dropout.cpp): it saves only the int64 seed and its backward regenerates the
mask with :mod:`memkern.ops.dropout`, at the host cost of ``nn.Dropout``'s call.

Arguments: ``x`` (float tensor), ``seed`` (int64, one element, on ``x``'s device; None draws
one from torch's generator of that device, in ``[0, 2**62)``), ``p``
(drop probability in [0, 1]).

Only the compiled extension registers its kernels (``Autograd`` and, below autograd,
``CompositeExplicitAutograd``); ``torch.compile`` traces the C++ autograd into
``aten::randint`` and ``memkern::dropout``.
"""
from __future__ import annotations

import torch

from memkern.ops._registry import LIBRARY, eager_entry

LIBRARY.define("dropout_layer(Tensor x, Tensor? seed, float p) -> Tensor")


@torch.library.register_fake("memkern::dropout_layer", lib=LIBRARY)
def _fake(x, seed, p):
    return torch.empty_like(x)


dropout_layer = torch.ops.memkern.dropout_layer.default

# The op's eager entry point from Python for a drawn seed, ``(x, p)`` (csrc/autograd/dropout.cpp):
# the call through a typed dispatcher handle instead of the boxed torch.ops path.
dropout_layer_entry = eager_entry("dropout_layer")
