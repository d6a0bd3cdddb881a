"""adaLN's modulated LayerNorm, ``layer_norm(x) * (1 + scale) + shift`` with a per-sample scale
and shift (DiT's adaLN-Zero blocks), saving ``x`` and its row statistics only.

What is saved for backward: ``x``, its per-row ``mean`` and ``rstd``, and the ``[batch,
features]`` scale and shift — never the normalised input (torch's ``norm(x) * (1 + scale)``
keeps it for scale's gradient) nor the output: a memkern Linear/MLP consuming the output saves
the recipe's ``x``, scale and shift instead and rebuilds it in backward (csrc/autograd/
saved_input.h, kind :data:`memkern.ops._norm_recipe.MODULATED_LAYER_NORM`). The algorithm is
one op with C++ autograd, :mod:`memkern.ops.modulated_norm_layer`. Under autocast, or without
the compiled extension, it is torch's composition (what diffusers runs).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from memkern.nn import _autocast, _saved
from memkern.ops.modulated_norm_layer import modulated_norm_entry, modulated_norm_layer


def _per_sample(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``[batch, features]`` viewed to broadcast over ``[batch, ..., features]``."""
    return t.view(t.shape[0], *[1] * (dim - 2), t.shape[1])


def _check(x, scale, shift) -> None:
    name = "memkern.nn.functional.modulated_layer_norm"
    if x.dim() < 2:
        raise ValueError(f"{name}: x has shape {tuple(x.shape)}; it must be [batch, ..., features]")
    want = (x.shape[0], x.shape[-1])
    for arg, t in (("scale", scale), ("shift", shift)):
        if tuple(t.shape) != want:
            raise ValueError(f"{name}: {arg} has shape {tuple(t.shape)}, expected [batch, features] "
                             f"= {list(want)} for x of shape {tuple(x.shape)}")


def modulated_layer_norm(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                         eps: float = 1e-6) -> torch.Tensor:
    """``F.layer_norm(x, (features,), eps=eps) * (1 + scale) + shift`` for ``x`` ``[batch, ...,
    features]`` and ``scale``, ``shift`` ``[batch, features]`` (broadcast over the dimensions
    between), saving ``x`` and its row statistics only (see the module docstring)."""
    if modulated_norm_entry is not None and not torch.compiler.is_compiling():
        y = modulated_norm_entry(x, scale, shift, float(eps))
        if y is not None:
            return y
    _check(x, scale, shift)
    if (modulated_norm_entry is not None and scale.dtype == x.dtype == shift.dtype
            and not _autocast.autocast_enabled(x.device.type)):
        # compiled: the whole norm recomputed in backward (a consumer never saves its output)
        return _saved.compiled_region(modulated_norm_layer, x, scale, shift, float(eps))
    normed = F.layer_norm(x, (x.shape[-1],), eps=eps)
    return normed * (1 + _per_sample(scale, x.dim())) + _per_sample(shift, x.dim())
