"""The devices a training step can be planned for, and how each differs from the stand-in.

The planner (:mod:`memkern.profile.plan`) runs the step on fake CPU tensors: fake tensors on a
CUDA device cannot run backward on a machine without a GPU (the autograd engine needs the
device), so the CPU is the stand-in for every target. What the stand-in computes is what the
target allocates — each op's outputs, with their shapes, dtypes and strides — except where a
GPU runs a different algorithm or allocates memory that no op returns. A :class:`Target` says
those differences, and the planner applies them:

* **allocator**: how the target's allocator counts what it hands out
  (:mod:`memkern.profile.caching_allocator`);
* **memkern's device-dependent choices**: the planner runs memkern as on the target
  (:func:`memkern.backend.planning_for`): the kernels of the target device (their fake
  implementations: outputs only), the composite ops' references (every op they run), and the
  target's chunk sizes and code paths;
* **attention** (CUDA): ``F.scaled_dot_product_attention`` runs the backend a GPU picks (flash
  attention for 16-bit inputs without a mask, memory-efficient attention otherwise, the math
  decomposition when neither applies), with the outputs' memory layout of the CUDA kernels;
* **workspaces no op returns** (CUDA): cuBLAS's workspace (one per thread that runs GEMMs:
  the main thread and autograd's device thread; 32 MiB on Hopper and later, 8.125 MiB
  before), taken from the caching allocator at its first GEMM and kept; flash attention's
  backward scratch (``softmax_d``, the float32 ``dq`` accumulator, and with grouped-query
  attention the key/value gradients of every query head before their sum), freed when it
  returns.

The CPU target has the exact allocator and no workspace model: the C++ CPU kernels' own
scratch (the fused row op's float32 sub-block) is small next to a step's peak.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from memkern.profile.caching_allocator import CudaCachingAllocator, ExactAllocator

aten = torch.ops.aten

CUBLAS_WORKSPACE = {"sm90": 4096 * 8 * 1024, "sm80": 4096 * 1024 * 2 + 16 * 1024 * 8}
"""torch's default cuBLAS workspace per (handle, stream): ``:4096:8`` on compute capability 9.0,
``:4096:2:16:8`` before (``parseChosenWorkspaceSize`` in ATen/cuda/CublasHandlePool.cpp)."""

GEMMS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                   aten.mm.out, aten.addmm.out, aten.bmm.out, aten.mv.default, aten.addmv.default,
                   aten.mm.dtype, aten.mm.dtype_out, aten.addmm.dtype, aten.addmm.dtype_out,
                   aten._addmm_activation.default})
"""The ops that run cuBLAS (and so make the calling thread's workspace exist)."""

_FLASH = (aten._scaled_dot_product_flash_attention.default,
          aten._scaled_dot_product_flash_attention_backward.default)
_HALF = (torch.float16, torch.bfloat16)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class Target:
    """A device the planner plans for.

    ``name``: "cuda" (an NVIDIA GPU of compute capability ``arch``) or "cpu".
    """

    name: str
    arch: str = "sm90"

    @property
    def device_type(self) -> str:
        return "cuda" if self.name == "cuda" else "cpu"

    def describe(self) -> str:
        if self.name == "cuda":
            return (f"CUDA {self.arch} (caching allocator, cuBLAS workspace "
                    f"{CUBLAS_WORKSPACE[self.arch] / 2**20:g} MiB per thread)")
        return "CPU (exact allocator)"

    def allocator(self):
        return CudaCachingAllocator() if self.name == "cuda" else ExactAllocator()

    @property
    def gemm_workspace(self) -> int:
        """Bytes a thread's first GEMM takes and keeps (cuBLAS's workspace); 0 on the CPU."""
        return CUBLAS_WORKSPACE[self.arch] if self.name == "cuda" else 0

    def function_overrides(self) -> dict[Callable, Callable]:
        """Python-level functions the target computes differently (run instead, same result)."""
        if self.name == "cuda":
            return {F.scaled_dot_product_attention: cuda_scaled_dot_product_attention}
        return {}

    def adjust(self, func, args, kwargs, out):
        """``out`` as the target lays it out (an op's output strides where they differ)."""
        if self.name == "cuda" and func in _FLASH:
            return _flash_layout(func, args, out)
        return out

    def workspaces(self, func, args, kwargs) -> list[int]:
        """Bytes ``func`` allocates and frees inside itself on the target (besides its outputs)."""
        if self.name != "cuda" or func is not aten._scaled_dot_product_flash_attention_backward.default:
            return []
        grad_out, q, k = args[0], args[1], args[2]
        b, h, t, d = q.shape
        t_r, d_r = _round_up(t, 128), (_round_up(d, 32) if d <= 192 else 256)
        sizes = [b * h * t_r * 4, b * t_r * h * d_r * 4]  # softmax_d, dq_accum (float32)
        if k.shape[1] != h:  # grouped-query attention: dk, dv of every query head, then summed
            sizes += [b * k.shape[2] * h * d * q.element_size()] * 2
        return sizes


def _transposed_like(t: torch.Tensor) -> torch.Tensor:
    """A new tensor of ``t``'s shape laid out ``[B, T, H, D]`` under its ``[B, H, T, D]`` view,
    as the CUDA flash kernels allocate their outputs: ``empty_like`` of the transposed input
    (its strides when it is dense, contiguous otherwise)."""
    return torch.empty_like(t.transpose(1, 2)).transpose(1, 2)


def _flash_layout(func, args, out):
    if func is aten._scaled_dot_product_flash_attention.default:
        return (_transposed_like(args[0]), *out[1:])
    q, k, v = args[1], args[2], args[3]
    return tuple(_transposed_like(t) for t in (q, k, v))


def _flash_ok(q, k, v, attn_mask, dropout_p) -> bool:
    d = q.shape[-1]
    return (q.dtype in _HALF and q.dtype == k.dtype == v.dtype and attn_mask is None
            and q.dim() == 4 and d == k.shape[-1] == v.shape[-1] and d <= 256 and d % 8 == 0)


def _efficient_ok(q, k, v, attn_mask, enable_gqa) -> bool:
    return (q.dim() == 4 and q.dtype in (*_HALF, torch.float32) and q.dtype == k.dtype == v.dtype
            and q.shape[-1] % (8 if q.dtype in _HALF else 4) == 0
            and not (enable_gqa and k.shape[1] != q.shape[1]))


def cuda_scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                      is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` by the backend a GPU takes (torch's priority order:
    flash, memory-efficient, math), on the stand-in's fake tensors."""
    if torch.is_autocast_enabled("cpu"):  # autocast runs attention in its lower precision
        low = torch.get_autocast_dtype("cpu")
        query, key, value = (t.to(low) if t.dtype == torch.float32 else t
                             for t in (query, key, value))
    with torch.autocast("cpu", enabled=False):
        if _flash_ok(query, key, value, attn_mask, dropout_p):
            return aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, scale=scale)[0]
        if _efficient_ok(query, key, value, attn_mask, enable_gqa):
            bias = attn_mask
            if bias is not None and bias.dtype == torch.bool:
                bias = torch.zeros(bias.shape, dtype=query.dtype).masked_fill_(
                    bias.logical_not(), -math.inf)
            return aten._scaled_dot_product_efficient_attention(
                query, key, value, bias, query.requires_grad or key.requires_grad,
                dropout_p, is_causal, scale=scale)[0]
        return aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
            enable_gqa=enable_gqa)[0]


TARGETS = {"cuda": Target("cuda"), "cuda-sm80": Target("cuda", "sm80"), "cpu": Target("cpu")}
"""The targets by the names ``memkern plan --device`` takes: "cuda" (Hopper: H100, H200),
"cuda-sm80" (Ampere: A100), "cpu"."""


def target(name: str | Target) -> Target:
    if isinstance(name, Target):
        return name
    if name not in TARGETS:
        raise ValueError(f"memkern.profile: device {name!r} is not a planning target; use one of "
                         f"{', '.join(TARGETS)}")
    return TARGETS[name]
