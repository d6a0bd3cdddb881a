"""``FusedSGD``: ``torch.optim.SGD``'s math, one ``memkern.ops.sgd_step_`` call per param group
and dtype over flat buffers (see :mod:`memkern.optim.flat_state` for what lives where)."""
from __future__ import annotations

from typing import Any

import torch

from memkern import ops
from memkern.kernels.state8bit import num_blocks
from memkern.optim.flat_state import FlatOptimizer
from memkern.optim.local_grads import LocalGrads
from memkern.optim.segment import Segment
from memkern.optim.state_precision import check_state_precision, wants_8bit_state


class SGD:
    """The SGD (momentum, dampening, Nesterov) update rule over flat segments."""

    @staticmethod
    def defaults(lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False,
                 state_precision: str = "32bit") -> dict[str, Any]:
        if not lr >= 0.0:
            raise ValueError(f"memkern SGD: lr must be >= 0, got {lr}")
        if not momentum >= 0.0:
            raise ValueError(f"memkern SGD: momentum must be >= 0, got {momentum}")
        if not weight_decay >= 0.0:
            raise ValueError(f"memkern SGD: weight_decay must be >= 0, got {weight_decay}")
        if nesterov and (momentum <= 0.0 or dampening != 0.0):
            raise ValueError("memkern SGD: nesterov=True needs momentum > 0 and dampening = 0, got "
                             f"momentum={momentum}, dampening={dampening}")
        check_state_precision("SGD", state_precision)
        return {"lr": lr, "momentum": momentum, "dampening": dampening,
                "weight_decay": weight_decay, "nesterov": bool(nesterov),
                "state_precision": state_precision}

    @staticmethod
    def state_keys(group: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    @staticmethod
    def quantized(p: torch.Tensor, group: dict[str, Any]) -> bool:
        # Decided at construction whatever the momentum: momentum may be switched on later,
        # and the layout (8-bit parameters in segments of their own) is fixed.
        return wants_8bit_state("SGD", p, group)

    @staticmethod
    def zero_quantized_state(weights: torch.Tensor,
                             group: dict[str, Any]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        if group["momentum"] == 0:
            return {}  # no momentum, no state: nothing to quantize
        n = weights.numel()  # made from the weights: where they are (the planner follows)
        return {"momentum_buffer": (weights.new_zeros(n, dtype=torch.int8),
                                    weights.new_zeros(num_blocks(n), dtype=torch.float32))}

    @staticmethod
    def update(seg: Segment, group: dict[str, Any], grad_multiplier: torch.Tensor | None,
               found_inf: torch.Tensor | None) -> None:
        momentum = float(group["momentum"])
        hyper = (float(group["lr"]), momentum, float(group["dampening"]),
                 float(group["weight_decay"]), bool(group["nesterov"]))
        stored = seg.quantized_state if seg.quantized else seg.state
        if momentum != 0.0 and "momentum_buffer" not in stored:
            # Momentum was switched on after the start: like torch, start the buffer from the
            # next gradient (the kernel does that while the step counter is 0; SGD uses the
            # counter for nothing else).
            if seg.quantized:
                seg.quantized_state.update(SGD.zero_quantized_state(seg.weights, group))
            else:
                seg.add_state("momentum_buffer", torch.zeros_like(seg.master))
            seg.step.zero_()
        if momentum != 0.0 and seg.quantized:
            codes, absmax = seg.quantized_state["momentum_buffer"]
            ops.sgd8bit_step_(seg.master, codes, absmax, seg.grads, seg.model_weights, seg.step,
                              grad_multiplier, found_inf, *hyper)
            return
        ops.sgd_step_(seg.master, seg.state.get("momentum_buffer") if momentum != 0.0 else None,
                      seg.grads, seg.model_weights, seg.step, grad_multiplier, found_inf, *hyper)


class FusedSGD(FlatOptimizer):
    """``torch.optim.SGD`` as fused flat-buffer kernels.

    Args:
        params: tensors, ``(name, tensor)`` pairs or param-group dicts (each group may set its
            own hyper-parameters). Float32, bfloat16 or float16 parameters on one device;
            bfloat16/float16 ones get float32 master weights in ``state[p]["master_param"]``.
        lr, momentum, dampening, weight_decay, nesterov: as ``torch.optim.SGD``.
        grad_dtype: dtype of the flat gradient buffer (None: each parameter's own dtype).
        state_precision: ``"32bit"`` (a float32 momentum buffer) or ``"8bit"``: the momentum
            buffer of every parameter of at least
            :data:`~memkern.optim.state_precision.MIN_8BIT_NUMEL` elements stored block-wise in 8
            bits, as AdamW's first moment (1 byte each plus a float32 absmax per
            :data:`~memkern.kernels.state8bit.QBLOCK` elements; :mod:`memkern.ops.sgd8bit`),
            dequantized and requantized inside the same fused step. With ``momentum=0`` SGD
            keeps no state, so there is nothing to quantize: ``"8bit"`` is accepted and the
            step is the plain one (the buffer appears, in 8 bits, if momentum is switched on
            later).

    State per parameter: ``step``, ``momentum_buffer`` (float32, when momentum != 0), plus
    ``master_param`` for 16-bit parameters. With 8-bit state the momentum buffers of the
    quantized parameters live in the segments (:attr:`segments`), not in ``state[p]``;
    :meth:`state_dict` gives them as float32 values read back from the codes, with
    ``state_precision`` ("8bit"/"32bit") per parameter, and loads only into an optimizer of
    the same ``state_precision``.
    """

    def __init__(self, params: Any, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *,
                 grad_dtype: torch.dtype | None = None, state_precision: str = "32bit") -> None:
        super().__init__(params, SGD.defaults(lr, momentum, dampening, weight_decay, nesterov,
                                              state_precision),
                         algorithm=SGD, grad_placement=LocalGrads(), grad_dtype=grad_dtype)
