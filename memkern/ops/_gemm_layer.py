"""What memkern's GEMM layer ops (``memkern::linear_layer``, ``mlp_layer``, ``swiglu_layer``,
``lora_layer``) share on the Python side, each read from their C++ autograd (csrc/autograd/):
the ``norm_*`` arguments of their schemas (the input's norm recipe, below), the dtype their
output has, and, per ``recompute`` mode, the inner ops the MLP and SwiGLU nodes run again in
backward instead of saving their outputs.

The ``norm_*`` arguments: the layer input's *recipe* when it is a memkern norm's output
(:mod:`memkern.nn.norm`), or a modulated LayerNorm's (:mod:`memkern.nn.modulated_norm`), or
SwiGLU's gated unit's (:mod:`memkern.nn.swiglu_unit`), so that the layer saves the norm's input
and parameters instead of the normalised output and rebuilds it in backward
(csrc/autograd/saved_input.h).

    norm_x, norm_weight, norm_bias   the norm's input and parameters (None: no recipe; the
                                     layer saves its input itself); for
                                     :data:`MODULATED_LAYER_NORM`, its input, scale and shift.
    norm_kind    which op rebuilds the output: :data:`NATIVE_LAYER_NORM`
                 (``torch.native_layer_norm``), :data:`LAYER_NORM` / :data:`RMS_NORM`
                 (``memkern::norm_forward`` over the flattened trailing dimensions),
                 :data:`MODULATED_LAYER_NORM` (``torch.native_layer_norm`` without affine
                 parameters, then ``* (1 + scale) + shift`` per sample); and
                 :data:`SWIGLU_UNIT`, the one producer that is not a norm: SwiGLU's gated unit
                 ``memkern::swiglu_forward(norm_x, norm_weight)`` (gate, up:
                 :mod:`.swiglu_unit_layer`).
    norm_dims    how many trailing dimensions of ``norm_x`` are normalised.
    norm_eps     the norm's eps.
"""
from __future__ import annotations

import torch

from memkern._extension import check_same_in_cpp, compiled

NATIVE_LAYER_NORM, LAYER_NORM, RMS_NORM, MODULATED_LAYER_NORM, SWIGLU_UNIT = 1, 2, 3, 4, 5

check_same_in_cpp(__name__, {"NORM_KINDS": {"native_layer_norm": NATIVE_LAYER_NORM,
                                            "layer_norm": LAYER_NORM, "rms_norm": RMS_NORM,
                                            "modulated_layer_norm": MODULATED_LAYER_NORM,
                                            "swiglu_unit": SWIGLU_UNIT}})

NORM_RECIPE_SCHEMA = ("Tensor? norm_x=None, Tensor? norm_weight=None, Tensor? norm_bias=None, "
                      "int norm_kind=0, int norm_dims=0, float norm_eps=0.")
"""The ``norm_*`` arguments, as they end each GEMM layer op's schema."""


def fake_output(x: torch.Tensor, out_features: int) -> torch.Tensor:
    """The output ``[..., out_features]`` of a GEMM layer op on ``x``, for its fake
    implementation: in autocast's dtype when autocast is on for ``x``'s device (``x``
    floating), else in ``x``'s (csrc/autograd/gemm.h, compute_dtype)."""
    device = x.device.type
    autocast = (x.is_floating_point() and torch.amp.is_autocast_available(device)
                and torch.is_autocast_enabled(device))
    dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
    return x.new_empty((*x.shape[:-1], out_features), dtype=dtype)


def recomputed_ops(layer: str) -> dict[str, frozenset[torch._ops.OpOverload]]:
    """``{recompute mode: the ops layer op `layer`'s node recomputes in backward}``, as the node
    states them (``memkern._C.recomputed_ops``, csrc/autograd/recomputed_ops.h); empty without
    the compiled extension. Under ``torch.compile`` the layer runs in a selective-checkpoint
    region that recomputes exactly these (:func:`memkern.nn._saved.compiled_region`):
    the compiler's partitioner would otherwise keep what the node recomputes."""
    if not compiled.has_cpu:
        return {}
    from memkern import _C

    def overload(name: str) -> torch._ops.OpOverload:  # "aten::to.dtype", "aten::mm"
        namespace, op = name.split("::")
        packet, _, overload_name = op.partition(".")
        return getattr(getattr(getattr(torch.ops, namespace), packet), overload_name or "default")

    return {mode: frozenset(map(overload, _C.recomputed_ops(layer, mode)))
            for mode in _C.RECOMPUTE}
