"""``memkern::act_forward`` / ``memkern::act_backward``: the MLP activations, and their gradient
computed from the saved pre-activation (what lets an MLP save the pre-activation only).

Arguments
    x      the pre-activation, contiguous float32/bfloat16/float16/float64 (float64: not Triton).
    grad   gradient of the activation's output, same shape and dtype as ``x``.
    kind   ``"gelu"`` (erf), ``"gelu_tanh"`` (tanh approximation, GPT-2's ``gelu_new``),
           ``"relu"`` or ``"silu"``.

Kernels: torch's own activation kernels, called from C++ on the CPU and on CUDA
(csrc/any_device/activation.cpp: the same single passes as the reference, without a Python
call); Triton (memkern/kernels/activation.py).

``act_forward(x, kind)`` equals ``F.gelu(x)`` / ``F.gelu(x, approximate="tanh")`` /
``F.relu(x)`` / ``F.silu(x)``; ``act_backward(grad, x, kind)`` is the gradient w.r.t. ``x``.
16-bit inputs are computed in float32 and rounded once (torch's own kernels do so per vector,
so the reference passes 16-bit tensors to them as they are: no float32 copy of the whole tensor,
which on the CPU, where the reference is the kernel, would be a transient as large as x twice).
NaN propagates as in torch (ReLU's gradient at NaN is the incoming gradient, as
``threshold_backward`` gives: only ``x <= 0`` stops it). One documented difference at
infinities: the erf-GELU of ``+inf`` is ``+inf`` in the Triton kernel (as in torch's CUDA
kernel), while torch's CPU kernel, used by the reference and the CPU backend, returns NaN.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from memkern._extension import check_same_in_cpp
from memkern.ops import _checks
from memkern.ops._registry import Op

KINDS = ("gelu", "gelu_tanh", "relu", "silu")
check_same_in_cpp(__name__, {"ACTIVATIONS": KINDS})


def check_kind(op: str, kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"memkern.ops.{op}: kind={kind!r} is not an activation; use one of "
                         f"{KINDS}")


def _check_forward(x: torch.Tensor, kind: str) -> torch.device:
    _checks.tensor("act_forward", "x", x)
    check_kind("act_forward", kind)
    return x.device


def _check_backward(grad: torch.Tensor, x: torch.Tensor, kind: str) -> torch.device:
    _checks.tensor("act_backward", "grad", grad)
    _checks.tensor("act_backward", "x", x)
    _checks.same_shape("act_backward", "grad", grad, x, "x")
    _checks.same_dtype("act_backward", "grad", grad, x, "x")
    _checks.same_device("act_backward", "grad", grad, x, "x")
    check_kind("act_backward", kind)
    return x.device


def _fake_forward(x: torch.Tensor, kind: str) -> torch.Tensor:
    return torch.empty_like(x)


def _fake_backward(grad: torch.Tensor, x: torch.Tensor, kind: str) -> torch.Tensor:
    return torch.empty_like(x)


def forward_reference(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "gelu":
        return F.gelu(x)
    if kind == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if kind == "relu":
        return torch.relu(x)
    if kind == "silu":
        return F.silu(x)
    check_kind("act_forward", kind)


def backward_reference(grad: torch.Tensor, x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "gelu":
        return torch.ops.aten.gelu_backward(grad, x)
    if kind == "gelu_tanh":
        return torch.ops.aten.gelu_backward(grad, x, approximate="tanh")
    if kind == "relu":
        return torch.ops.aten.threshold_backward(grad, x, 0)
    if kind == "silu":
        return torch.ops.aten.silu_backward(grad, x)
    check_kind("act_backward", kind)


act_forward = Op(
    "act_forward",
    "(Tensor x, str kind) -> Tensor",
    check=_check_forward,
    fake=_fake_forward,
    reference=forward_reference,
    triton="memkern.kernels.activation.act_forward",
    compiled_kernels=True,
)

act_backward = Op(
    "act_backward",
    "(Tensor grad, Tensor x, str kind) -> Tensor",
    check=_check_backward,
    fake=_fake_backward,
    reference=backward_reference,
    triton="memkern.kernels.activation.act_backward",
    compiled_kernels=True,
)
