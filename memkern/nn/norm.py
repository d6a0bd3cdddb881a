"""LayerNorm and RMSNorm that save the input and per-row statistics only.

The algorithm is one op with C++ autograd, ``memkern::norm_layer`` (:mod:`memkern.ops.norm_layer`,
csrc/autograd/norm.cpp), for eager calls and ``torch.compile`` alike. What is saved for
backward: the input ``x``, ``mean`` (LayerNorm) and ``rstd`` — float32 (float64 for float64
``x``), one per row — and the weight (a parameter). Never the normalised output: in eager mode
the output carries a recipe (csrc/autograd/saved_input.h), so a memkern Linear/MLP/SwiGLU
consuming it saves ``x`` and the parameters instead (storage the norm already holds) and
rebuilds it in backward; under ``torch.compile`` the norm runs in a region whose ops are all
recomputed in backward (:func:`memkern.nn._saved.compiled_region`).

LayerNorm is torch's own ``native_layer_norm`` (and its autograd) wherever that saves the same
thing — float32/float64 inputs, and 16-bit inputs on CUDA, with parameters of the input's
dtype; the ``memkern::norm_*`` kernel ops serve 16-bit inputs on the CPU (where torch's
statistics would be 16-bit) and RMSNorm. The op decides (csrc/autograd/norm.h). Under autocast
the norm computes in the input's dtype and returns that dtype (CUDA autocast would run torch's
layer norm on, and save, a float32 copy of a 16-bit input).

Host time per call: in eager mode the whole call — checks, the choice above, the recipe — is
one C++ entry (:data:`memkern.ops.norm_layer.norm_layer_entry`); the Python code below raises the
errors and serves ``torch.compile``. Without the compiled extension these are torch's own
``F.layer_norm`` / ``F.rms_norm`` (:mod:`memkern.nn.functional`).

:func:`layer_norm` and :func:`rms_norm` are ``memkern.nn.functional``'s; :class:`LayerNorm` and
:class:`RMSNorm` the modules.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from memkern.nn import _saved
from memkern.ops.norm_layer import norm_layer, norm_layer_entry


def _norm(x, normalized_shape, weight, bias, eps, rms, name):
    # The modules pass a tuple: the common case costs no conversion (torch.Size is a tuple).
    shape = (normalized_shape if type(normalized_shape) is tuple
             else tuple(normalized_shape) if isinstance(normalized_shape, Sequence)
             else (normalized_shape,))
    compiling = torch.compiler.is_compiling()
    if not compiling:
        y = norm_layer_entry(x, shape, weight, bias, eps, rms)
        if y is not None:
            return y
    if x.shape[x.dim() - len(shape):] != shape:  # also when x has fewer dimensions
        raise ValueError(
            f"memkern.nn.functional.{name}: input shape {tuple(x.shape)} does not end with "
            f"normalized_shape {shape}"
        )
    if (weight is not None and weight.shape != shape) or (bias is not None and bias.shape != shape):
        wrong_weight = weight is not None and weight.shape != shape
        pname, p = ("weight", weight) if wrong_weight else ("bias", bias)
        raise ValueError(
            f"memkern.nn.functional.{name}: {pname} has shape {tuple(p.shape)}, expected {shape}"
        )
    if compiling:
        # the whole norm recomputed in backward (a consumer never saves its output)
        return _saved.compiled_region(norm_layer, x, weight, bias, len(shape), float(eps), rms)
    # eager, shapes the entry could not read as int64 sizes: the op, leaving no recipe
    return norm_layer(x, weight, bias, len(shape), float(eps), rms)


def layer_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm`` saving ``x``, ``mean`` and ``rstd`` only."""
    if norm_layer_entry is None:
        return F.layer_norm(x, normalized_shape, weight, bias, eps)
    return _norm(x, normalized_shape, weight, bias, eps, False, "layer_norm")


def rms_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
             eps: float | None = None) -> torch.Tensor:
    """``F.rms_norm`` saving ``x`` and ``rstd`` only (``eps=None``: ``torch.finfo(x.dtype).eps``,
    as torch)."""
    if norm_layer_entry is None:
        return F.rms_norm(x, normalized_shape, weight, eps)
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    return _norm(x, normalized_shape, weight, None, eps, True, "rms_norm")


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
