"""``memkern::linear_cross_entropy_forward`` / ``memkern::linear_cross_entropy_backward``: the
cross-entropy of ``x @ weight.T + bias`` computed in chunks of tokens, so that no
``[tokens, classes]`` tensor ever exists — only one ``[chunk, classes]`` block at a time.

Each chunk: ``z = x_c @ W.T (+ b)`` (one GEMM into a reused block), the fused row op
:mod:`memkern.ops.cross_entropy` (loss rows, then the gradient written over ``z``; on the CPU
in sub-blocks of :data:`ROW_OP_BYTES` that stay in the last-level cache), then
``dx_c = z @ W`` and ``dW += z.T @ x_c`` (``db += z.sum(0)``): three GEMMs in all, as the
unfused computation, and one ``[chunk, V]`` block (plus the row op's scratch) alive at a time.

Arguments (both ops)
    x               contiguous ``[N, H]`` float32/bfloat16/float16 (float64: reference).
    weight          contiguous ``[V, H]``, same dtype as ``x``; ``bias`` optional ``[V]``.
    target          int64 ``[N]``.
    ignore_index, label_smoothing   as in ``F.cross_entropy``.
    chunk_size      tokens per chunk (>= 1).
    grad_input / grad_weight / grad_bias   which gradients to compute.
    softcap         logit soft-capping (Gemma 2's ``final_logit_softcapping``): when > 0 the
                    loss is that of ``softcap * tanh(z / softcap)``; 0 (default) is none. The
                    capped logits are formed in the block in place; the float32 (float64)
                    ``tanh`` of one row-op sub-block is kept as scratch for the chain-rule
                    factor ``1 - tanh^2``.

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

from memkern import backend
from memkern.ops import _checks
from memkern.ops._registry import Op
from memkern.ops.cross_entropy import cross_entropy_rows_

ROW_OP_BYTES = 8 << 20
"""On the CPU, logits bytes per call of the row op (its float32 scratch is as large again),
so that both stay in the last-level cache. On the GPU the row op takes the whole chunk."""

_ARGS = (
    "Tensor x, Tensor weight, Tensor? bias, Tensor target, int ignore_index, float label_smoothing, "
    "int chunk_size, bool grad_input, bool grad_weight, bool grad_bias, float softcap=0.0"
)


def _check(x, weight, bias, target, ignore_index, label_smoothing, chunk_size, grad_input=True,
           grad_weight=True, grad_bias=True, softcap=0.0, *, op="linear_cross_entropy_forward"):
    _checks.tensor(op, "x", x)
    _checks.tensor(op, "weight", weight)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"memkern.ops.{op}: x must be [N, H] and weight [V, H] with the same H, got "
            f"{tuple(x.shape)} and {tuple(weight.shape)}"
        )
    _checks.same_dtype(op, "weight", weight, x, "x")
    _checks.same_device(op, "weight", weight, x, "x")
    if bias is not None:
        _checks.tensor(op, "bias", bias)
        _checks.same_dtype(op, "bias", bias, x, "x")
        _checks.same_device(op, "bias", bias, x, "x")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"memkern.ops.{op}: bias has shape {tuple(bias.shape)}; expected ({weight.shape[0]},)")
    if not isinstance(target, torch.Tensor) or target.dtype != torch.int64 or tuple(target.shape) != (x.shape[0],):
        raise ValueError(
            f"memkern.ops.{op}: target must be int64 of shape ({x.shape[0]},), got "
            + (f"{target.dtype} of shape {tuple(target.shape)}" if isinstance(target, torch.Tensor) else repr(target))
        )
    _checks.same_device(op, "target", target, x, "x")
    if chunk_size < 1:
        raise ValueError(f"memkern.ops.{op}: chunk_size={chunk_size} must be >= 1")
    if not (0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"memkern.ops.{op}: label_smoothing={label_smoothing} must be in [0, 1]")
    if not (softcap >= 0.0 and softcap < float("inf")):
        raise ValueError(f"memkern.ops.{op}: softcap={softcap} must be a finite number >= 0 "
                         "(0: no soft-capping)")
    return x.device


def _check_backward(grad_loss, x, weight, bias, target, *rest):
    op = "linear_cross_entropy_backward"
    device = _check(x, weight, bias, target, *rest, op=op)
    cd = _checks.compute_dtype(x.dtype)
    if not isinstance(grad_loss, torch.Tensor) or grad_loss.dtype != cd or tuple(grad_loss.shape) != (x.shape[0],):
        raise ValueError(
            f"memkern.ops.{op}: grad_loss must be a {cd} tensor of shape ({x.shape[0]},), got "
            + (f"{grad_loss.dtype} of shape {tuple(grad_loss.shape)}" if isinstance(grad_loss, torch.Tensor) else repr(grad_loss))
        )
    _checks.same_device(op, "grad_loss", grad_loss, x, "x")
    return device


def _grads_like(x, weight, bias, grad_input, grad_weight, grad_bias):
    cd = _checks.compute_dtype(x.dtype)
    dx = torch.empty_like(x) if grad_input else x.new_empty((0,))
    dw = weight.new_empty(weight.shape, dtype=cd) if grad_weight else weight.new_empty((0,), dtype=cd)
    db = (weight.new_empty((weight.shape[0],), dtype=cd) if (grad_bias and bias is not None)
          else weight.new_empty((0,), dtype=cd))
    return dx, dw, db


def _fake_forward(x, weight, bias, target, ignore_index, label_smoothing, chunk_size, gi, gw, gb,
                  softcap=0.0):
    loss = x.new_empty((x.shape[0],), dtype=_checks.compute_dtype(x.dtype))
    return (loss, *_grads_like(x, weight, bias, gi, gw, gb))


def _fake_backward(grad_loss, x, weight, bias, target, ignore_index, label_smoothing, chunk_size, gi, gw, gb,
                   softcap=0.0):
    return _grads_like(x, weight, bias, gi, gw, gb)


def _addmm_acc_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``acc (=|+=) a @ b`` with ``acc`` possibly wider (float32) than ``a``/``b`` (16-bit)."""
    if acc.dtype == a.dtype:
        if first:
            torch.mm(a, b, out=acc)
        else:
            acc.addmm_(a, b)
        return
    if backend.device_type(acc.device) == "cuda":
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


def _softcap_(z: torch.Tensor, tanh: torch.Tensor, cap: float) -> torch.Tensor:
    """``z <- cap * tanh(z / cap)`` in place; returns ``tanh(z / cap)`` (in ``tanh``, the
    compute dtype, so 16-bit logits are capped from a float32 tanh)."""
    tanh.copy_(z).div_(cap).tanh_()
    torch.mul(tanh, cap, out=z)
    return tanh


def chunked(x, weight, bias, target, ignore_index, label_smoothing, chunk_size,
            grad_input, grad_weight, grad_bias, softcap=0.0, grad_loss=None):
    """The chunk loop shared by both ops (``grad_loss`` given: the recompute backward)."""
    N = x.shape[0]
    V = weight.shape[0]
    cd = _checks.compute_dtype(x.dtype)
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
    sub = (chunk if backend.device_type(x.device) == "cuda"
           else max(1, min(chunk, ROW_OP_BYTES // (4 * max(V, 1)))))
    wt = weight.t()
    tanh = x.new_empty((sub, V), dtype=cd) if softcap > 0.0 else None
    for start in range(0, N, chunk):
        stop = min(N, start + chunk)
        xc = x[start:stop]
        z = block[: stop - start]
        if bias is not None:
            torch.addmm(bias, xc, wt, out=z)
        else:
            torch.mm(xc, wt, out=z)
        # the row op on sub-blocks that stay in the last-level cache (with its float32 scratch)
        for s0 in range(start, stop, sub):
            s1 = min(stop, s0 + sub)
            zs = z[s0 - start:s1 - start]
            if tanh is not None:
                th = _softcap_(zs, tanh[: s1 - s0], softcap)
            rows = cross_entropy_rows_(
                zs, target[s0:s1], None if grad_loss is None else grad_loss[s0:s1], ignore_index,
                label_smoothing, compute_grad)
            if s1 - s0 == N:  # one block for all tokens (the usual GPU case): no copy
                loss = rows
            else:
                loss[s0:s1] = rows
            if tanh is not None and compute_grad:  # chain rule through the cap: 1 - tanh^2
                zs.mul_(th.square_().neg_().add_(1.0))
        if grad_input:
            torch.mm(z, weight, out=dx[start:stop])
        if grad_weight:
            _addmm_acc_(dw, z.t(), xc, first=start == 0)
        if grad_bias:
            db.add_(z.sum(0, dtype=cd))
    return loss, dx, dw, db


def forward_impl(x, weight, bias, target, ignore_index, label_smoothing, chunk_size, gi, gw, gb,
                 softcap=0.0):
    return chunked(x, weight, bias, target, ignore_index, label_smoothing, chunk_size, gi, gw, gb,
                   softcap)


def backward_impl(grad_loss, x, weight, bias, target, ignore_index, label_smoothing, chunk_size, gi, gw, gb,
                  softcap=0.0):
    _, dx, dw, db = chunked(x, weight, bias, target, ignore_index, label_smoothing, chunk_size,
                            gi, gw, gb, softcap, grad_loss=grad_loss)
    return dx, dw, db


linear_cross_entropy_forward = Op(
    "linear_cross_entropy_forward",
    f"({_ARGS}) -> (Tensor, Tensor, Tensor, Tensor)",
    check=_check,
    fake=_fake_forward,
    reference=forward_impl,
    triton=None,
    compiled_kernels=False,
)

linear_cross_entropy_backward = Op(
    "linear_cross_entropy_backward",
    f"(Tensor grad_loss, {_ARGS}) -> (Tensor, Tensor, Tensor)",
    check=_check_backward,
    fake=_fake_backward,
    reference=backward_impl,
    triton=None,
    compiled_kernels=False,
)
