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
* **attention**: the stand-in runs torch's CPU flash attention, which saves and returns what
  the GPU's flash, cuDNN and memory-efficient kernels do (``q, k, v``, the output in ``q``'s
  layout, float32 log-sum-exp);
* **workspaces no op returns** (CUDA): cuBLAS's workspace (one per thread that runs GEMMs:
  the main thread and autograd's device thread; 32 MiB on Hopper and later, 8.125 MiB
  before), taken from the caching allocator at its first GEMM and kept; flash attention's
  backward scratch (``softmax_d``, the float32 ``dq`` accumulator, and with grouped-query
  attention the key/value gradients of every query head before their sum), freed when it
  returns.

The CPU target has the exact allocator; memkern's C++ CPU kernels allocate nothing beyond
their outputs, but torch's 16-bit GEMMs on the CPU (oneDNN) do: packed copies of their
operands, freed when they return, whose size depends on the shapes and strides in ways the
library does not document. The planner measures them: one real GEMM of each shape, stride
and dtype on this CPU (up to ``CPU_GEMM_MEASURED_MACS``; larger ones, whose scratch is small
beside their operands, are taken to have none). So for ``logsumexp``, whose CPU kernel takes
a temporary of its input's size (the reference cross-entropy runs it on each logits block).
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from memkern import _fake
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

_ATTENTION_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_HALF = (torch.float16, torch.bfloat16)
_CPU_GEMMS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2)}
"""The CPU GEMMs whose 16-bit scratch is measured, with the positions of their two operands."""
CPU_GEMM_MEASURED_MACS = 1 << 28
"""The largest CPU GEMM (multiply-adds) whose scratch the planner measures by running it."""
_LOGSUMEXP = aten.logsumexp.default
CPU_LOGSUMEXP_MEASURED = 1 << 24
"""The largest ``logsumexp`` input (elements) whose CPU scratch the planner measures by running
it: torch's CPU kernel takes ``exp(x - max)`` into a temporary of the input's size (the
reference cross-entropy's log-sum-exp over a logits block); above, that size is taken."""

# The dispatcher sees torch.distributed's public collectives under these c10d op names (torch
# exposes no public handle on them); they exist in every torch build the planner runs on.
_GLOO_SCRATCH = {torch.ops.c10d._reduce_scatter_base_.default: 1,
                 torch.ops.c10d._allgather_base_.default: 0}
"""The collectives a sharded step runs (``reduce_scatter_tensor``, ``all_gather_into_tensor``)
with the position of the argument whose size gloo allocates and frees inside them: it
reduces or gathers into a full-size copy (measured with the allocation trace on 2 gloo ranks:
one input-sized block for a reduce-scatter, one output-sized block for an all-gather). NCCL
works in place, in its own buffers outside torch's allocator: a GPU target adds nothing."""


@functools.cache
def _cpu_scratch(func, layouts: tuple, others: tuple = ()) -> int:
    """Bytes a real ``func`` on this CPU allocates beyond its output, for tensor arguments of
    these ``(shape, stride, dtype)`` layouts followed by the arguments ``others``."""
    from memkern.profile.allocations import allocation_stats

    with _fake.without_dispatch_modes():
        args = [torch.empty_strided(shape, stride, dtype=dtype).uniform_(-1, 1)
                for shape, stride, dtype in layouts]
        stats = allocation_stats(func, *args, *others)
        out = stats.result
        return max(0, stats.peak - out.untyped_storage().nbytes())


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

    def workspaces(self, func, args, kwargs) -> list[int]:
        """Bytes ``func`` allocates and frees inside itself on the target (besides its outputs):
        on a GPU, flash attention's backward scratch (16-bit inputs; the stand-in's attention
        op saves and returns what the GPU's flash kernels do); on the CPU, a 16-bit GEMM's
        packed operands (measured: this module's docstring) and gloo's copy of a sharded
        step's collective buffer. (The fused cross-entropy row ops allocate nothing inside: an
        online softmax over the logits in place.)"""
        if self.name == "cpu":
            return self._cpu_workspaces(func, args)
        if func is not _ATTENTION_BACKWARD or args[1].dtype not in _HALF:
            return []
        q, k = args[1], args[2]
        b, h, t, d = q.shape
        t_r, d_r = _round_up(t, 128), (_round_up(d, 32) if d <= 192 else 256)
        sizes = [b * h * t_r * 4, b * t_r * h * d_r * 4]  # softmax_d, dq_accum (float32)
        if k.shape[1] != h:  # grouped-query attention: dk, dv of every query head, then summed
            sizes += [b * k.shape[2] * h * d * q.element_size()] * 2
        return sizes

    @staticmethod
    def _cpu_workspaces(func, args) -> list[int]:
        if func is _LOGSUMEXP:
            x = args[0]
            if x.numel() > CPU_LOGSUMEXP_MEASURED:  # its exp(x - max) temporary, x's size
                return [x.numel() * x.element_size()]
            others = tuple(tuple(a) if isinstance(a, list) else a for a in args[1:])  # dims
            scratch = _cpu_scratch(func, ((tuple(x.shape), tuple(x.stride()), x.dtype),), others)
            return [scratch] if scratch else []
        if func in _GLOO_SCRATCH:
            buffer = args[_GLOO_SCRATCH[func]]
            return [buffer.numel() * buffer.element_size()]
        operands = _CPU_GEMMS.get(func)
        if operands is None:
            return []
        a, b = args[operands[0]], args[operands[1]]
        if a.dtype not in _HALF or a.dim() != 2 or b.dim() != 2:
            return []
        if a.shape[0] * a.shape[1] * b.shape[1] > CPU_GEMM_MEASURED_MACS:
            return []
        layouts = tuple((tuple(t.shape), tuple(t.stride()), t.dtype)
                        for t in args[:operands[1] + 1])
        scratch = _cpu_scratch(func, layouts)
        return [scratch] if scratch else []


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
