"""Linear layers: drop-in ``nn.Linear`` (and GPT-2's ``Conv1D``) whose weight gradient is
accumulated straight into ``weight.grad`` when the grad buffer already holds one."""
from __future__ import annotations

import torch
from torch import nn

from memkern.nn.functional.linear import linear


class Linear(nn.Linear):
    """``nn.Linear`` (same constructor, parameters and ``state_dict``).

    Saves for backward: the input only (none when the input is a memkern norm's output: the
    norm's input is reused). When ``weight.grad`` exists — e.g. a view into the front end's
    :class:`memkern.GradBuffer` — the weight-gradient GEMM adds into it (``beta = 1``) with no
    transient ``dW``, and ``weight``'s post-accumulate-grad hooks still fire.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias)


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
        return linear(x, self.weight, self.bias, transposed=True)

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}"
