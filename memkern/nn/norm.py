"""Normalisation layers that save the input and per-row statistics only."""
from __future__ import annotations

import torch
from torch import nn

from memkern.nn.functional.norm import layer_norm, rms_norm


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same constructor, parameters and ``state_dict``).

    Saves for backward: the input, float32 ``mean`` and ``rstd`` per row (and the parameters).
    The normalised output is never saved, by this module or by a memkern Linear/MLP consuming
    it (they rebuild it in backward from what this module saved). Without the compiled
    extension this is torch's ``F.layer_norm`` (:mod:`memkern.nn.functional`).
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (same constructor, parameters and ``state_dict``).

    Saves for backward: the input and a float32 ``rstd`` per row (and the weight); never the
    normalised output (see :class:`LayerNorm`).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)
