"""Linear layer whose weight gradient is accumulated straight into ``weight.grad``.

The algorithm is one op with C++ autograd, ``memkern::linear_layer``
(:mod:`memkern.ops.linear_layer`, csrc/autograd/linear.cpp), for eager calls and
``torch.compile`` alike. What is saved for backward: the input (cast to autocast's dtype under
autocast; when the input is a memkern norm's output, the norm's input and parameters instead,
to rebuild it — see csrc/autograd/saved_input.h) and the weight itself (a parameter, not an
activation; under autocast the low-precision copy is made again in backward instead of being
kept). When ``weight.grad`` exists, the weight-gradient GEMM adds into it.

``transposed=True`` takes the weight stored ``[in, out]`` (GPT-2's ``Conv1D``), computing
``x @ weight + bias``.

Host time per call: in eager mode the call goes through the op's typed entry point
(:data:`memkern.ops.linear_layer.linear_layer_entry`), which runs ``F.linear`` itself when
memkern would compute and save exactly what it does (one dtype, no autocast, no norm recipe,
not transposed, no ``weight.grad``). Without the compiled extension this is torch's linear
(:mod:`memkern.nn.functional`).

:func:`linear` is ``memkern.nn.functional.linear``; :class:`Linear` and :class:`Conv1D` (GPT-2's)
the modules, which copy a small view of a larger tensor before the layer keeps it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memkern.nn import _autocast
from memkern.ops.linear_layer import linear_layer, linear_layer_entry


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           transposed: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``x @ weight + bias`` with ``transposed=True``), saving
    only the input for backward and accumulating the weight gradient into ``weight.grad``."""
    if linear_layer_entry is None:
        return F.linear(x, weight.t() if transposed else weight, bias)
    if not torch.compiler.is_compiling():
        out = linear_layer_entry(x, weight, bias, transposed)
        if out is not None:
            return out
    in_features = weight.shape[0] if transposed else weight.shape[-1]
    if x.shape[-1:] != (in_features,):
        raise ValueError(
            f"memkern.nn.functional.linear: input has {x.shape[-1] if x.dim() else 'no'} features "
            f"(shape {tuple(x.shape)}) but the weight {tuple(weight.shape)} expects {in_features}"
        )
    _autocast.compute_dtype(x, weight, bias)  # raises for mixed dtypes without autocast
    return linear_layer(x, weight, bias, transposed)


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
    exists — e.g. a view into the front end's :class:`memkern.GradBuffer` — the weight-gradient GEMM
    adds into it (``beta = 1``) with no transient ``dW``, and ``weight``'s post-accumulate-grad
    hooks still fire.
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
