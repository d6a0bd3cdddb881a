"""The output layer and its loss, fused: never a ``[tokens, classes]`` tensor."""
from __future__ import annotations

import math

import torch
from torch import nn

from memkern.nn.functional.linear_cross_entropy import REDUCTIONS, linear_cross_entropy


class LinearCrossEntropy(nn.Module):
    """``F.cross_entropy(nn.Linear(in_features, num_classes, bias)(hidden), target)`` computed
    in chunks of tokens (:func:`memkern.nn.functional.linear_cross_entropy`).

    Parameters ``weight`` ``[num_classes, in_features]`` (and ``bias``), as ``nn.Linear``'s, so
    a language-model head's weights load (and can be tied to the embedding) unchanged.
    ``forward(hidden, target, num_items=None) -> loss``.
    """

    def __init__(self, in_features: int, num_classes: int, bias: bool = False,
                 ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 device=None, dtype=None) -> None:
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"memkern.nn.LinearCrossEntropy: reduction={reduction!r} is not one of {REDUCTIONS}")
        self.in_features = in_features
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.weight = nn.Parameter(torch.empty(num_classes, in_features, device=device, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.empty(num_classes, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:  # as nn.Linear
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, hidden: torch.Tensor, target: torch.Tensor,
                num_items: int | torch.Tensor | None = None) -> torch.Tensor:
        return linear_cross_entropy(hidden, self.weight, target, self.bias, self.ignore_index,
                                    self.reduction, self.label_smoothing, num_items)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, num_classes={self.num_classes}, "
                f"bias={self.bias is not None}, reduction={self.reduction!r}")
