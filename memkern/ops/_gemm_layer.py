"""What memkern's GEMM layer ops (``memkern::linear_layer``, ``mlp_layer``, ``swiglu_layer``)
share on the Python side, each read from their C++ autograd (csrc/autograd/): the dtype their
output has, and, per ``recompute`` mode, the inner ops the MLP and SwiGLU nodes run again in
backward instead of saving their outputs.
"""
from __future__ import annotations

import torch

from memkern._extension import compiled


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
