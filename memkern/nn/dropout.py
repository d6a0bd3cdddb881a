"""Dropout that saves no mask."""
from __future__ import annotations

import torch
from torch import nn

from memkern.nn.functional.dropout import dropout


class Dropout(nn.Dropout):
    """``nn.Dropout`` (same constructor). Saves for backward: one 8-byte seed; the backward
    regenerates the forward's mask from it (:mod:`memkern.ops.dropout`). Dropped elements are 0
    even where the input is NaN/inf (as CUDA's ``native_dropout``)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return dropout(input, self.p, self.training, self.inplace)
