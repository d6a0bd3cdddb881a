"""``memkern::cross_entropy_rows_``: cross-entropy of a block of logits rows, and (optionally) the
rows' gradient written over the logits in place — the fused row math of the chunked linear
cross-entropy (:mod:`memkern.ops.linear_cross_entropy`).

Arguments
    logits          contiguous ``[n, V]`` float32/bfloat16/float16 (float64: reference only);
                    overwritten with the gradient when ``compute_grad``.
    target          int64 ``[n]`` class indices; rows equal to ``ignore_index`` are ignored.
    row_scale       optional float32 (float64) ``[n]``: the gradient of row ``r`` is multiplied
                    by ``row_scale[r]`` (the ``reduction="none"`` backward passes the incoming
                    per-row gradient here).
    ignore_index    target value of ignored rows (loss 0, gradient 0).
    label_smoothing ``eps`` in [0, 1].
    compute_grad    write the gradient into ``logits``.

Returns the per-row loss, float32 (float64) ``[n]``::

    loss_r = lse_r - (1 - eps) * z[r, t_r] - eps * mean_c z[r, c]          (0 for ignored rows)
    grad[r, c] = row_scale_r * (softmax(z_r)_c - (1 - eps) * [c == t_r] - eps / V)

i.e. the loss and gradient of ``F.cross_entropy(z, t, reduction="sum", ignore_index=...,
label_smoothing=eps)``. Targets outside ``[0, V)`` (other than ``ignore_index``) raise on CPU
(a ``ValueError`` naming the row; the C++ kernel checks every target before writing a row); on
the GPU they are not checked (that would need a host sync): such a row gets loss
``lse - eps * mean(z)`` and no one-hot term.
"""
from __future__ import annotations

import torch

from memkern._fake import is_fake
from memkern.ops import _checks
from memkern.ops._registry import Op


def _check(logits, target, row_scale, ignore_index, label_smoothing, compute_grad) -> torch.device:
    op = "cross_entropy_rows_"
    _checks.tensor(op, "logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"memkern.ops.{op}: logits must be 2-D [n, V], got shape {tuple(logits.shape)}")
    if not isinstance(target, torch.Tensor) or target.dtype != torch.int64 or target.shape != logits.shape[:1]:
        raise ValueError(
            f"memkern.ops.{op}: target must be an int64 tensor of shape ({logits.shape[0]},), got "
            + (f"{target.dtype} of shape {tuple(target.shape)}" if isinstance(target, torch.Tensor) else repr(target))
        )
    _checks.same_device(op, "target", target, logits, "logits")
    if row_scale is not None:
        cd = _checks.compute_dtype(logits.dtype)
        if row_scale.dtype != cd or row_scale.shape != logits.shape[:1] or not row_scale.is_contiguous():
            raise ValueError(
                f"memkern.ops.{op}: row_scale must be a contiguous {cd} tensor of shape "
                f"({logits.shape[0]},), got {row_scale.dtype} of shape {tuple(row_scale.shape)}"
            )
        _checks.same_device(op, "row_scale", row_scale, logits, "logits")
    if not (0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"memkern.ops.{op}: label_smoothing={label_smoothing} must be in [0, 1]")
    return logits.device


def _check_target_range(logits, target, ignore_index) -> None:
    """The reference's CPU range check (6 ops and a host read; the C++ CPU kernel checks each
    row as it reads its target, at no extra cost). Fake targets have no values to check."""
    if logits.device.type == "cpu" and target.numel() and not is_fake(target):
        bad = (target != ignore_index) & ((target < 0) | (target >= logits.shape[1]))
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"memkern.ops.cross_entropy_rows_: target[{i}] = {int(target[i])} is not a class "
                f"index in [0, {logits.shape[1]}) nor ignore_index={ignore_index}"
            )


def _fake(logits, target, row_scale, ignore_index, label_smoothing, compute_grad):
    return logits.new_empty(logits.shape[:1], dtype=_checks.compute_dtype(logits.dtype))


def reference(logits, target, row_scale, ignore_index, label_smoothing, compute_grad):
    """``log_softmax`` once (the loss), then its ``exp`` (the softmax of the gradient) — the
    same roundings as torch's ``F.cross_entropy`` and its backward, so that a model using this
    follows torch's fp32 training trajectory closely (a softmax-only variant is ~2% faster on
    the CPU but rounds differently, which AdamW amplifies over steps)."""
    _check_target_range(logits, target, ignore_index)
    n, V = logits.shape
    cd = _checks.compute_dtype(logits.dtype)
    eps = float(label_smoothing)
    valid = target != ignore_index
    in_range = valid & (target >= 0) & (target < V)
    t = torch.where(in_range, target, 0)[:, None]
    zero = torch.zeros((), dtype=cd, device=logits.device)
    logp = torch.log_softmax(logits, 1, dtype=cd)
    loss = -(1.0 - eps) * torch.where(in_range, logp.gather(1, t)[:, 0], zero)
    if eps > 0.0:
        loss = loss - eps * logp.mean(1)
    loss = torch.where(valid, loss, zero)
    if compute_grad:
        # softmax, written straight into the logits when they are already in the compute dtype
        grad = logits if logits.dtype == cd else logp
        torch.exp(logp, out=grad)
        if eps > 0.0:
            grad.sub_(eps / V)
        grad.scatter_add_(1, t, (-(1.0 - eps) * in_range.to(cd))[:, None])
        if row_scale is not None or logits.device.type != "cpu" or is_fake(logits):
            scale = valid.to(cd) if row_scale is None else valid.to(cd) * row_scale
            grad.mul_(scale[:, None])
        else:  # CPU: zero the ignored rows only (no pass over the whole block; a host read)
            ignored = (~valid).nonzero()[:, 0]
            if ignored.numel():
                grad.index_fill_(0, ignored, 0.0)
        if grad is not logits:
            logits.copy_(grad)
    return loss


cross_entropy_rows_ = Op(
    "cross_entropy_rows_",
    "(Tensor(a!) logits, Tensor target, Tensor? row_scale, int ignore_index, float label_smoothing, "
    "bool compute_grad) -> Tensor",
    check=_check,
    fake=_fake,
    reference=reference,
    triton="memkern.kernels.cross_entropy.cross_entropy_rows_",
    compiled_kernels=("cpu",),
)
