"""``memkern::linear_cross_entropy_layer``: :func:`memkern.nn.functional.linear_cross_entropy`
as one op whose loops and autograd are C++ (csrc/autograd/linear_cross_entropy.cpp): the same
algorithm as :mod:`memkern.ops.linear_cross_entropy` (one block of logits at a time, the row
ops of :mod:`memkern.ops.cross_entropy` through the dispatcher) and the same saved tensors as
the Python ``autograd.Function``, at the host cost of a C++ autograd node.

Arguments: ``x`` ``[N, H]`` and ``weight`` ``[V, H]`` contiguous, one dtype; ``bias``
optional ``[V]``; ``target`` int64 ``[N]``; ``num_items`` (a device tensor) or ``divisor``
(a number) replaces the token count of ``reduction="mean"``/``"sum"`` (at most one given);
``reduction`` ("mean", "sum", "none"), ``ignore_index``, ``label_smoothing``, ``chunk_size``,
``vocab_block`` (0: the default of
:func:`memkern.ops.linear_cross_entropy.block_sizes`, computed in C++ by the same rule),
``softcap`` as in the functional. Returns the loss in ``x``'s dtype (``[N]`` for "none").

Only the compiled extension registers its kernels (``Autograd`` and, below autograd,
``CompositeExplicitAutograd``), for every device: the functional calls it on the default
backend, CPU and GPU, every dtype.
"""
from __future__ import annotations

import torch

from memkern.ops._registry import LIBRARY, eager_entry

LIBRARY.define(
    "linear_cross_entropy_layer(Tensor x, Tensor weight, Tensor? bias, Tensor target, "
    "Tensor? num_items, float? divisor, str reduction, int ignore_index, float label_smoothing, "
    "int chunk_size, int vocab_block, float softcap) -> Tensor"
)


@torch.library.register_fake("memkern::linear_cross_entropy_layer", lib=LIBRARY)
def _fake(x, weight, bias, target, num_items, divisor, reduction, ignore_index,
          label_smoothing, chunk_size, vocab_block, softcap):
    return x.new_empty((x.shape[0],) if reduction == "none" else ())


linear_cross_entropy_layer = torch.ops.memkern.linear_cross_entropy_layer.default

# The functional's eager entry point from Python (csrc/python_entries.cpp): ``(input, weight,
# target, bias, ignore_index, reduction, label_smoothing, num_items, softcap, chunk_size,
# vocab_block)`` with ``num_items`` None or a tensor, ``softcap`` a number (0: none) and the
# sizes 0 for their defaults; it checks the arguments and flattens the inputs in C++ and calls
# the op through a typed dispatcher handle, or returns None when the call is not one the op
# serves (the functional then takes it).
linear_cross_entropy_layer_entry = eager_entry("linear_cross_entropy_layer")
