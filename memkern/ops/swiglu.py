"""``memkern::swiglu_forward`` / ``memkern::swiglu_backward``: the gated unit of a SwiGLU MLP,
``h = silu(gate) * up``, and its gradient recomputed from the saved ``gate`` and ``up``.

Arguments
    gate, up   contiguous, same shape and dtype (float32/bfloat16/float16/float64; float64: not
               Triton). Kernels: C++ on the CPU (csrc/cpu/swiglu.cpp) and on CUDA
               (csrc/cuda/swiglu.cu; both share the elementwise math of
               csrc/cuda/kernels/swiglu_math.h), Triton (memkern/kernels/swiglu.py).
    grad       gradient of ``h``, same shape and dtype.

``swiglu_backward`` returns ``(grad_gate, grad_up)``::

    s = sigmoid(gate)
    grad_up   = grad * gate * s
    grad_gate = grad * up * s * (1 + gate * (1 - s))

16-bit inputs are computed in float32 and rounded once (torch's unfused ``F.silu(g) * u``
rounds ``silu(g)`` first, so bf16/fp16 results differ from it by up to one rounding).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from memkern.ops import _checks
from memkern.ops._registry import Op


def _check_pair(op: str, gate: torch.Tensor, up: torch.Tensor) -> None:
    _checks.tensor(op, "gate", gate)
    _checks.tensor(op, "up", up)
    _checks.same_shape(op, "up", up, gate, "gate")
    _checks.same_dtype(op, "up", up, gate, "gate")
    _checks.same_device(op, "up", up, gate, "gate")


def _check_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.device:
    _check_pair("swiglu_forward", gate, up)
    return gate.device


def _check_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.device:
    _check_pair("swiglu_backward", gate, up)
    _checks.tensor("swiglu_backward", "grad", grad)
    _checks.same_shape("swiglu_backward", "grad", grad, gate, "gate")
    _checks.same_dtype("swiglu_backward", "grad", grad, gate, "gate")
    _checks.same_device("swiglu_backward", "grad", grad, gate, "gate")
    return gate.device


def _fake_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(gate)


def _fake_backward(grad, gate, up):
    return torch.empty_like(gate), torch.empty_like(up)


def forward_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    cd = _checks.compute_dtype(gate.dtype)
    return (F.silu(gate.to(cd)) * up.to(cd)).to(gate.dtype)


def backward_reference(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    cd = _checks.compute_dtype(gate.dtype)
    g, a, b = grad.to(cd), gate.to(cd), up.to(cd)
    s = torch.sigmoid(a)
    grad_up = g * a * s
    grad_gate = g * b * s * (1 + a * (1 - s))
    return grad_gate.to(gate.dtype), grad_up.to(up.dtype)


swiglu_forward = Op(
    "swiglu_forward",
    "(Tensor gate, Tensor up) -> Tensor",
    check=_check_forward,
    fake=_fake_forward,
    reference=forward_reference,
    triton="memkern.kernels.swiglu.swiglu_forward",
    compiled_kernels=True,
)

swiglu_backward = Op(
    "swiglu_backward",
    "(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)",
    check=_check_backward,
    fake=_fake_backward,
    reference=backward_reference,
    triton="memkern.kernels.swiglu.swiglu_backward",
    compiled_kernels=True,
)
