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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

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
