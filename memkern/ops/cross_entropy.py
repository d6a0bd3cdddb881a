"""The fused row math of the linear cross-entropy (:mod:`memkern.ops.linear_cross_entropy`):

* ``memkern::cross_entropy_rows_``: the cross-entropy and log-sum-exp of whole rows of logits,
  and (optionally) the rows' gradient written over the logits in place;
* ``memkern::cross_entropy_block_grad_``: the gradient of a block of columns of rows whose
  log-sum-exp is known, written over that block in place (the backward that recomputes the
  logits one block of classes at a time).

Both soft-cap the logits on the fly when ``softcap > 0`` (Gemma 2's ``final_logit_softcapping``):
with ``z' = softcap * tanh(z / softcap)`` every formula below is in ``z'`` and the gradient
(with respect to ``z``) carries the factor ``1 - tanh(z / softcap)^2``.

``cross_entropy_rows_(logits, target, row_scale, ignore_index, label_smoothing, compute_grad,
softcap=0.0) -> (loss, lse)``
    logits          contiguous ``[n, V]`` float32/bfloat16/float16/float64; overwritten with
                    the gradient when ``compute_grad``.
    target          int64 ``[n]`` class indices; rows equal to ``ignore_index`` are ignored.
    row_scale       optional float32 (float64 for float64 logits) contiguous ``[n]``: the
                    gradient of row ``r`` is multiplied by ``row_scale[r]``.
    Returns float32 (float64) ``[n]`` tensors::

        lse_r  = log sum_c exp z'[r, c]
        loss_r = lse_r - (1 - eps) * z'[r, t_r] - eps * mean_c z'[r, c]
        grad[r, c] = row_scale_r * (exp(z'[r, c] - lse_r) - eps / V - (1 - eps) * [c == t_r])

    (loss and lse 0, gradient 0 for ignored rows, whose logits are not read), i.e. the loss and
    gradient of ``F.cross_entropy(z', t, reduction="sum", ignore_index=...,
    label_smoothing=eps)``.

``cross_entropy_block_grad_(logits, lse, target, row_scale, class_offset, num_classes,
ignore_index, label_smoothing, softcap=0.0) -> ()``
    logits          contiguous ``[n, w]``: columns ``class_offset .. class_offset + w - 1`` of
                    ``n`` rows of ``num_classes`` logits; overwritten with those columns of the
                    gradient above, with ``lse`` the rows' log-sum-exp from
                    ``cross_entropy_rows_`` (the same ``softcap``) and ``V = num_classes``.
    lse             contiguous ``[n]``, float32 (float64).
    row_scale       ``[n]``, float32 (float64), any stride (an expanded scalar has stride 0).

Kernels: C++ on the CPU and CUDA C++ on the GPU, both on the per-row math of
``csrc/cuda/kernels/cross_entropy_math.h`` (an online softmax over tiles of 16 bytes of logits,
two reads of a row and one write); Triton where the CUDA kernels were not built. Targets
outside ``[0, V)`` other than ``ignore_index`` raise on the CPU (a ``ValueError`` naming the
row, before anything is written); on the GPU they are not checked (that would need a host
sync) and never read out of bounds: such a row gets loss ``lse - eps * mean(z')`` and no
one-hot term.
"""
from __future__ import annotations

import torch

from memkern._fake import is_fake
from memkern.ops import _checks
from memkern.ops._registry import Op


def _check_common(op, logits, target, label_smoothing, softcap):
    _checks.tensor(op, "logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"memkern.ops.{op}: logits must be 2-D [n, V], got shape "
                         f"{tuple(logits.shape)}")
    if (not isinstance(target, torch.Tensor) or target.dtype != torch.int64
            or target.shape != logits.shape[:1]):
        raise ValueError(
            f"memkern.ops.{op}: target must be an int64 tensor of shape ({logits.shape[0]},), got "
            + (f"{target.dtype} of shape {tuple(target.shape)}"
               if isinstance(target, torch.Tensor) else repr(target))
        )
    _checks.same_device(op, "target", target, logits, "logits")
    if not (0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"memkern.ops.{op}: label_smoothing={label_smoothing} must be in [0, 1]")
    if not (0.0 <= softcap < float("inf")):
        raise ValueError(f"memkern.ops.{op}: softcap={softcap} must be a finite number >= 0 "
                         "(0: no soft-capping)")


def _check_rows(op, name, t, logits, contiguous):
    cd = _checks.compute_dtype(logits.dtype)
    if (not isinstance(t, torch.Tensor) or t.dtype != cd or t.shape != logits.shape[:1]
            or (contiguous and not t.is_contiguous())):
        raise ValueError(
            f"memkern.ops.{op}: {name} must be a {'contiguous ' if contiguous else ''}{cd} tensor "
            f"of shape ({logits.shape[0]},), got "
            + (f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else repr(t))
        )
    _checks.same_device(op, name, t, logits, "logits")


def _check(logits, target, row_scale, ignore_index, label_smoothing, compute_grad, softcap=0.0):
    op = "cross_entropy_rows_"
    _check_common(op, logits, target, label_smoothing, softcap)
    if row_scale is not None:
        _check_rows(op, "row_scale", row_scale, logits, True)
    return logits.device


def _check_block(logits, lse, target, row_scale, class_offset, num_classes, ignore_index,
                 label_smoothing, softcap=0.0):
    op = "cross_entropy_block_grad_"
    _check_common(op, logits, target, label_smoothing, softcap)
    _check_rows(op, "lse", lse, logits, True)
    _check_rows(op, "row_scale", row_scale, logits, False)
    if not (0 <= class_offset and class_offset + logits.shape[1] <= num_classes):
        raise ValueError(
            f"memkern.ops.{op}: the block's columns are classes [{class_offset}, "
            f"{class_offset + logits.shape[1]}) but num_classes={num_classes}; the block must lie "
            "within the classes"
        )
    return logits.device


def _check_target_range(op, logits, target, ignore_index, num_classes) -> None:
    """The reference's CPU range check (a few ops and a host read; the C++ CPU kernels check
    each row as they read its target, at no extra cost). Fake targets have no values to check."""
    if logits.device.type == "cpu" and target.numel() and not is_fake(target):
        bad = (target != ignore_index) & ((target < 0) | (target >= num_classes))
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"memkern.ops.{op}: target[{i}] = {int(target[i])} is not a class "
                f"index in [0, {num_classes}) nor ignore_index={ignore_index}"
            )


def _fake(logits, target, row_scale, ignore_index, label_smoothing, compute_grad, softcap=0.0):
    cd = _checks.compute_dtype(logits.dtype)
    return (logits.new_empty(logits.shape[:1], dtype=cd),
            logits.new_empty(logits.shape[:1], dtype=cd))


def _fake_block(logits, lse, target, row_scale, class_offset, num_classes, ignore_index,
                label_smoothing, softcap=0.0):
    return None


def _capped(logits, cd, softcap):
    """The logits in the compute dtype, soft-capped: ``cap * tanh(z / cap)``; and the cap's
    slope ``1 - tanh^2 = 4 e / (1 + e)^2`` with ``e = exp(-2 |z / cap|)`` (None without a cap),
    accurate where tanh saturates (the kernels' formula)."""
    z = logits.to(cd)
    if softcap <= 0.0:
        return z, None
    u = z / softcap
    e = torch.exp(u.abs().mul_(-2.0))
    denominator = e.add(1.0).square_()
    return torch.tanh(u).mul_(softcap), e.mul_(4.0).div_(denominator)


def _finish_grad_(grad, valid, row_scale, slope):
    """``grad * row_scale`` (times the cap's slope), zero in ignored rows."""
    if row_scale is not None:
        grad.mul_(row_scale[:, None])
    if slope is not None:
        grad.mul_(slope)
    return grad.masked_fill_(~valid[:, None], 0.0)


def reference(logits, target, row_scale, ignore_index, label_smoothing, compute_grad, softcap=0.0):
    """``log_softmax`` once (the loss), then its ``exp`` (the softmax of the gradient) — the
    same roundings as torch's ``F.cross_entropy`` and its backward."""
    n, V = logits.shape
    _check_target_range("cross_entropy_rows_", logits, target, ignore_index, V)
    cd = _checks.compute_dtype(logits.dtype)
    eps = float(label_smoothing)
    valid = target != ignore_index
    in_range = valid & (target >= 0) & (target < V)
    t = torch.where(in_range, target, 0)[:, None]
    zero = torch.zeros((), dtype=cd, device=logits.device)
    z, slope = _capped(logits, cd, softcap)
    logp = torch.log_softmax(z, 1)
    lse = torch.logsumexp(z, 1)
    # an out-of-range target (GPU only) has no one-hot term: logp[t] stands in as -lse
    loss = -(1.0 - eps) * torch.where(in_range, logp.gather(1, t)[:, 0], -lse)
    if eps > 0.0:
        loss = loss - eps * logp.mean(1)
    loss = torch.where(valid, loss, zero)
    lse = torch.where(valid, lse, zero)
    if compute_grad:
        grad = torch.exp(logp, out=logp)
        if eps > 0.0:
            grad.sub_(eps / V)
        grad.scatter_add_(1, t, (-(1.0 - eps) * in_range.to(cd))[:, None])
        logits.copy_(_finish_grad_(grad, valid, row_scale, slope))
    return loss, lse


def block_grad_reference(logits, lse, target, row_scale, class_offset, num_classes, ignore_index,
                         label_smoothing, softcap=0.0):
    _check_target_range("cross_entropy_block_grad_", logits, target, ignore_index, num_classes)
    w = logits.shape[1]
    cd = _checks.compute_dtype(logits.dtype)
    eps = float(label_smoothing)
    valid = target != ignore_index
    local = target - class_offset
    hit = valid & (target >= 0) & (target < num_classes) & (local >= 0) & (local < w)
    z, slope = _capped(logits, cd, softcap)
    grad = torch.exp(z - lse[:, None])
    if eps > 0.0:
        grad.sub_(eps / num_classes)
    grad.scatter_add_(1, torch.where(hit, local, 0)[:, None], (-(1.0 - eps) * hit.to(cd))[:, None])
    logits.copy_(_finish_grad_(grad, valid, row_scale.expand(logits.shape[0]), slope))


cross_entropy_rows_ = Op(
    "cross_entropy_rows_",
    "(Tensor(a!) logits, Tensor target, Tensor? row_scale, int ignore_index, "
    "float label_smoothing, bool compute_grad, float softcap=0.0) -> (Tensor, Tensor)",
    check=_check,
    fake=_fake,
    reference=reference,
    triton="memkern.kernels.cross_entropy.cross_entropy_rows_",
    compiled_kernels=True,
)

cross_entropy_block_grad_ = Op(
    "cross_entropy_block_grad_",
    "(Tensor(a!) logits, Tensor lse, Tensor target, Tensor row_scale, int class_offset, "
    "int num_classes, int ignore_index, float label_smoothing, float softcap=0.0) -> ()",
    check=_check_block,
    fake=_fake_block,
    reference=block_grad_reference,
    triton="memkern.kernels.cross_entropy.cross_entropy_block_grad_",
    compiled_kernels=True,
)
