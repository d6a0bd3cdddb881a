"""``memkern::linear_cross_entropy_forward`` / ``memkern::linear_cross_entropy_backward``: the
cross-entropy of ``x @ weight.T + bias`` computed one block of logits at a time, so that no
``[tokens, classes]`` tensor ever exists.

Forward, in chunks of tokens: ``z = x_c @ W.T (+ b)`` (one GEMM into a reused ``[chunk, V]``
block), the fused row op :func:`memkern.ops.cross_entropy.cross_entropy_rows_` (loss and
log-sum-exp of each row, then the gradient written over ``z``), then ``dx_c = z @ W`` — each
row's input gradient complete in one GEMM — and, for ``grad_weight``/``grad_bias``,
``dW += z.T @ x_c`` / ``db += z.sum(0)`` accumulated across chunks.

Backward, in blocks of classes: ``z = x @ W[c0:c1].T (+ b)`` (one GEMM of all tokens into a
reused ``[N, width]`` block), :func:`memkern.ops.cross_entropy.cross_entropy_block_grad_` (the
gradient from the forward's log-sum-exp, scaled per row), then ``dW[c0:c1] = z.T @ x`` and
``db[c0:c1] = z.sum(0)`` — each class's weight gradient complete in one GEMM, written once in
the weight's dtype, with no accumulator.

Arguments
    x               contiguous ``[N, H]`` float32/bfloat16/float16/float64.
    weight          contiguous ``[V, H]``, same dtype as ``x``; ``bias`` optional ``[V]``.
    target          int64 ``[N]``.
    ignore_index, label_smoothing   as in ``F.cross_entropy``.
    softcap         logit soft-capping (Gemma 2's ``final_logit_softcapping``): when > 0 the
                    loss is that of ``softcap * tanh(z / softcap)``, applied by the row ops on
                    the fly; 0 (default) is none.
    chunk_size      tokens per forward chunk (>= 1); ``vocab_block``: classes per backward
                    block (>= 1). :func:`block_sizes` gives the defaults.

``linear_cross_entropy_forward(x, weight, bias, target, ignore_index, label_smoothing,
chunk_size, grad_input, grad_weight, grad_bias, softcap=0.0, outputs=0) -> (loss, lse, dx,
dweight, dbias, stats)``: float32 (float64) ``[N]`` per-token loss and log-sum-exp (both 0 at
ignored tokens); the gradients of ``loss.sum()``: ``dx`` in ``x``'s dtype, ``dweight``/``dbias``
accumulated in the weight's dtype, which must then be float32/float64 (16-bit weights take their
gradient from the backward op); each empty (``[0]``) when not requested. ``outputs`` (a mask of
:data:`memkern.ops.cross_entropy.ROW_ENTROPY`, ``ROW_IS_TOP1``, ``ROW_MEAN_LOGIT``): the
per-token statistics of the rows op, in ``stats``, float32 (float64) ``[3, N]`` (zeros where
not asked), or ``[0]`` for none.

``linear_cross_entropy_backward(grad_loss, x, weight, bias, target, lse, ignore_index,
label_smoothing, vocab_block, grad_weight, grad_bias, softcap=0.0, entropy=None,
grad_entropy=None, grad_input=False) -> (dweight, dbias, dx)``: the weight and bias gradients
of ``(grad_loss * loss).sum()``, in the weight's / bias's dtype; ``lse`` is the forward's.
``grad_loss`` is float32 (float64): ``[N]``, one factor per token (any stride), or ``[]``, one
factor for every token (``mean``/``sum``). It is folded into each block's logits gradient —
except a single factor with float16 inputs, which is applied to each block's weight and bias
gradients in float32 before their one rounding to float16: a float16 logits gradient times a
small factor (``1 / tokens``) would underflow (bfloat16 has float32's range). With ``entropy``
(the forward's per-token entropy, ``[N]``) and ``grad_entropy`` (``[N]`` or ``[]``), the
gradients of ``(grad_loss * loss + grad_entropy * entropy).sum()``: each block's logits
gradient gets the entropy's term too. ``grad_input``: also ``dx``, in ``x``'s dtype,
accumulated across the blocks of classes (in float32 for 16-bit inputs; one more GEMM per
block); else ``[0]``.

Both run as one C++ implementation on every device when the extension is built
(csrc/autograd/linear_cross_entropy.cpp, the twin of the loops below; the GEMMs are torch's, the
row ops pick their kernel by device), so under ``torch.compile`` each is one opaque node.
"""
from __future__ import annotations

import os

import torch

from memkern import backend
from memkern._extension import check_same_in_cpp
from memkern.ops import _checks
from memkern.ops._registry import Op
from memkern.ops.cross_entropy import (
    ROW_ENTROPY,
    ROW_IS_TOP1,
    ROW_MEAN_LOGIT,
    cross_entropy_block_grad_,
    cross_entropy_rows_,
)

MIN_BLOCK_BYTES = 8 << 20
"""The smallest logits block :func:`block_sizes` picks (small inputs still get few chunks)."""
ROW_ALIGN = 64
"""Forward chunks hold a multiple of this many tokens (when they hold that many at all)."""
CLASS_ALIGN = 128
"""Backward blocks hold a multiple of this many classes (when they hold that many at all)."""
CHUNK_ENV = "MEMKERN_LCE_CHUNK"
"""Environment variable: tokens per forward chunk, replacing :func:`block_sizes`' choice."""
VOCAB_BLOCK_ENV = "MEMKERN_LCE_VOCAB_BLOCK"
"""Environment variable: classes per backward block, replacing :func:`block_sizes`' choice."""

# The C++ twin of block_sizes (csrc/autograd/linear_cross_entropy.h) must use these constants.
check_same_in_cpp(__name__, {"LCE_MIN_BLOCK_BYTES": MIN_BLOCK_BYTES, "LCE_ROW_ALIGN": ROW_ALIGN,
                             "LCE_CLASS_ALIGN": CLASS_ALIGN, "LCE_CHUNK_ENV": CHUNK_ENV,
                             "LCE_VOCAB_BLOCK_ENV": VOCAB_BLOCK_ENV})


def _aligned(count: int, align: int, most: int) -> int:
    """``count`` rounded down to a multiple of ``align`` (when at least ``align``), in [1, most]."""
    if count >= align:
        count -= count % align
    return max(1, min(count, most))


def _env_size(name: str) -> int | None:
    value = os.environ.get(name, "")
    if not value:
        return None
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise ValueError(f"{name}={value!r}: set it to a positive number of "
                         + ("tokens" if name == CHUNK_ENV else "classes") + ", or unset it")
    return size


def block_sizes(n_tokens: int, n_classes: int, hidden: int, element_size: int,
                weight_grad: bool, split: bool) -> tuple[int, int]:
    """``(chunk_size, vocab_block)``: tokens per forward chunk, classes per backward block.

    The backward's ``[N, vocab_block]`` block holds about as many bytes as ``x`` (at least
    :data:`MIN_BLOCK_BYTES`). The forward's ``[chunk_size, V]`` block may hold as many bytes as
    what the call holds anyway at its peak besides ``dx``: with ``split`` (the weight gradient
    computed in the backward) that block plus the weight gradient; otherwise (accumulated in the
    forward) the larger of the two. ``weight_grad``: whether the weight needs a gradient.
    :data:`CHUNK_ENV` / :data:`VOCAB_BLOCK_ENV` replace either choice.
    """
    row_bytes = max(n_classes, 1) * element_size
    base = max(MIN_BLOCK_BYTES, n_tokens * hidden * element_size)
    weight_bytes = n_classes * hidden * element_size if weight_grad else 0
    forward = base + weight_bytes if split else max(base, weight_bytes)
    chunk = _env_size(CHUNK_ENV) or _aligned(forward // row_bytes, ROW_ALIGN, max(n_tokens, 1))
    vocab = (_env_size(VOCAB_BLOCK_ENV)
             or _aligned(base // (max(n_tokens, 1) * element_size), CLASS_ALIGN, max(n_classes, 1)))
    return chunk, vocab


def _check(x, weight, bias, target, ignore_index, label_smoothing, size, *, op, softcap):
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
            raise ValueError(f"memkern.ops.{op}: bias has shape {tuple(bias.shape)}; expected "
                             f"({weight.shape[0]},)")
    if (not isinstance(target, torch.Tensor) or target.dtype != torch.int64
            or tuple(target.shape) != (x.shape[0],)):
        raise ValueError(
            f"memkern.ops.{op}: target must be int64 of shape ({x.shape[0]},), got "
            + (f"{target.dtype} of shape {tuple(target.shape)}"
               if isinstance(target, torch.Tensor) else repr(target))
        )
    _checks.same_device(op, "target", target, x, "x")
    name = "chunk_size" if op == "linear_cross_entropy_forward" else "vocab_block"
    if size < 1:
        raise ValueError(f"memkern.ops.{op}: {name}={size} must be >= 1")
    if not (0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"memkern.ops.{op}: label_smoothing={label_smoothing} must be in [0, 1]")
    if not (softcap >= 0.0 and softcap < float("inf")):
        raise ValueError(f"memkern.ops.{op}: softcap={softcap} must be a finite number >= 0 "
                         "(0: no soft-capping)")
    return x.device


def _check_forward(x, weight, bias, target, ignore_index, label_smoothing, chunk_size,
                   grad_input, grad_weight, grad_bias, softcap=0.0, outputs=0):
    op = "linear_cross_entropy_forward"
    device = _check(x, weight, bias, target, ignore_index, label_smoothing, chunk_size, op=op,
                    softcap=softcap)
    if not isinstance(outputs, int) or outputs & ~(ROW_ENTROPY | ROW_IS_TOP1 | ROW_MEAN_LOGIT):
        raise ValueError(f"memkern.ops.{op}: outputs={outputs!r} must be a mask of ROW_ENTROPY, "
                         "ROW_IS_TOP1 and ROW_MEAN_LOGIT (memkern.ops.cross_entropy)")
    if (grad_weight or grad_bias) and x.dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"memkern.ops.{op}: grad_weight/grad_bias accumulate across chunks in the weight's "
            f"dtype, which must be float32 or float64, not {x.dtype}; compute 16-bit weight "
            "gradients with linear_cross_entropy_backward"
        )
    return device


def _check_backward(grad_loss, x, weight, bias, target, lse, ignore_index, label_smoothing,
                    vocab_block, grad_weight, grad_bias, softcap=0.0, entropy=None,
                    grad_entropy=None, grad_input=False):
    op = "linear_cross_entropy_backward"
    device = _check(x, weight, bias, target, ignore_index, label_smoothing, vocab_block, op=op,
                    softcap=softcap)
    cd = _checks.compute_dtype(x.dtype)
    if (entropy is None) != (grad_entropy is None):
        raise ValueError(f"memkern.ops.{op}: entropy and grad_entropy go together (the "
                         "entropy's gradient needs both); got only "
                         + ("entropy" if entropy is not None else "grad_entropy"))
    tensors = [("grad_loss", grad_loss, ((x.shape[0],), ())), ("lse", lse, ((x.shape[0],),))]
    if entropy is not None:
        tensors += [("entropy", entropy, ((x.shape[0],),)),
                    ("grad_entropy", grad_entropy, ((x.shape[0],), ()))]
    for name, t, shapes in tensors:
        if not isinstance(t, torch.Tensor) or t.dtype != cd or tuple(t.shape) not in shapes:
            got = (f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                   else repr(t))
            raise ValueError(f"memkern.ops.{op}: {name} must be a {cd} tensor of shape "
                             f"{' or '.join(str(s) for s in shapes)}, got {got}")
        _checks.same_device(op, name, t, x, "x")
    return device


def _forward_outputs(x, weight, bias, grad_input, grad_weight, grad_bias, outputs):
    cd = _checks.compute_dtype(x.dtype)
    N = x.shape[0]
    dx = torch.empty_like(x) if grad_input else x.new_empty((0,))
    dw = torch.empty_like(weight) if grad_weight else weight.new_empty((0,))
    db = (weight.new_empty((weight.shape[0],)) if (grad_bias and bias is not None)
          else weight.new_empty((0,)))
    stats = x.new_zeros((3, N), dtype=cd) if outputs else x.new_empty((0,), dtype=cd)
    return x.new_empty((N,), dtype=cd), x.new_empty((N,), dtype=cd), dx, dw, db, stats


def _backward_outputs(x, weight, bias, grad_weight, grad_bias, grad_input):
    dw = torch.empty_like(weight) if grad_weight else weight.new_empty((0,))
    db = torch.empty_like(bias) if (grad_bias and bias is not None) else weight.new_empty((0,))
    dx = torch.empty_like(x) if grad_input else x.new_empty((0,))
    return dw, db, dx


def _fake_forward(x, weight, bias, target, ignore_index, label_smoothing, chunk_size, gi, gw, gb,
                  softcap=0.0, outputs=0):
    return _forward_outputs(x, weight, bias, gi, gw, gb, outputs)


def _fake_backward(grad_loss, x, weight, bias, target, lse, ignore_index, label_smoothing,
                   vocab_block, gw, gb, softcap=0.0, entropy=None, grad_entropy=None,
                   grad_input=False):
    return _backward_outputs(x, weight, bias, gw, gb, grad_input)


def forward_impl(x, weight, bias, target, ignore_index, label_smoothing, chunk_size,
                 grad_input, grad_weight, grad_bias, softcap=0.0, outputs=0):
    """The forward chunk loop (csrc/autograd/linear_cross_entropy.cpp: ``forward_chunks``)."""
    N, V = x.shape[0], weight.shape[0]
    cd = _checks.compute_dtype(x.dtype)
    grad_bias = grad_bias and bias is not None
    compute_grad = grad_input or grad_weight or grad_bias
    loss, lse, dx, dw, db, stats = _forward_outputs(x, weight, bias, grad_input, grad_weight,
                                                    grad_bias, outputs)
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
        rows_loss, rows_lse = cross_entropy_rows_(z, target[start:stop], None, ignore_index,
                                                  label_smoothing, compute_grad, softcap,
                                                  outputs, stats[:, start:stop] if outputs
                                                  else None)
        if stop - start == N:  # one chunk for all tokens: no copy
            loss, lse = rows_loss, rows_lse
        else:
            loss[start:stop] = rows_loss
            lse[start:stop] = rows_lse
        if grad_input:
            torch.mm(z, weight, out=dx[start:stop])
        if grad_weight:
            if start == 0:
                torch.mm(z.t(), xc, out=dw)
            else:
                dw.addmm_(z.t(), xc)
        if grad_bias:
            db.add_(z.sum(0, dtype=cd))
    return loss, lse, dx, dw, db, stats


def _float_gemm(a, b):
    """``a @ b`` in float32 from float16 ``a``, ``b``: cuBLAS's 16-bit-in, float32-out GEMM
    on a GPU; the operands widened on the CPU, which has none."""
    if backend.device_type(a.device) == "cuda":
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def backward_impl(grad_loss, x, weight, bias, target, lse, ignore_index, label_smoothing,
                  vocab_block, grad_weight, grad_bias, softcap=0.0, entropy=None,
                  grad_entropy=None, grad_input=False):
    """The backward block loop (csrc/autograd/linear_cross_entropy.cpp: ``backward_blocks``)."""
    N, V = x.shape[0], weight.shape[0]
    grad_bias = grad_bias and bias is not None
    dw, db, dx = _backward_outputs(x, weight, bias, grad_weight, grad_bias, grad_input)
    if not (grad_weight or grad_bias or grad_input):
        return dw, db, dx
    # float16 and one factor (no entropy's term): applied to each block's float32 dW, db (and
    # to dx's float32 sum); else folded into dZ
    scale_after = grad_loss.dim() == 0 and x.dtype == torch.float16 and entropy is None
    row_scale = torch.ones_like(grad_loss) if scale_after else grad_loss
    row_scale = row_scale.expand(N)
    entropy_scale = None if entropy is None else grad_entropy.expand(N)
    # dx sums a GEMM per block: in float32 for 16-bit inputs, rounded once at the end
    dx_sum = (None if not grad_input else dx if x.dtype in (torch.float32, torch.float64)
              else x.new_empty(x.shape, dtype=torch.float32))
    if grad_input and V == 0:
        dx.zero_()
    width = max(1, min(vocab_block, V))
    block = x.new_empty((N * width,))  # flat: a narrower last block is contiguous too
    for c0 in range(0, V, width):
        c1 = min(V, c0 + width)
        z = block[: N * (c1 - c0)].view(N, c1 - c0)
        wt = weight[c0:c1].t()
        if bias is not None:
            torch.addmm(bias[c0:c1], x, wt, out=z)
        else:
            torch.mm(x, wt, out=z)
        cross_entropy_block_grad_(z, lse, target, row_scale, c0, V, ignore_index,
                                  label_smoothing, softcap, entropy, entropy_scale)
        if grad_input:
            if dx_sum is dx:
                if c0 == 0:
                    torch.mm(z, weight[c0:c1], out=dx)
                else:
                    dx.addmm_(z, weight[c0:c1])
            elif c0 == 0:
                dx_sum.copy_(_float_gemm(z, weight[c0:c1]))
            else:
                dx_sum.add_(_float_gemm(z, weight[c0:c1]))
        if grad_weight:
            if scale_after:
                torch.mul(_float_gemm(z.t(), x), grad_loss, out=dw[c0:c1])
            else:
                torch.mm(z.t(), x, out=dw[c0:c1])
        if grad_bias:
            if scale_after:
                torch.mul(z.sum(0, dtype=grad_loss.dtype), grad_loss, out=db[c0:c1])
            else:
                torch.sum(z, 0, out=db[c0:c1])
    if dx_sum is not None and dx_sum is not dx:
        if scale_after:
            dx_sum.mul_(grad_loss)
        dx.copy_(dx_sum)
    return dw, db, dx


linear_cross_entropy_forward = Op(
    "linear_cross_entropy_forward",
    "(Tensor x, Tensor weight, Tensor? bias, Tensor target, int ignore_index, "
    "float label_smoothing, int chunk_size, bool grad_input, bool grad_weight, bool grad_bias, "
    "float softcap=0.0, int outputs=0) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    check=_check_forward,
    fake=_fake_forward,
    reference=forward_impl,
    triton=None,
    compiled_kernels="composite",
)

linear_cross_entropy_backward = Op(
    "linear_cross_entropy_backward",
    "(Tensor grad_loss, Tensor x, Tensor weight, Tensor? bias, Tensor target, Tensor lse, "
    "int ignore_index, float label_smoothing, int vocab_block, bool grad_weight, "
    "bool grad_bias, float softcap=0.0, Tensor? entropy=None, Tensor? grad_entropy=None, "
    "bool grad_input=False) -> (Tensor, Tensor, Tensor)",
    check=_check_backward,
    fake=_fake_backward,
    reference=backward_impl,
    triton=None,
    compiled_kernels="composite",
)
