"""Linear layers: drop-in ``nn.Linear`` (and GPT-2's ``Conv1D``) whose weight gradient is
accumulated straight into ``weight.grad`` when the grad buffer already holds one."""
from __future__ import annotations

import torch
from torch import nn

from memkern.nn.functional.linear import linear


def _compact(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x``, or a contiguous copy of it when it is a view that spans at most half of its
    storage and the weight's gradient will need it: kept for backward, a view keeps its whole
    storage alive (a classifier on ``hidden[:, 0]`` kept all of ``hidden``)."""
    # (Tensor._is_view: torch's own test for a view, private; asked before the storage because
    # tensor subclasses that are not views may have none)
    if (torch.compiler.is_compiling() or not weight.requires_grad or not torch.is_grad_enabled()
            or not x._is_view() or 2 * x.numel() * x.element_size() > x.untyped_storage().nbytes()):
        return x
    return x.clone(memory_format=torch.contiguous_format)


class Linear(nn.Linear):
    """``nn.Linear`` (same constructor, parameters and ``state_dict``).

    Saves for backward: the input only (none when the input is a memkern norm's output: the
    norm's input is reused; a copy of it when it is a view spanning at most half of its
    storage, e.g. ``hidden[:, 0]``, so that the storage is not kept). When ``weight.grad``
    exists — e.g. a view into the front end's :class:`memkern.GradBuffer` — the weight-gradient GEMM adds into it (``beta = 1``) with no
    transient ``dW``, and ``weight``'s post-accumulate-grad hooks still fire.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(_compact(input, self.weight), self.weight, self.bias)


class Conv1D(nn.Module):
    """GPT-2's ``Conv1D`` (``transformers.pytorch_utils.Conv1D``): a linear layer whose weight
    is stored ``[in_features, out_features]``; ``y = x @ weight + bias``. Same parameters and
    ``state_dict`` keys; the memkern behaviour of :class:`Linear`."""

    def __init__(self, nf: int, nx: int, device=None, dtype=None) -> None:
        super().__init__()
        self.nf = nf
        self.nx = nx
        self.weight = nn.Parameter(torch.empty(nx, nf, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(nf, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(_compact(x, self.weight), self.weight, self.bias, transposed=True)

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}"
