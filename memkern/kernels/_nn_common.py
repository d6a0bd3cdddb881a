"""What the Triton kernels of :mod:`memkern.nn`'s ops share: dtype checks and launch sizes.

The math each launcher computes is defined by the ``reference`` of the matching op in
:mod:`memkern.ops`; 16-bit inputs are computed in float32 and rounded once on store (with
:func:`memkern.kernels._common.round_to`, which rounds bfloat16 to nearest-even on the GPU and
in the interpreter alike).
"""
from __future__ import annotations

import contextlib

import torch
import triton

BLOCK = 1024
"""Elements per program of the elementwise kernels."""
NUM_WARPS = 4
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check(op: str, name: str, t: torch.Tensor) -> None:
    """``t`` is a contiguous tensor of a dtype the Triton kernels take."""
    if t.dtype not in DTYPES:
        raise ValueError(
            f"memkern.ops.{op} (triton): {name} has dtype {t.dtype}; the Triton kernel takes "
            "float32, bfloat16 and float16 (float64 is for the reference backend only)"
        )
    if not t.is_contiguous():
        raise ValueError(f"memkern.ops.{op} (triton): {name} must be contiguous")


def device_guard(t: torch.Tensor):
    """Launch on ``t``'s GPU (Triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def grid(n: int, block: int = BLOCK) -> tuple[int]:
    return (triton.cdiv(n, block),)
