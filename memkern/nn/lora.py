"""A LoRA adapter on a linear layer, ``base + scaling * B(A(dropout(x)))``, that saves least.

The algorithm is one op with C++ autograd, ``memkern::lora_layer``
(:mod:`memkern.ops.lora_layer`, csrc/autograd/lora.cpp), for eager calls and ``torch.compile``
alike. It takes the wrapped layer's output ``base`` (that layer computes it: with its weight
frozen, memkern's :class:`~memkern.nn.Linear` saves nothing for it) and adds the adapter's
term. What it saves for backward (``A`` and ``B`` are parameters, not counted):

* the adapter's input ``x`` as given — nothing new when ``x`` is a memkern norm's output (the
  norm's input and parameters are saved instead, storage the norm keeps anyway, and ``x`` is
  rebuilt in backward, as memkern's Linear does after a norm: csrc/autograd/saved_input.h);
* the dropout's 8-byte seed (never a mask: backward regenerates it, as memkern's
  :class:`~memkern.nn.Dropout` does);
* not ``dropout(x) @ A^T`` (``[..., r]``): backward computes it again, one ``[tokens, in] x
  [in, r]`` GEMM.

The adapter computes in autocast's dtype when autocast is on, else in ``A``'s (``x`` is cast to
it, as PEFT casts the adapter's input); the result has ``base``'s dtype (PEFT's rule).
``A``'s and ``B``'s gradients are accumulated straight into existing ``.grad`` buffers. Without
the compiled extension this is plain torch: ``base + F.linear(F.linear(F.dropout(x), A), B,
b_B) * scaling``.

:func:`lora` is ``memkern.nn.functional.lora``. :func:`peft_lora_forward` is the forward of a
PEFT LoRA layer (``peft.tuners.lora.Linear`` and its 4-bit and 8-bit kin) that
:func:`memkern.patch` has swapped: its plain adapters through :func:`lora`, anything else
(DoRA and other variants, merged or disabled adapters, per-call ``adapter_names``, hooks on the
adapter's layers) through PEFT's own forward.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from memkern.nn import _autocast
from memkern.nn.dropout import Dropout
from memkern.nn.linear import Linear
from memkern.nn.split_mlp import hooked
from memkern.ops.lora_layer import lora_layer, lora_layer_entry

_NAME = "memkern.nn.functional.lora"


def lora(base: torch.Tensor, x: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor,
         lora_B_bias: torch.Tensor | None = None, *, scaling: float = 1.0, p: float = 0.0,
         training: bool = True) -> torch.Tensor:
    """``base + scaling * (F.linear(F.dropout(x, p, training) @ lora_A.T, lora_B, lora_B_bias))``
    in ``base``'s dtype: ``base`` ``[..., out]``, ``x`` ``[..., in]``, ``lora_A`` ``[r, in]``,
    ``lora_B`` ``[out, r]``. Saves what the module docstring lists."""
    if not (0.0 <= p <= 1.0):
        raise ValueError(f"{_NAME}: p={p} must be a probability in [0, 1]")
    p = float(p) if training else 0.0
    if lora_layer_entry is not None and not torch.compiler.is_compiling():
        out = lora_layer_entry(base, x, lora_A, lora_B, lora_B_bias, float(scaling), p)
        if out is not None:
            return out
    _check(base, x, lora_A, lora_B, lora_B_bias)
    if lora_layer_entry is None:
        xa = F.linear(F.dropout(x.to(lora_A.dtype), p, training), lora_A)
        return (base + F.linear(xa, lora_B, lora_B_bias) * scaling).to(base.dtype)
    return lora_layer(base, x, lora_A, lora_B, lora_B_bias, float(scaling), p, None)


def _check(base: torch.Tensor, x: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor,
           lora_B_bias: torch.Tensor | None) -> None:
    """The error for a call the layer op does not serve (csrc/autograd/lora.cpp, lora_call)."""
    for name, t in (("base", base), ("x", x), ("lora_A", lora_A), ("lora_B", lora_B)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_NAME}: {name} must be a tensor, got {type(t).__name__}")
    if lora_A.dim() != 2 or lora_B.dim() != 2 or lora_B.shape[1] != lora_A.shape[0]:
        raise ValueError(f"{_NAME}: lora_A {tuple(lora_A.shape)} and lora_B "
                         f"{tuple(lora_B.shape)} must be [r, in] and [out, r]")
    if x.dim() < 1 or x.shape[-1] != lora_A.shape[1]:
        raise ValueError(f"{_NAME}: x has shape {tuple(x.shape)} but lora_A "
                         f"{tuple(lora_A.shape)} expects {lora_A.shape[1]} features")
    if base.shape != (*x.shape[:-1], lora_B.shape[0]):
        raise ValueError(f"{_NAME}: base has shape {tuple(base.shape)}; the layer's output for x "
                         f"{tuple(x.shape)} and lora_B {tuple(lora_B.shape)} has "
                         f"{(*x.shape[:-1], lora_B.shape[0])}")
    if lora_B_bias is not None and lora_B_bias.shape != lora_B.shape[:1]:
        raise ValueError(f"{_NAME}: lora_B_bias has shape {tuple(lora_B_bias.shape)}, expected "
                         f"({lora_B.shape[0]},)")
    if not lora_A.is_floating_point():
        raise TypeError(f"{_NAME}: lora_A has dtype {lora_A.dtype}; the adapter computes in its "
                        "dtype, which must be floating point")
    if not _autocast.autocast_enabled(x.device.type):
        for name, t in (("lora_B", lora_B), ("lora_B_bias", lora_B_bias)):
            if t is not None and t.dtype != lora_A.dtype:
                raise RuntimeError(f"{_NAME}: {name} has dtype {t.dtype} but lora_A has "
                                   f"{lora_A.dtype}; give the adapter one dtype, or run under "
                                   "torch.autocast")


# ----------------------------------------------------------------------------------------------
# PEFT's LoRA layers, read by structure (PEFT is never imported): ``base_layer``; per adapter
# name, ``lora_A[name]`` / ``lora_B[name]`` (linear layers), ``lora_dropout[name]`` (a dropout
# or an identity), ``scaling[name]``; ``lora_variant`` (DoRA and others), ``merged``,
# ``disable_adapters``, ``active_adapters``, ``cast_input_dtype_enabled``.

_LINEARS = (nn.Linear, Linear)
_DROPOUTS = (nn.Dropout, Dropout)


def _plain_adapters(layer: nn.Module, x: torch.Tensor
                    ) -> list[tuple[nn.Linear, nn.Linear, float, float]] | None:
    """``(A, B, scaling, p)`` of each active adapter of a PEFT LoRA layer when all of them are
    plain LoRA that :func:`lora` computes exactly as PEFT's forward would; None otherwise."""
    if layer.disable_adapters or layer.merged:
        return None
    adapters = []
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        a, b, drop = layer.lora_A[name], layer.lora_B[name], layer.lora_dropout[name]
        if (name in getattr(layer, "lora_variant", {}) or type(a) not in _LINEARS
                or type(b) not in _LINEARS or a.bias is not None or hooked(a) or hooked(b)
                or hooked(drop) or not (type(drop) is nn.Identity or type(drop) in _DROPOUTS)):
            return None
        if x.dtype != a.weight.dtype and not getattr(layer, "cast_input_dtype_enabled", True):
            return None  # PEFT's forward then runs the layers on x as it is
        p = drop.p if type(drop) in _DROPOUTS and drop.training else 0.0
        adapters.append((a, b, float(layer.scaling[name]), p))
    return adapters


def peft_lora_forward(self: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The forward of a PEFT LoRA layer swapped by :func:`memkern.patch`: the wrapped layer's
    output, then each active plain adapter added by :func:`lora`; PEFT's own forward
    (``self._memkern_base``) for anything else."""
    adapters = None if args or kwargs else _plain_adapters(self, x)
    if adapters is None:
        return self._memkern_base.forward(self, x, *args, **kwargs)
    out = self.base_layer(x)
    for a, b, scaling, p in adapters:
        out = lora(out, x, a.weight, b.weight, b.bias, scaling=scaling, p=p)
    return out


def adapter_modules(layer: nn.Module) -> Iterator[nn.Module]:
    """The modules of a PEFT LoRA layer that belong to its adapters (all but ``base_layer``'s):
    its forward reads them, so :func:`memkern.patch` leaves them as PEFT made them."""
    for name, child in layer.named_children():
        if name != "base_layer":
            yield from child.modules()
