"""``memkern::unscale_``: in-place multiply of a flat gradient buffer by an inverse loss scale,
raising a device-side ``found_inf`` flag when any element is non-finite.

Arguments
    grads      1-D contiguous float32/bfloat16/float16, modified in place:
               ``grads[i] = round(float32(grads[i]) * inv_scale)``.
    found_inf  one-element float32 on the same device; set to 1.0 if any *input* element is
               inf or NaN, otherwise left as it was (so one flag can gather several buffers).
    inv_scale  one-element float32 on the same device, read by the kernel (no host sync).

Non-finite elements propagate as in plain torch (inf × s = inf, NaN stays NaN).
"""
from __future__ import annotations

import torch

from memkern.ops import _checks
from memkern.ops._registry import Op

SCHEMA = "(Tensor(a!) grads, Tensor(b!) found_inf, Tensor inv_scale) -> ()"


def _check(grads: torch.Tensor, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> torch.device:
    _checks.flat("unscale_", "grads", grads, _checks.ORACLE_DTYPES)
    _checks.scalar("unscale_", "found_inf", found_inf, grads)
    _checks.scalar("unscale_", "inv_scale", inv_scale, grads)
    return grads.device


def _fake(grads: torch.Tensor, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    _check(grads, found_inf, inv_scale)


def reference(grads: torch.Tensor, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    compute = torch.promote_types(grads.dtype, torch.float32)
    any_non_finite = (~torch.isfinite(grads)).any()
    found_inf.copy_(torch.where(any_non_finite, torch.ones_like(found_inf), found_inf))
    grads.copy_(grads.to(compute) * inv_scale.reshape(()).to(compute))


unscale_ = Op(
    "unscale_",
    SCHEMA,
    check=_check,
    fake=_fake,
    reference=reference,
    triton="memkern.kernels.unscale.unscale_",
    compiled_kernels=True,
)
