"""Dropout that saves no mask: only an int64 seed, from which backward regenerates the mask.

The algorithm is one op with C++ autograd, ``memkern::dropout_layer``
(:mod:`memkern.ops.dropout_layer`, csrc/autograd/dropout.cpp), for eager calls and
``torch.compile`` alike: it saves one int64 seed (8 bytes), drawn from torch's generator of the
input's device (``torch.manual_seed`` makes runs repeatable; ``torch.utils.checkpoint`` replays
it), and its backward applies :mod:`memkern.ops.dropout` with that seed to the gradient, so the
forward and backward masks are equal by construction. Without the compiled extension this is
torch's ``F.dropout`` (:mod:`memkern.nn.functional`).

:func:`dropout` is ``memkern.nn.functional.dropout``; :class:`Dropout` the module.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memkern.ops.dropout_layer import dropout_layer, dropout_layer_entry


def dropout(x: torch.Tensor, p: float = 0.5, training: bool = True,
            inplace: bool = False) -> torch.Tensor:
    """``F.dropout`` that keeps no mask for backward."""
    if not (0.0 <= p <= 1.0):
        raise ValueError(f"memkern.nn.functional.dropout: p={p} must be a probability in [0, 1]")
    if not training or p == 0.0:
        return x
    if dropout_layer_entry is None:
        return F.dropout(x, p, True, inplace)
    if inplace:
        return x.copy_(dropout_layer(x, None, float(p)))
    if torch.compiler.is_compiling():
        return dropout_layer(x, None, float(p))
    return dropout_layer_entry(x, float(p))  # the op, through its typed entry (host time)


class Dropout(nn.Dropout):
    """``nn.Dropout`` (same constructor). Saves for backward: one 8-byte seed; the backward
    regenerates the forward's mask from it (:mod:`memkern.ops.dropout`). Dropped elements are 0
    even where the input is NaN/inf (as CUDA's ``native_dropout``)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return dropout(input, self.p, self.training, self.inplace)
