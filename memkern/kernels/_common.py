"""What the Triton launchers share: argument checks, scalar packing, rounding, the step kernel.

Scalars that are known on the host (``lr``, betas, ...) are passed to kernels as float32
values rounded here, in float64, from the Python floats, so the compiled kernel and the
interpreter (which keeps Python floats as Python floats) see the same numbers. Where float32
is not precise enough (the bias corrections ``1 - beta**t`` of AdamW lose everything to
cancellation when ``beta`` carries float32's error), a float is split into a float32 pair
``hi + lo`` that the kernel adds up in float64.
"""
from __future__ import annotations

import contextlib
import struct

import torch
import triton
import triton.language as tl

BLOCK = 1024
"""Elements per program of the elementwise kernels (a multiple of 32 * NUM_WARPS)."""
NUM_WARPS = 4

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STATE_DTYPES = (torch.float32,)


def f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (returned as a Python float)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def split_f64(x: float) -> tuple[float, float]:
    """``(hi, lo)``, both float32 values, with ``hi + lo`` equal to ``x`` to ~48 bits."""
    hi = f32(x)
    return hi, f32(x - hi)


def check_buffer(op: str, name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...],
                 numel: int | None = None) -> None:
    """``t`` is a contiguous 1-D tensor of one of ``dtypes`` the Triton kernels handle."""
    if t.dtype not in dtypes:
        raise ValueError(
            f"memkern.{op} (triton): {name} has dtype {t.dtype}; the Triton kernel takes "
            f"{', '.join(str(d) for d in dtypes)} (float64 is for the reference backend only)"
        )
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(
            f"memkern.{op} (triton): {name} must be a contiguous 1-D flat buffer, got shape "
            f"{tuple(t.shape)}"
        )
    if numel is not None and t.numel() != numel:
        raise ValueError(
            f"memkern.{op} (triton): {name} has {t.numel()} elements, the other buffers {numel}"
        )


def check_scalar(op: str, name: str, t: torch.Tensor | None, device: torch.device) -> None:
    """``t`` (if given) is a one-element float32 tensor on ``device``."""
    if t is None:
        return
    if t.numel() != 1 or t.dtype != torch.float32 or t.device != device:
        raise ValueError(
            f"memkern.{op} (triton): {name} must be a one-element float32 tensor on {device}, "
            f"got {t.dtype} of shape {tuple(t.shape)} on {t.device}"
        )


def check_step_args(op: str, master: torch.Tensor, grads: torch.Tensor,
                    params: torch.Tensor | None, step: torch.Tensor,
                    grad_multiplier: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
    """What every optimizer-step launcher takes: a float32 master, gradients and the optional
    parameter copy of its length, and the three one-element device scalars."""
    n = master.numel()
    check_buffer(op, "master", master, STATE_DTYPES)
    check_buffer(op, "grads", grads, GRAD_DTYPES, n)
    if params is not None:
        check_buffer(op, "params", params, GRAD_DTYPES, n)
    for name, t in (("step", step), ("grad_multiplier", grad_multiplier), ("found_inf", found_inf)):
        check_scalar(op, name, t, master.device)


def step_pointers(master: torch.Tensor, params: torch.Tensor | None, step: torch.Tensor,
                  grad_multiplier: torch.Tensor | None, found_inf: torch.Tensor | None):
    """``(pointers, flags)`` of an optimizer-step kernel: its ``params_ptr, step_ptr,
    grad_multiplier_ptr, found_inf_ptr`` arguments (an absent tensor passed as a stand-in the
    kernel never reads) and the ``HAS_PARAMS``, ``HAS_MULTIPLIER``, ``HAS_FOUND_INF`` flags."""
    pointers = (params if params is not None else master, step,
                grad_multiplier if grad_multiplier is not None else step,
                found_inf if found_inf is not None else step)
    flags = dict(HAS_PARAMS=params is not None, HAS_MULTIPLIER=grad_multiplier is not None,
                 HAS_FOUND_INF=found_inf is not None)
    return pointers, flags


def device_guard(t: torch.Tensor):
    """Launch on ``t``'s GPU (Triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK),)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """float32 ``x`` rounded to nearest-even in ``dtype`` (float32/bfloat16/float16).

    bfloat16 is rounded by hand: the interpreter's own float32 -> bfloat16 cast truncates,
    while the GPU rounds to nearest even; this gives the GPU's (and torch's) result on both.
    NaNs stay NaN (sign and top payload bits kept, quiet bit set).
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def load_splat(ptr, BLOCK: tl.constexpr):
    """The scalar at ``ptr`` as a ``(BLOCK,)`` block.

    Compare the block, not the scalar, when the result is to be combined with a block mask:
    the interpreter splats a scalar comparison result as float32 (its dtype is kept from the
    operands), which ``mask & cond`` then rejects. The compiled kernel folds this away.
    """
    return tl.zeros((BLOCK,), dtype=tl.float32) + tl.load(ptr)


@triton.jit
def load_grads_and_master(grads_ptr, grad_multiplier_ptr, master_ptr, offs, mask,
                          HAS_MULTIPLIER: tl.constexpr):
    """``(grad, multiplier, master)`` at ``offs`` of an optimizer step: the gradients in
    float32, ``*grad_multiplier`` (1 without ``HAS_MULTIPLIER``) and the float32 master
    weights. The step multiplies them itself: AdamW also needs ``grad * multiplier - m``
    rounded once (csrc/math/adamw.h)."""
    grad = tl.load(grads_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    multiplier = tl.load(grad_multiplier_ptr) if HAS_MULTIPLIER else 1.0
    return grad, multiplier, tl.load(master_ptr + offs, mask=mask, other=0.0)


@triton.jit
def store_master_and_params(master, master_ptr, params_ptr, offs, mask,
                            HAS_PARAMS: tl.constexpr):
    """An optimizer step's write-back: ``master``, and its rounding into the parameter copy
    (when ``HAS_PARAMS``)."""
    tl.store(master_ptr + offs, master, mask=mask)
    if HAS_PARAMS:
        tl.store(params_ptr + offs, round_to(master, params_ptr.dtype.element_ty), mask=mask)


@triton.jit
def pow_f64(base, n):
    """``base ** n`` in float64 for a whole ``n >= 0``, by repeated squaring (n: int64)."""
    acc = tl.full((), 1.0, tl.float64)
    while n > 0:
        acc = tl.where((n & 1) != 0, acc * base, acc)
        base = base * base
        n = n >> 1
    return acc


@triton.jit
def _advance_step_kernel(step_ptr, found_inf_ptr, HAS_FOUND_INF: tl.constexpr):
    s = tl.load(step_ptr)
    if HAS_FOUND_INF:
        tl.store(step_ptr, s + 1.0, mask=tl.load(found_inf_ptr) == 0)
    else:
        tl.store(step_ptr, s + 1.0)


def advance_step_(step: torch.Tensor, found_inf: torch.Tensor | None) -> None:
    """``step += 1`` unless ``found_inf`` is set; launch after the kernel that reads ``step``."""
    _advance_step_kernel[(1,)](
        step, found_inf if found_inf is not None else step,
        HAS_FOUND_INF=found_inf is not None, num_warps=1,
    )
