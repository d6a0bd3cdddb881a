"""SwiGLU's gated unit ``silu(gate) * up`` as its own layer, for a SwiGLU MLP whose projections
are called as layers (LoRA-adapted ones, :mod:`memkern.nn.lora`) rather than read by the fused
:func:`memkern.nn.functional.swiglu`.

The algorithm is one op with C++ autograd, ``memkern::swiglu_unit_layer``
(:mod:`memkern.ops.swiglu_unit_layer`, csrc/autograd/swiglu_unit.cpp), for eager calls and
``torch.compile`` alike. It saves ``gate`` and ``up`` (what its gradient needs), never its
output; in eager mode the output carries a recipe naming them, so the down projection that
consumes it (memkern's Linear, or a LoRA adapter) keeps ``gate`` and ``up`` — nothing new —
instead of it, and rebuilds it in backward by the same kernel. torch's ``F.silu(gate) * up``
keeps ``gate``, ``silu(gate)`` and ``up``, and the down projection its input: four tensors of
the MLP's hidden size where this keeps two. 16-bit values are computed in float32 and rounded
once. Without the compiled extension this is torch's ``F.silu(gate) * up``.

:func:`swiglu_unit` is ``memkern.nn.functional.swiglu_unit``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from memkern.ops.swiglu_unit_layer import swiglu_unit_layer, swiglu_unit_layer_entry


def swiglu_unit(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` (one shape, dtype and device), saving ``gate`` and ``up`` only."""
    if swiglu_unit_layer_entry is None:
        return F.silu(gate) * up
    if not torch.compiler.is_compiling():
        out = swiglu_unit_layer_entry(gate, up)
        if out is not None:
            return out
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"memkern.nn.functional.swiglu_unit: {name} must be a floating-point "
                            f"tensor, got {got}")
    if (gate.shape, gate.dtype, gate.device) != (up.shape, up.dtype, up.device):
        raise ValueError(
            f"memkern.nn.functional.swiglu_unit: gate ({tuple(gate.shape)}, {gate.dtype}, "
            f"{gate.device}) and up ({tuple(up.shape)}, {up.dtype}, {up.device}) must have one "
            "shape, dtype and device")
    return swiglu_unit_layer(gate, up)
