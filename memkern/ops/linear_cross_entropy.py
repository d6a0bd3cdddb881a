"""``memkern::linear_cross_entropy_forward`` / ``memkern::linear_cross_entropy_backward``: the
cross-entropy of ``x @ weight.T + bias`` computed in chunks of tokens, so that no
``[tokens, classes]`` tensor ever exists — only one ``[chunk, classes]`` block at a time.

Each chunk: ``z = x_c @ W.T (+ b)`` (one GEMM into a reused block), the fused row op
:mod:`memkern.ops.cross_entropy` (loss rows, then the gradient written over ``z``), then
``dx_c = z @ W`` and ``dW += z.T @ x_c`` (``db += z.sum(0)``).

Arguments (both ops)
    x               contiguous ``[N, H]`` float32/bfloat16/float16 (float64: reference).
    weight          contiguous ``[V, H]``, same dtype as ``x``; ``bias`` optional ``[V]``.
    target          int64 ``[N]``.
    ignore_index, label_smoothing   as in ``F.cross_entropy``.
    chunk_size      tokens per chunk (>= 1).
    grad_input / grad_weight / grad_bias   which gradients to compute.

``linear_cross_entropy_forward(...) -> (loss, dx, dweight, dbias)``: ``loss`` is the float32
(float64) ``[N]`` per-token loss (0 at ignored tokens); the gradients are those of
``loss.sum()`` (``dx`` in ``x``'s dtype, ``dweight``/``dbias`` float32 (float64) accumulators),
each empty (``[0]``) when not requested.

``linear_cross_entropy_backward(grad_loss, ...) -> (dx, dweight, dbias)``: the gradients of
``(grad_loss * loss).sum()`` for a float32 (float64) ``[N]`` ``grad_loss`` (the
``reduction="none"`` backward: logits are recomputed chunk by chunk).

Both run as one composite implementation on every device (the GEMMs are torch's; the row op
picks its backend), so under ``torch.compile`` the whole chunk loop is one opaque node.
"""
from __future__ import annotations

import torch

from memkern.ops import _nn_registry as R
from memkern.ops.cross_entropy import cross_entropy_rows_

_ARGS = (
    "Tensor x, Tensor weight, Tensor? bias, Tensor target, int ignore_index, float label_smoothing, "
    "int chunk_size, bool grad_input, bool grad_weight, bool grad_bias"
)


def _check(x, weight, bias, target, ignore_index, label_smoothing, chunk_size, *flags, op="linear_cross_entropy_forward"):
    R.tensor(op, "x", x)
    R.tensor(op, "weight", weight)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"memkern.ops.{op}: x must be [N, H] and weight [V, H] with the same H, got "
            f"{tuple(x.shape)} and {tuple(weight.shape)}"
        )
    R.same_dtype(op, "weight", weight, x, "x")
    R.same_device(op, "weight", weight, x, "x")
    if bias is not None:
        R.tensor(op, "bias", bias)
        R.same_dtype(op, "bias", bias, x, "x")
        R.same_device(op, "bias", bias, x, "x")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"memkern.ops.{op}: bias has shape {tuple(bias.shape)}; expected ({weight.shape[0]},)")
    if not isinstance(target, torch.Tensor) or target.dtype != torch.int64 or tuple(target.shape) != (x.shape[0],):
        raise ValueError(
            f"memkern.ops.{op}: target must be int64 of shape ({x.shape[0]},), got "
            + (f"{target.dtype} of shape {tuple(target.shape)}" if isinstance(target, torch.Tensor) else repr(target))
        )
    R.same_device(op, "target", target, x, "x")
    if chunk_size < 1:
        raise ValueError(f"memkern.ops.{op}: chunk_size={chunk_size} must be >= 1")
    if not (0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"memkern.ops.{op}: label_smoothing={label_smoothing} must be in [0, 1]")
    return x.device


def _check_backward(grad_loss, x, weight, bias, target, *rest):
    op = "linear_cross_entropy_backward"
    device = _check(x, weight, bias, target, *rest, op=op)
    cd = R.compute_dtype(x.dtype)
    if not isinstance(grad_loss, torch.Tensor) or grad_loss.dtype != cd or tuple(grad_loss.shape) != (x.shape[0],):
        raise ValueError(
            f"memkern.ops.{op}: grad_loss must be a {cd} tensor of shape ({x.shape[0]},), got "
            + (f"{grad_loss.dtype} of shape {tuple(grad_loss.shape)}" if isinstance(grad_loss, torch.Tensor) else repr(grad_loss))
        )
    R.same_device(op, "grad_loss", grad_loss, x, "x")
    return device


def _grads_like(x, weight, bias, grad_input, grad_weight, grad_bias):
    cd = R.compute_dtype(x.dtype)
    dx = torch.empty_like(x) if grad_input else x.new_empty((0,))
    dw = weight.new_empty(weight.shape, dtype=cd) if grad_weight else weight.new_empty((0,), dtype=cd)
    db = (weight.new_empty((weight.shape[0],), dtype=cd) if (grad_bias and bias is not None)
          else weight.new_empty((0,), dtype=cd))
    return dx, dw, db


def _fake_forward(x, weight, bias, target, ignore_index, label_smoothing, chunk_size, gi, gw, gb):
    loss = x.new_empty((x.shape[0],), dtype=R.compute_dtype(x.dtype))
    return (loss, *_grads_like(x, weight, bias, gi, gw, gb))


def _fake_backward(grad_loss, x, weight, bias, target, ignore_index, label_smoothing, chunk_size, gi, gw, gb):
    return _grads_like(x, weight, bias, gi, gw, gb)


def _addmm_acc_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``acc (=|+=) a @ b`` with ``acc`` possibly wider (float32) than ``a``/``b`` (16-bit)."""
    if acc.dtype == a.dtype:
        if first:
            torch.mm(a, b, out=acc)
        else:
            acc.addmm_(a, b)
        return
    if acc.is_cuda:
        try:  # cuBLAS accumulates 16-bit products straight into a float32 output
            if first:
                torch.mm(a, b, out_dtype=acc.dtype, out=acc)
            else:
                torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            return
        except (RuntimeError, TypeError):
            pass
    # CPU (whose 16-bit GEMMs are emulated anyway): widen the chunk operands, which are small
    if first:
        torch.mm(a.to(acc.dtype), b.to(acc.dtype), out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def chunked(x, weight, bias, target, ignore_index, label_smoothing, chunk_size,
            grad_input, grad_weight, grad_bias, grad_loss=None):
    """The chunk loop shared by both ops (``grad_loss`` given: the recompute backward)."""
    N = x.shape[0]
    V = weight.shape[0]
    cd = R.compute_dtype(x.dtype)
    grad_bias = grad_bias and bias is not None
    compute_grad = grad_input or grad_weight or grad_bias
    loss = x.new_empty((N,), dtype=cd)
    dx, dw, db = _grads_like(x, weight, bias, grad_input, grad_weight, grad_bias)
    if grad_bias:
        db.zero_()
    if grad_weight and N == 0:
        dw.zero_()
    chunk = max(1, min(chunk_size, N))
    block = x.new_empty((chunk, V))
    wt = weight.t()
    for start in range(0, N, chunk):
        stop = min(N, start + chunk)
        xc = x[start:stop]
        z = block[: stop - start]
        if bias is not None:
            torch.addmm(bias, xc, wt, out=z)
        else:
            torch.mm(xc, wt, out=z)
        scale = None if grad_loss is None else grad_loss[start:stop]
        loss[start:stop] = cross_entropy_rows_(z, target[start:stop], scale, ignore_index,
                                               label_smoothing, compute_grad)
        if grad_input:
            torch.mm(z, weight, out=dx[start:stop])
        if grad_weight:
            _addmm_acc_(dw, z.t(), xc, first=start == 0)
        if grad_bias:
            db.add_(z.sum(0, dtype=cd))
    return loss, dx, dw, db


def forward_impl(x, weight, bias, target, ignore_index, label_smoothing, chunk_size, gi, gw, gb):
    return chunked(x, weight, bias, target, ignore_index, label_smoothing, chunk_size, gi, gw, gb)


def backward_impl(grad_loss, x, weight, bias, target, ignore_index, label_smoothing, chunk_size, gi, gw, gb):
    _, dx, dw, db = chunked(x, weight, bias, target, ignore_index, label_smoothing, chunk_size,
                            gi, gw, gb, grad_loss=grad_loss)
    return dx, dw, db


linear_cross_entropy_forward = R.NNOp(
    "linear_cross_entropy_forward",
    f"({_ARGS}) -> (Tensor, Tensor, Tensor, Tensor)",
    check=_check,
    fake=_fake_forward,
    reference=forward_impl,
    triton=None,
)

linear_cross_entropy_backward = R.NNOp(
    "linear_cross_entropy_backward",
    f"(Tensor grad_loss, {_ARGS}) -> (Tensor, Tensor, Tensor)",
    check=_check_backward,
    fake=_fake_backward,
    reference=backward_impl,
    triton=None,
)
