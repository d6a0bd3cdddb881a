"""``memkern::linear_cross_entropy_layer``: :func:`memkern.nn.linear_cross_entropy` as one op
whose autograd is C++ (csrc/autograd/linear_cross_entropy.cpp): its node runs the loop ops of
:mod:`memkern.ops.linear_cross_entropy` (one block of logits at a time, the row ops of
:mod:`memkern.ops.cross_entropy`) through the dispatcher, so that ``torch.compile`` traces it
into those two opaque ops, at the host cost of a C++ autograd node.

Arguments: ``x`` ``[N, H]`` and ``weight`` ``[V, H]`` contiguous, one dtype; ``bias``
optional ``[V]``; ``target`` int64 ``[N]``; ``num_items`` (a device tensor) or ``divisor``
(a number) replaces the token count of ``reduction="mean"``/``"sum"`` (at most one given);
``reduction`` ("mean", "sum", "none"), ``ignore_index``, ``label_smoothing``, ``chunk_size``,
``vocab_block`` (0: the default of
:func:`memkern.ops.linear_cross_entropy.block_sizes`, computed in C++ by the same rule),
``softcap`` as in the functional. Returns the loss in ``x``'s dtype (``[N]`` for "none").

Saved for backward (as saved variables, which saved-tensor hooks see): the gradients the forward
computed (handed over on the one backward), and for the split algorithm ``x``, the weight, bias,
target and the per-token log-sum-exp.

Only the compiled extension registers its kernels (``Autograd`` and, below autograd,
``CompositeExplicitAutograd``), for every device: the functional calls it on every backend,
CPU and GPU, every dtype; without the extension the functional is torch's loss.
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

# The functional's eager entry point from Python (csrc/autograd/linear_cross_entropy.cpp):
# ``(input, weight, target, bias, ignore_index, reduction, label_smoothing, num_items, softcap,
# chunk_size, vocab_block)`` with ``num_items`` None or a tensor, ``softcap`` a number (0: none)
# and the sizes -1 for their defaults; it checks the arguments and flattens the inputs in C++
# and calls the op through a typed dispatcher handle, or returns None when the call is not one
# the op serves (the functional then raises its error, or calls the op through torch.ops).
linear_cross_entropy_layer_entry = eager_entry("linear_cross_entropy_layer")
