"""Triton kernels of ``memkern::swiglu_forward`` / ``memkern::swiglu_backward``
(memkern/ops/swiglu.py): ``h = silu(gate) * up`` and its gradient from the saved inputs."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from memkern.kernels import _nn_common as C
from memkern.kernels._common import round_to


@triton.jit
def _forward_kernel(a_ptr, b_ptr, h_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-a))
    tl.store(h_ptr + offs, round_to(a * s * b, h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(g_ptr, a_ptr, b_ptr, da_ptr, db_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-a))
    tl.store(db_ptr + offs, round_to(g * a * s, db_ptr.dtype.element_ty), mask=mask)
    tl.store(da_ptr + offs, round_to(g * b * s * (1.0 + a * (1.0 - s)), da_ptr.dtype.element_ty),
             mask=mask)


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    C.check("swiglu_forward", "gate", gate)
    C.check("swiglu_forward", "up", up)
    h = torch.empty_like(gate)
    n = gate.numel()
    if n:
        with C.device_guard(gate):
            _forward_kernel[C.grid(n)](gate, up, h, n, BLOCK=C.BLOCK, num_warps=C.NUM_WARPS)
    return h


def swiglu_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    for name, t in (("grad", grad), ("gate", gate), ("up", up)):
        C.check("swiglu_backward", name, t)
    d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    if n:
        with C.device_guard(gate):
            _backward_kernel[C.grid(n)](grad, gate, up, d_gate, d_up, n, BLOCK=C.BLOCK,
                                        num_warps=C.NUM_WARPS)
    return d_gate, d_up
