"""Cross-entropy of a linear layer's output without ever holding the ``[tokens, classes]`` logits.

The tokens are processed in chunks (:mod:`memkern.ops.linear_cross_entropy`): only one
``[chunk, classes]`` block of logits exists at a time, in forward and in backward.

What is saved for backward:

* ``reduction="mean"``/``"sum"``: the loss is a scalar, so its gradient is known up to one
  factor (the incoming gradient, divided by the token count or ``num_items``). The forward
  computes the gradients of the summed loss while each logits block is at hand — three GEMMs
  in all, no recomputation — and keeps ``dx`` ([tokens, hidden]) and the float32 ``dweight``
  (``dbias``), the size of the inputs, never of the logits. The backward scales them in place.
  (So ``backward`` can run only once through this graph: ``retain_graph=True`` twice raises.)
* ``reduction="none"``: ``x``, ``weight``, ``bias``, ``target``; the backward recomputes the
  logits chunk by chunk with the per-token incoming gradient folded in.

No host synchronisation: the number of non-ignored tokens and ``num_items`` stay on the device.

Host time per call: with the extension built, on the default backend, the call runs as the
``memkern::linear_cross_entropy`` op (:mod:`memkern.ops.linear_cross_entropy_layer`: this
algorithm, chunk loop and autograd, in C++), except 16-bit inputs on a GPU; the Python Function
below serves the rest (a forced backend, ``torch.compile``, saved-tensor recording, no
extension).
"""
from __future__ import annotations

import torch

from memkern import backend, ops
from memkern._extension import compiled
from memkern.ops.linear_cross_entropy_layer import linear_cross_entropy_entry
from memkern.profile.saved import note_saved, recording

REDUCTIONS = ("mean", "sum", "none")
CHUNK_BYTES_CPU = 64 << 20
"""Upper bound of one logits block on the CPU."""


def default_chunk_size(n_tokens: int, n_classes: int, hidden: int, device: torch.device) -> int:
    """Tokens per chunk. CPU: a logits block no larger than the weight (whose gradient is held
    anyway), between 8 and 64 MiB. GPU: a block as large as the input, ``ceil(N / ceil(V / H))``
    rounded up to a power of two, at least 256 rows."""
    if backend.device_type(device) == "cpu":
        block = min(max(n_classes * hidden * 4, 8 << 20), CHUNK_BYTES_CPU)
        rows = block // (4 * max(n_classes, 1))
    else:
        ratio = -(-n_classes // max(hidden, 1))
        rows = 1 << max(0, (-(-n_tokens // max(ratio, 1)) - 1).bit_length())
        rows = max(rows, 256)
    return int(max(1, min(rows, max(n_tokens, 1))))


def _in_dtype(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out`` cast to ``dtype``, never as an alias of itself: torch 2.11's torch.compile traces
    the incoming gradient of an autograd.Function as zeros when the Function returns a no-op
    ``.to()`` of an intermediate (all-zero gradients; torch 2.13 traces it right)."""
    return out if out.dtype == dtype else out.to(dtype)


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, target, num_items, reduction, ignore_index,
                label_smoothing, chunk_size, softcap):
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        ctx.cfg = (reduction, ignore_index, label_smoothing, chunk_size, softcap, x.dtype,
                   weight.dtype, None if bias is None else bias.dtype)
        if reduction == "none":
            loss, *_ = ops.linear_cross_entropy_forward(
                x, weight, bias, target, ignore_index, label_smoothing, chunk_size,
                False, False, False, softcap)
            ctx.save_for_backward(x, weight, bias, target)
            return _in_dtype(loss, x.dtype)
        loss, dx, dw, db = ops.linear_cross_entropy_forward(
            x, weight, bias, target, ignore_index, label_smoothing, chunk_size,
            need_x, need_w, need_b, softcap)
        total = loss.sum()
        if num_items is not None:
            denom = num_items.to(total.dtype) if isinstance(num_items, torch.Tensor) else float(num_items)
            out = total / denom
            divisor = denom
        elif reduction == "mean":
            count = (target != ignore_index).sum(dtype=total.dtype)
            out = total / count  # NaN when every token is ignored, as F.cross_entropy
            divisor = count.clamp(min=1.0)  # ... whose gradient is then 0
        else:
            out = total
            divisor = None
        # Kept as attributes, not save_for_backward: the backward hands them over to autograd
        # without another reference, so AccumulateGrad can take them without a copy.
        ctx.grads = [dx if need_x else None, dw if need_w else None, db if need_b else None]
        ctx.divisor = divisor
        note_saved(*ctx.grads)
        return _in_dtype(out, x.dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        reduction, ignore_index, label_smoothing, chunk_size, softcap, x_dtype, w_dtype, b_dtype = ctx.cfg
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if reduction == "none":
            x, weight, bias, target = ctx.saved_tensors
            cd = torch.promote_types(x.dtype, torch.float32)
            dx, dw, db = ops.linear_cross_entropy_backward(
                grad_loss.reshape(-1).to(cd).contiguous(), x, weight, bias, target, ignore_index,
                label_smoothing, chunk_size, need_x, need_w, need_b, softcap)
            return (dx if need_x else None, dw.to(w_dtype) if need_w else None,
                    db.to(b_dtype) if need_b else None, None, None, None, None, None, None, None)
        if ctx.grads is None:
            raise RuntimeError(
                "memkern linear_cross_entropy: backward ran twice through the same graph. Its "
                "gradients are computed in forward and handed over on the first backward; "
                "recompute the loss for a second backward (or use reduction='none')."
            )
        dx, dw, db = ctx.grads
        ctx.grads = None
        scale = grad_loss.reshape(()).to(torch.promote_types(grad_loss.dtype, torch.float32))
        if ctx.divisor is not None:
            scale = scale / ctx.divisor
        ctx.divisor = None
        out = []
        for g, dtype in ((dx, x_dtype), (dw, w_dtype), (db, b_dtype)):
            if g is None:
                out.append(None)
                continue
            g = g.mul_(scale)  # a 0-dim tensor: multiplied in float32 even for 16-bit g
            out.append(g if g.dtype == dtype else g.to(dtype))
            del g
        dx = dw = db = None
        return (*out, None, None, None, None, None, None, None)


def _cpp_autograd(x: torch.Tensor) -> bool:
    """Whether the call runs as ``memkern::linear_cross_entropy`` (this algorithm with its chunk
    loop and autograd in C++): extension built, default backend, outside ``torch.compile`` and
    saved-tensor recording (which counts the gradients kept by the Python Function), and not
    16-bit on a GPU (the Python Function accumulates those GEMMs in float32 with cuBLAS)."""
    return (compiled.has_cpu and backend.requested() is None and not recording()
            and (backend.device_type(x.device) == "cpu" or x.dtype in (torch.float32, torch.float64))
            and not torch.compiler.is_compiling())


def linear_cross_entropy(input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0,
                         num_items: int | torch.Tensor | None = None, *,
                         softcap: float | None = None,
                         chunk_size: int | None = None) -> torch.Tensor:
    """``F.cross_entropy(input @ weight.T + bias, target, ...)`` computed in chunks of tokens.

    ``input`` ``[..., H]``, ``weight`` ``[V, H]``, ``target`` ``[...]`` (int64 class indices).
    ``num_items``: divide the summed loss by this count (an int, or a device tensor — no host
    sync) instead of by the number of non-ignored tokens: the front end's token-level
    normalisation across micro-batches. Not allowed with ``reduction="none"``.
    ``softcap``: logit soft-capping — the loss of ``softcap * tanh(logits / softcap)`` (Gemma 2's
    ``final_logit_softcapping``); None or 0: none.
    ``chunk_size``: tokens per chunk (default: :func:`default_chunk_size`).
    """
    if (linear_cross_entropy_entry is not None and input.dim()
            and (num_items is None or isinstance(num_items, torch.Tensor))
            and backend.requested() is None and not recording()
            and backend.planned() in (None, "cpu")  # the entry decides by the real device
            and not torch.compiler.is_compiling()):
        hidden = input.shape[-1]
        if chunk_size is None:
            chunk_size = default_chunk_size(input.numel() // max(hidden, 1), weight.shape[0],
                                            hidden, input.device)
        loss = linear_cross_entropy_entry(input, weight, target, bias, ignore_index, reduction,
                                          label_smoothing, num_items,
                                          0.0 if softcap is None else softcap, chunk_size)
        if loss is not None:
            return loss
    where = "memkern.nn.functional.linear_cross_entropy"
    if reduction not in REDUCTIONS:
        raise ValueError(f"{where}: reduction={reduction!r} is not one of {REDUCTIONS}")
    if num_items is not None and reduction == "none":
        raise ValueError(f"{where}: num_items divides a summed loss; it cannot be used with "
                         "reduction='none'")
    if not (0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"{where}: label_smoothing={label_smoothing} must be in [0, 1]")
    softcap = 0.0 if softcap is None else float(softcap)
    if not (0.0 <= softcap < float("inf")):
        raise ValueError(f"{where}: softcap={softcap} must be a finite number >= 0 (None or 0: "
                         "no soft-capping)")
    if weight.dim() != 2 or input.shape[-1:] != weight.shape[1:]:
        raise ValueError(
            f"{where}: input {tuple(input.shape)} must end with the weight's in_features "
            f"(weight {tuple(weight.shape)} is [num_classes, in_features])"
        )
    if target.shape != input.shape[:-1]:
        raise ValueError(
            f"{where}: target has shape {tuple(target.shape)}; expected {tuple(input.shape[:-1])} "
            "(one class index per row of input)"
        )
    if target.dtype != torch.int64:
        raise TypeError(f"{where}: target must hold int64 class indices, got {target.dtype}")
    if weight.dtype != input.dtype or (bias is not None and bias.dtype != input.dtype):
        raise TypeError(
            f"{where}: input ({input.dtype}), weight ({weight.dtype}) and bias must share one "
            "dtype; cast them (autocast does not apply to this op)"
        )
    if isinstance(num_items, torch.Tensor) and num_items.device != input.device:
        raise ValueError(f"{where}: num_items is on {num_items.device}, input on {input.device}; "
                         "keep it on the input's device")
    x = input.reshape(-1, input.shape[-1]).contiguous()
    t = target.reshape(-1).contiguous()
    if chunk_size is None:
        chunk_size = default_chunk_size(x.shape[0], weight.shape[0], x.shape[1], x.device)
    w, b = weight.contiguous(), None if bias is None else bias.contiguous()
    if _cpp_autograd(x):
        tensor_items = num_items if isinstance(num_items, torch.Tensor) else None
        divisor = None if num_items is None or tensor_items is not None else float(num_items)
        loss = ops.linear_cross_entropy_layer(
            x, w, b, t, tensor_items, divisor, reduction, int(ignore_index),
            float(label_smoothing), int(chunk_size), softcap)
    else:
        loss = LinearCrossEntropyFunction.apply(
            x, w, b, t, num_items, reduction, int(ignore_index), float(label_smoothing),
            int(chunk_size), softcap)
    return loss.view(target.shape) if reduction == "none" else loss
