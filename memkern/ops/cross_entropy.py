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
softcap=0.0, outputs=0, stats=None) -> (loss, lse)``
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
    outputs         per-row statistics to write into ``stats``, a mask of :data:`ROW_ENTROPY`
                    (the entropy ``-sum_c p log p`` of ``p = softmax(z')``, ``0 log 0 = 0``),
                    :data:`ROW_IS_TOP1` (1 where ``t_r`` is ``torch.argmax(z'[r])``: the first
                    maximum, or the first NaN; else 0) and :data:`ROW_MEAN_LOGIT`
                    (``mean_c z'[r, c]``); each costs nothing unless asked.
    stats           float32 (float64) ``[3, n]``, rows contiguous, given exactly when
                    ``outputs`` is not 0: its rows :data:`ENTROPY_ROW`, :data:`IS_TOP1_ROW`,
                    :data:`MEAN_LOGIT_ROW` written for the statistics asked (0 for ignored rows),
                    the others untouched.

``cross_entropy_block_grad_(logits, lse, target, row_scale, class_offset, num_classes,
ignore_index, label_smoothing, softcap=0.0, entropy=None, entropy_scale=None) -> ()``
    logits          contiguous ``[n, w]``: columns ``class_offset .. class_offset + w - 1`` of
                    ``n`` rows of ``num_classes`` logits; overwritten with those columns of the
                    gradient above, with ``lse`` the rows' log-sum-exp from
                    ``cross_entropy_rows_`` (the same ``softcap``) and ``V = num_classes``.
    lse             contiguous ``[n]``, float32 (float64).
    row_scale       ``[n]``, float32 (float64), any stride (an expanded scalar has stride 0).
    entropy, entropy_scale   optional, given together: the rows' entropy (``stats``' row of
                    ``cross_entropy_rows_``; contiguous ``[n]``) and a factor per row (any
                    stride): the gradient of ``row_scale * loss + entropy_scale * entropy``,
                    i.e. the above plus ``-entropy_scale_r * p (log p + entropy_r)`` (0 where
                    ``p`` is), before the cap's factor.

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
from memkern.kernels.row_stats import (
    ENTROPY_ROW,
    IS_TOP1_ROW,
    MEAN_LOGIT_ROW,
    ROW_ENTROPY,
    ROW_IS_TOP1,
    ROW_MEAN_LOGIT,
)
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


def _check_stats(op, outputs, stats, rows, like):
    """``outputs`` a mask of the ROW_* bits; ``stats`` a ``[3, rows]`` tensor in ``like``'s
    compute dtype and device, rows contiguous, given exactly when ``outputs`` is not 0."""
    if not isinstance(outputs, int) or outputs & ~(ROW_ENTROPY | ROW_IS_TOP1 | ROW_MEAN_LOGIT):
        raise ValueError(f"memkern.ops.{op}: outputs={outputs!r} must be a mask of ROW_ENTROPY, "
                         "ROW_IS_TOP1 and ROW_MEAN_LOGIT")
    if stats is None or outputs == 0:
        if (stats is None) != (outputs == 0):
            raise ValueError(f"memkern.ops.{op}: pass stats exactly when outputs is not 0 (got "
                             f"{'no stats' if stats is None else 'stats'} with outputs={outputs})")
        return
    cd = _checks.compute_dtype(like.dtype)
    if (not isinstance(stats, torch.Tensor) or stats.dtype != cd
            or tuple(stats.shape) != (3, rows) or (rows > 1 and stats.stride(1) != 1)):
        raise ValueError(
            f"memkern.ops.{op}: stats must be a {cd} tensor of shape (3, {rows}) with contiguous "
            "rows, got " + (f"{stats.dtype} of shape {tuple(stats.shape)}"
                            if isinstance(stats, torch.Tensor) else repr(stats)))
    _checks.same_device(op, "stats", stats, like, "logits")


def _check(logits, target, row_scale, ignore_index, label_smoothing, compute_grad, softcap=0.0,
           outputs=0, stats=None):
    op = "cross_entropy_rows_"
    _check_common(op, logits, target, label_smoothing, softcap)
    if row_scale is not None:
        _check_rows(op, "row_scale", row_scale, logits, True)
    _check_stats(op, outputs, stats, logits.shape[0], logits)
    return logits.device


def _check_block(logits, lse, target, row_scale, class_offset, num_classes, ignore_index,
                 label_smoothing, softcap=0.0, entropy=None, entropy_scale=None):
    op = "cross_entropy_block_grad_"
    _check_common(op, logits, target, label_smoothing, softcap)
    _check_rows(op, "lse", lse, logits, True)
    _check_rows(op, "row_scale", row_scale, logits, False)
    if (entropy is None) != (entropy_scale is None):
        raise ValueError(f"memkern.ops.{op}: entropy and entropy_scale go together (the "
                         "entropy's gradient term needs both); got only "
                         + ("entropy" if entropy is not None else "entropy_scale"))
    if entropy is not None:
        _check_rows(op, "entropy", entropy, logits, True)
        _check_rows(op, "entropy_scale", entropy_scale, logits, False)
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


def _fake(logits, target, row_scale, ignore_index, label_smoothing, compute_grad, softcap=0.0,
          outputs=0, stats=None):
    cd = _checks.compute_dtype(logits.dtype)
    return (logits.new_empty(logits.shape[:1], dtype=cd),
            logits.new_empty(logits.shape[:1], dtype=cd))


def _fake_block(logits, lse, target, row_scale, class_offset, num_classes, ignore_index,
                label_smoothing, softcap=0.0, entropy=None, entropy_scale=None):
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


def _entropy_term(p, logp, entropy, entropy_scale):
    """``entropy_scale * p (log p + entropy)`` per element, 0 where ``p`` is (``p log p -> 0``):
    what the entropy's part subtracts from a gradient before the cap's slope."""
    term = p * (logp + entropy[:, None])
    return torch.where(p == 0, 0.0, term).mul_(entropy_scale[:, None])


def _finish_grad_(grad, valid, row_scale, slope, entropy_term=None):
    """``grad * row_scale`` (less the entropy's term; times the cap's slope), zero in ignored
    rows."""
    if row_scale is not None:
        grad.mul_(row_scale[:, None])
    if entropy_term is not None:
        grad.sub_(entropy_term)
    if slope is not None:
        grad.mul_(slope)
    return grad.masked_fill_(~valid[:, None], 0.0)


def _write_stats(stats, outputs, z, logp, target, valid):
    """The statistics ``outputs`` asks for, from the (capped) logits and their log-softmax,
    into ``stats`` (0 in ignored rows): ``-sum p log p`` with ``0 log 0 = 0``, ``argmax == t``
    (torch's argmax: the first maximum, or the first NaN), the mean."""
    if outputs & ROW_ENTROPY:
        p = torch.exp(logp)
        plogp = torch.where(p == 0, 0.0, p * logp)
        stats[ENTROPY_ROW] = torch.where(valid, -plogp.sum(1), 0.0)
    if outputs & ROW_IS_TOP1:
        stats[IS_TOP1_ROW] = (valid & (z.argmax(1) == target)).to(stats.dtype)
    if outputs & ROW_MEAN_LOGIT:
        stats[MEAN_LOGIT_ROW] = torch.where(valid, z.mean(1), 0.0)


def reference(logits, target, row_scale, ignore_index, label_smoothing, compute_grad, softcap=0.0,
              outputs=0, stats=None):
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
    if outputs:
        _write_stats(stats, outputs, z, logp, target, valid)
    if compute_grad:
        grad = torch.exp(logp, out=logp)
        if eps > 0.0:
            grad.sub_(eps / V)
        grad.scatter_add_(1, t, (-(1.0 - eps) * in_range.to(cd))[:, None])
        logits.copy_(_finish_grad_(grad, valid, row_scale, slope))
    return loss, lse


def block_grad_reference(logits, lse, target, row_scale, class_offset, num_classes, ignore_index,
                         label_smoothing, softcap=0.0, entropy=None, entropy_scale=None):
    _check_target_range("cross_entropy_block_grad_", logits, target, ignore_index, num_classes)
    w = logits.shape[1]
    cd = _checks.compute_dtype(logits.dtype)
    eps = float(label_smoothing)
    valid = target != ignore_index
    local = target - class_offset
    hit = valid & (target >= 0) & (target < num_classes) & (local >= 0) & (local < w)
    z, slope = _capped(logits, cd, softcap)
    logp = z - lse[:, None]
    grad = torch.exp(logp)
    term = (None if entropy is None else
            _entropy_term(grad, logp, entropy, entropy_scale.expand(logits.shape[0])))
    if eps > 0.0:
        grad.sub_(eps / num_classes)
    grad.scatter_add_(1, torch.where(hit, local, 0)[:, None], (-(1.0 - eps) * hit.to(cd))[:, None])
    logits.copy_(_finish_grad_(grad, valid, row_scale.expand(logits.shape[0]), slope, term))


cross_entropy_rows_ = Op(
    "cross_entropy_rows_",
    "(Tensor(a!) logits, Tensor target, Tensor? row_scale, int ignore_index, "
    "float label_smoothing, bool compute_grad, float softcap=0.0, int outputs=0, "
    "Tensor(b!)? stats=None) -> (Tensor, Tensor)",
    check=_check,
    fake=_fake,
    reference=reference,
    triton="memkern.kernels.cross_entropy.cross_entropy_rows_",
    compiled_kernels=True,
)

cross_entropy_block_grad_ = Op(
    "cross_entropy_block_grad_",
    "(Tensor(a!) logits, Tensor lse, Tensor target, Tensor row_scale, int class_offset, "
    "int num_classes, int ignore_index, float label_smoothing, float softcap=0.0, "
    "Tensor? entropy=None, Tensor? entropy_scale=None) -> ()",
    check=_check_block,
    fake=_fake_block,
    reference=block_grad_reference,
    triton="memkern.kernels.cross_entropy.cross_entropy_block_grad_",
    compiled_kernels=True,
)
