"""``FusedAdamW``: ``torch.optim.AdamW``'s math, one ``memkern.ops.adamw_step_`` call per param
group and dtype over flat buffers (see :mod:`memkern.optim.flat_state` for what lives where)."""
from __future__ import annotations

from typing import Any

import torch

from memkern import ops
from memkern.kernels.state8bit import num_blocks
from memkern.optim.flat_state import FlatOptimizer
from memkern.optim.local_grads import LocalGrads
from memkern.optim.segment import Segment
from memkern.optim.state_precision import check_state_precision, wants_8bit_state


class AdamW:
    """The AdamW update rule over flat segments (hyper-parameters, state, kernel call)."""

    @staticmethod
    def defaults(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, state_precision: str = "32bit") -> dict[str, Any]:
        if not lr >= 0.0:
            raise ValueError(f"memkern AdamW: lr must be >= 0, got {lr}")
        if not eps >= 0.0:
            raise ValueError(f"memkern AdamW: eps must be >= 0, got {eps}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"memkern AdamW: betas must be two numbers in [0, 1), got {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"memkern AdamW: weight_decay must be >= 0, got {weight_decay}")
        check_state_precision("AdamW", state_precision)
        return {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                "state_precision": state_precision}

    @staticmethod
    def state_keys(group: dict[str, Any]) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    @staticmethod
    def quantized(p: torch.Tensor, group: dict[str, Any]) -> bool:
        return wants_8bit_state("AdamW", p, group)

    @staticmethod
    def zero_quantized_state(weights: torch.Tensor,
                             group: dict[str, Any]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        n = weights.numel()  # made from the weights: where they are (the planner follows)
        return {
            "exp_avg": (weights.new_zeros(n, dtype=torch.int8),
                        weights.new_zeros(num_blocks(n), dtype=torch.float32)),
            "exp_avg_sq": (weights.new_zeros(n, dtype=torch.uint8),
                           weights.new_zeros(num_blocks(n), dtype=torch.float32)),
        }

    @staticmethod
    def update(seg: Segment, group: dict[str, Any], grad_multiplier: torch.Tensor | None,
               found_inf: torch.Tensor | None) -> None:
        beta1, beta2 = group["betas"]
        if seg.quantized:
            m, m_absmax = seg.quantized_state["exp_avg"]
            v, v_absmax = seg.quantized_state["exp_avg_sq"]
            ops.adamw8bit_step_(seg.master, m, m_absmax, v, v_absmax, seg.grads,
                                seg.model_weights, seg.step, grad_multiplier, found_inf,
                                float(group["lr"]), float(beta1), float(beta2),
                                float(group["eps"]), float(group["weight_decay"]))
            return
        ops.adamw_step_(seg.master, seg.state["exp_avg"], seg.state["exp_avg_sq"], seg.grads,
                        seg.model_weights, seg.step, grad_multiplier, found_inf,
                        float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                        float(group["weight_decay"]))


class FusedAdamW(FlatOptimizer):
    """``torch.optim.AdamW`` (decoupled weight decay) as fused flat-buffer kernels.

    Args:
        params: tensors, ``(name, tensor)`` pairs or param-group dicts (each group may set
            its own ``lr``, ``betas``, ``eps``, ``weight_decay``). Float32, bfloat16 or float16
            parameters on one device; bfloat16/float16 ones get float32 master weights in
            ``state[p]["master_param"]``, and the kernel writes the rounded master back into
            the parameter in the same pass.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        grad_dtype: dtype of the flat gradient buffer (None: each parameter's own dtype).
        state_precision: ``"32bit"`` (float32 moments) or ``"8bit"``: the moments of every
            parameter of at least :data:`MIN_8BIT_NUMEL` elements stored block-wise in 8 bits
            (1 byte each plus a float32 absmax per 256 elements; the map, the block size and
            their accuracy are in :mod:`memkern.ops.adamw8bit`), dequantized and requantized
            inside the same fused step. 2.03 instead of 8 bytes of state per parameter.

    State per parameter: ``step``, ``exp_avg``, ``exp_avg_sq`` (float32), plus
    ``master_param`` for 16-bit parameters. With 8-bit state the moments live in the
    segments (:attr:`segments`), not in ``state[p]``; :meth:`state_dict` gives them as float32
    values read back from the codes, with ``state_precision`` ("8bit"/"32bit") per parameter,
    and loads only into an optimizer of the same ``state_precision``.
    """

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *,
                 grad_dtype: torch.dtype | None = None, state_precision: str = "32bit") -> None:
        super().__init__(params, AdamW.defaults(lr, betas, eps, weight_decay, state_precision),
                         algorithm=AdamW, grad_placement=LocalGrads(), grad_dtype=grad_dtype)
