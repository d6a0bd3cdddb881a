"""``FusedSGD``: ``torch.optim.SGD``'s math, one ``memkern.ops.sgd_step_`` call per param group
and dtype over flat buffers (see :mod:`memkern.optim.flat_state` for what lives where)."""
from __future__ import annotations

from typing import Any

import torch

from memkern import ops
from memkern.optim.flat_state import FlatOptimizer, Segment


class SGD:
    """The SGD (momentum, dampening, Nesterov) update rule over flat segments."""

    @staticmethod
    def defaults(lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False) -> dict[str, Any]:
        if not lr >= 0.0:
            raise ValueError(f"memkern SGD: lr must be >= 0, got {lr}")
        if not momentum >= 0.0:
            raise ValueError(f"memkern SGD: momentum must be >= 0, got {momentum}")
        if not weight_decay >= 0.0:
            raise ValueError(f"memkern SGD: weight_decay must be >= 0, got {weight_decay}")
        if nesterov and (momentum <= 0.0 or dampening != 0.0):
            raise ValueError("memkern SGD: nesterov=True needs momentum > 0 and dampening = 0, got "
                             f"momentum={momentum}, dampening={dampening}")
        return {"lr": lr, "momentum": momentum, "dampening": dampening,
                "weight_decay": weight_decay, "nesterov": bool(nesterov)}

    @staticmethod
    def state_keys(group: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    @staticmethod
    def quantized(p: torch.Tensor, group: dict[str, Any]) -> bool:
        return False  # 8-bit momentum is not implemented yet

    @staticmethod
    def update(seg: Segment, group: dict[str, Any], grad_multiplier: torch.Tensor | None,
               found_inf: torch.Tensor | None) -> None:
        momentum = float(group["momentum"])
        buffer = None
        if momentum != 0.0:
            buffer = seg.state.get("momentum_buffer")
            if buffer is None:
                # Momentum was switched on after the start: like torch, start the buffer from
                # the next gradient (the kernel does that while the step counter is 0; SGD
                # uses the counter for nothing else).
                buffer = seg.add_state("momentum_buffer", torch.zeros_like(seg.master))
                seg.step.zero_()
        ops.sgd_step_(seg.master, buffer, seg.grads, seg.model_weights, seg.step, grad_multiplier,
                      found_inf, float(group["lr"]), momentum, float(group["dampening"]),
                      float(group["weight_decay"]), bool(group["nesterov"]))


class FusedSGD(FlatOptimizer):
    """``torch.optim.SGD`` as fused flat-buffer kernels.

    Args:
        params: tensors, ``(name, tensor)`` pairs or param-group dicts (each group may set its
            own hyper-parameters). Float32, bfloat16 or float16 parameters on one device;
            bfloat16/float16 ones get float32 master weights in ``state[p]["master_param"]``.
        lr, momentum, dampening, weight_decay, nesterov: as ``torch.optim.SGD``.
        grad_dtype: dtype of the flat gradient buffer (None: each parameter's own dtype).

    State per parameter: ``step``, ``momentum_buffer`` (float32, when momentum != 0), plus
    ``master_param`` for 16-bit parameters.
    """

    algorithm = SGD

    def __init__(self, params: Any, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *,
                 grad_dtype: torch.dtype | None = None) -> None:
        super().__init__(params, SGD.defaults(lr, momentum, dampening, weight_decay, nesterov),
                         grad_dtype=grad_dtype)
