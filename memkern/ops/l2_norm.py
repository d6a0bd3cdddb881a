"""``memkern::l2_norm``: the Euclidean norm of a flat buffer, accumulated in float32.

Arguments
    grads  1-D contiguous float32/bfloat16/float16 (read only).

Returns a 0-dim float32 tensor on the same device: ``sqrt(sum(float32(grads[i])**2))``.
A NaN anywhere gives NaN, an inf (and no NaN) gives inf, as ``torch.linalg.vector_norm`` does;
the front end reads "the gradients hold a non-finite value" from the norm, so clipping and the
inf check share one read of the gradients. An empty buffer has norm 0.
"""
from __future__ import annotations

import torch

from memkern.ops import _checks
from memkern.ops._registry import Op

SCHEMA = "(Tensor grads) -> Tensor"


def _check(grads: torch.Tensor) -> torch.device:
    _checks.flat("l2_norm", "grads", grads, _checks.ORACLE_DTYPES)
    return grads.device


def _fake(grads: torch.Tensor) -> torch.Tensor:
    _check(grads)
    return grads.new_empty((), dtype=torch.promote_types(grads.dtype, torch.float32))


def reference(grads: torch.Tensor) -> torch.Tensor:
    compute = torch.promote_types(grads.dtype, torch.float32)
    # Not torch.linalg.vector_norm: its CPU float32 kernel accumulates naively (relative error
    # 2e-6 at 65537 elements, 8e-4 at 2**24); torch.sum's cascade summation stays near 1e-7.
    return grads.to(compute).square().sum().sqrt()


l2_norm = Op(
    "l2_norm",
    SCHEMA,
    check=_check,
    fake=_fake,
    reference=reference,
    triton="memkern.kernels.l2_norm.l2_norm",
    compiled_kernels=True,
)
