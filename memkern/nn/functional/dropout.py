"""Dropout that saves no mask: only an int64 seed, from which backward regenerates the mask.

What is saved for backward: one int64 seed (8 bytes). The mask of element ``i`` is a pure
function of ``(seed, i)`` (:mod:`memkern.ops.dropout`), and the backward applies the very same
op to the gradient, so forward and backward masks are equal by construction. The seed is drawn
from torch's generator of the input's device (``torch.manual_seed`` makes runs repeatable;
``torch.utils.checkpoint`` replays it when recomputing).

Host time per call: a call with a drawn seed, not in place, on the default backend runs as the
``memkern::dropout_layer`` op (:mod:`memkern.ops.dropout_layer`: this algorithm with C++
autograd, called through its direct entry point) when the extension is built; the Python
Function below serves the rest (a given seed, ``inplace``, a forced backend,
``torch.compile``, no extension). Both draw the same seed.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from memkern import backend, ops
from memkern._extension import check_same_in_cpp
from memkern.ops.dropout_layer import dropout_layer_entry

_SEED_HIGH = 1 << 62
"""Seeds are drawn from ``[0, _SEED_HIGH)``, as the C++ autograd draws them (the same masks)."""
check_same_in_cpp(__name__, {"DROPOUT_SEED_HIGH": _SEED_HIGH})


def draw_seed(device: torch.device) -> torch.Tensor:
    return torch.randint(0, _SEED_HIGH, (), dtype=torch.int64, device=device)


class DropoutFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seed, p, inplace):
        y = ops.dropout(x.contiguous(), seed, p)
        ctx.save_for_backward(seed)
        ctx.p = p
        if inplace:
            ctx.mark_dirty(x)
            return x.copy_(y)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (seed,) = ctx.saved_tensors
        return ops.dropout(grad.contiguous(), seed, ctx.p), None, None, None


def dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False,
            *, seed: torch.Tensor | None = None) -> torch.Tensor:
    """``F.dropout`` that keeps no mask for backward. ``seed`` (int64, one element, on ``x``'s
    device) fixes the mask; by default a fresh one is drawn."""
    if not (0.0 <= p <= 1.0):
        raise ValueError(f"memkern.nn.functional.dropout: p={p} must be a probability in [0, 1]")
    if not training or p == 0.0:
        return x
    if (seed is None and not inplace and dropout_layer_entry is not None
            and backend.requested() is None and not torch.compiler.is_compiling()):
        return dropout_layer_entry(x, float(p))
    if seed is None:
        seed = draw_seed(x.device)
    return DropoutFunction.apply(x, seed, float(p), inplace)
