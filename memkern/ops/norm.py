"""``memkern::norm_forward`` / ``memkern::norm_backward``: LayerNorm and RMSNorm over the last
dimension of a 2-D ``[rows, D]`` tensor, returning / consuming per-row statistics so that the
autograd layer saves the input and the statistics only, never the normalised output.

Arguments
    x        contiguous ``[rows, D]``, float32/bfloat16/float16/float64 (float64: not Triton).
    weight   optional ``[D]`` (any float dtype; math in float32), ``bias`` likewise (LayerNorm).
    eps      added to the variance (LayerNorm) / mean square (RMSNorm).
    rms      False: LayerNorm ``(x - mean) * rstd * w + b``; True: RMSNorm ``x * rstd * w``.
    dy       gradient of the output, like ``x``.
    mean, rstd   the statistics returned by ``norm_forward``: float32 (float64 for float64
                 ``x``) ``[rows]``; for RMSNorm ``mean`` is empty (``[0]``).

``norm_forward(x, weight, bias, eps, rms) -> (y, mean, rstd)`` with ``y`` of ``x``'s dtype.

Kernels: C++ on the CPU (csrc/cpu/norm.cpp) and on CUDA (csrc/cuda/norm.cu; both share the
per-row math of csrc/cuda/kernels/norm_math.h), Triton (memkern/kernels/norm.py), the reference
below.
``norm_backward(dy, x, weight, mean, rstd, rms) -> (dx, dweight, dbias)``; ``dweight`` and
``dbias`` are float32 (float64) ``[D]`` sums over rows, empty (``[0]``) when ``weight`` is None
(``dbias`` is ``dy.sum(0)`` whenever ``weight`` is given; the caller drops it without a bias).
"""
from __future__ import annotations

import torch

from memkern.ops import _checks
from memkern.ops._registry import Op


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    return _checks.compute_dtype(x.dtype)


def _check_params(op: str, x: torch.Tensor, weight, bias) -> None:
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        _checks.tensor(op, name, t)
        _checks.same_device(op, name, t, x, "x")
        if t.dim() != 1 or t.shape[0] != x.shape[1]:
            raise ValueError(
                f"memkern.ops.{op}: {name} has shape {tuple(t.shape)}; expected ({x.shape[1]},) "
                "to match the last dimension of x"
            )
    if bias is not None and weight is None:
        raise ValueError(f"memkern.ops.{op}: bias given without weight; pass both or neither")


def _check_x(op: str, x: torch.Tensor) -> None:
    _checks.tensor(op, "x", x)
    if x.dim() != 2:
        raise ValueError(
            f"memkern.ops.{op}: x must be 2-D [rows, D], got shape {tuple(x.shape)}; "
            "flatten the leading dimensions with x.reshape(-1, D)"
        )


def _check_forward(x, weight, bias, eps, rms) -> torch.device:
    _check_x("norm_forward", x)
    _check_params("norm_forward", x, weight, bias)
    if rms and bias is not None:
        raise ValueError("memkern.ops.norm_forward: RMSNorm (rms=True) takes no bias; pass None")
    if not eps >= 0:
        raise ValueError(f"memkern.ops.norm_forward: eps={eps} must be >= 0")
    return x.device


def _check_backward(dy, x, weight, mean, rstd, rms) -> torch.device:
    _check_x("norm_backward", x)
    _checks.tensor("norm_backward", "dy", dy)
    _checks.same_shape("norm_backward", "dy", dy, x, "x")
    _checks.same_device("norm_backward", "dy", dy, x, "x")
    _check_params("norm_backward", x, weight, None)
    sd = _stat_dtype(x)
    rows = x.shape[0]
    for name, t, n in (("mean", mean, 0 if rms else rows), ("rstd", rstd, rows)):
        if not isinstance(t, torch.Tensor) or t.dtype != sd or tuple(t.shape) != (n,):
            raise ValueError(
                f"memkern.ops.norm_backward: {name} must be the {sd} [{n}] statistic returned by "
                f"norm_forward, got "
                + (f"{t.dtype} of shape {tuple(t.shape)}"
                   if isinstance(t, torch.Tensor) else repr(t))
            )
        _checks.same_device("norm_backward", name, t, x, "x")
    return x.device


def _fake_forward(x, weight, bias, eps, rms):
    sd = _stat_dtype(x)
    rows = x.shape[0]
    mean = x.new_empty((0 if rms else rows,), dtype=sd)
    return torch.empty_like(x), mean, x.new_empty((rows,), dtype=sd)


def _fake_backward(dy, x, weight, mean, rstd, rms):
    sd = _stat_dtype(x)
    n = 0 if weight is None else x.shape[1]
    return torch.empty_like(x), x.new_empty((n,), dtype=sd), x.new_empty((n,), dtype=sd)


def forward_reference(x, weight, bias, eps, rms):
    cd = _stat_dtype(x)
    xc = x.to(cd)
    w = weight.to(cd) if weight is not None else None
    if rms:
        rstd = torch.rsqrt(xc.square().mean(-1) + eps)
        y = xc * rstd[:, None]
        if w is not None:
            y = y * w
        return y.to(x.dtype), x.new_empty((0,), dtype=cd), rstd
    b = bias.to(cd) if bias is not None else None
    y, mean, rstd = torch.native_layer_norm(xc, [x.shape[1]], w, b, eps)
    return y.to(x.dtype), mean.view(-1), rstd.view(-1)


def backward_reference(dy, x, weight, mean, rstd, rms):
    cd = _stat_dtype(x)
    xc, g = x.to(cd), dy.to(cd)
    w = weight.to(cd) if weight is not None else None
    if not rms:
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            g, xc, [x.shape[1]], mean[:, None], rstd[:, None], w, w,
            [True, w is not None, w is not None]
        )
        if w is None:
            return dx.to(x.dtype), x.new_empty((0,), dtype=cd), x.new_empty((0,), dtype=cd)
        return dx.to(x.dtype), dw, db
    xhat = xc * rstd[:, None]
    gw = g * w if w is not None else g
    dx = (gw - xhat * (gw * xhat).mean(-1, keepdim=True)) * rstd[:, None]
    if w is None:
        return dx.to(x.dtype), x.new_empty((0,), dtype=cd), x.new_empty((0,), dtype=cd)
    return dx.to(x.dtype), (g * xhat).sum(0), g.sum(0)


norm_forward = Op(
    "norm_forward",
    "(Tensor x, Tensor? weight, Tensor? bias, float eps, bool rms) -> (Tensor, Tensor, Tensor)",
    check=_check_forward,
    fake=_fake_forward,
    reference=forward_reference,
    triton="memkern.kernels.norm.norm_forward",
    compiled_kernels=True,
)

norm_backward = Op(
    "norm_backward",
    "(Tensor dy, Tensor x, Tensor? weight, Tensor mean, Tensor rstd, bool rms) "
    "-> (Tensor, Tensor, Tensor)",
    check=_check_backward,
    fake=_fake_backward,
    reference=backward_reference,
    triton="memkern.kernels.norm.norm_backward",
    compiled_kernels=True,
)
