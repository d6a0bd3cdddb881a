"""Cross-entropy of a linear layer's output without ever holding the ``[tokens, classes]`` logits.

The logits exist one block at a time (:mod:`memkern.ops.linear_cross_entropy`): the forward
walks chunks of tokens (each chunk's ``[chunk, V]`` logits, their loss, log-sum-exp and
gradient, and the input gradient ``dx`` of those tokens); where the weight gradient is not
accumulated in the forward, the backward walks blocks of classes (each ``[N, width]`` block of
logits recomputed, its gradient from the saved log-sum-exp, and the weight gradient of those
classes in one GEMM). Two ways, chosen by dtype and reduction (:func:`splits`):

* **gradients in the forward** (float32/float64 inputs, ``reduction="mean"``/``"sum"``): the
  loss is a scalar, so its gradients are known up to one factor; the forward computes ``dx``,
  ``dweight`` and ``dbias`` of the summed loss — three GEMMs, no recomputation — accumulating
  ``dweight`` across chunks in the weight's own dtype. Saved: those gradients (the size of the
  inputs, and the weight gradient that backward must produce anyway). The backward scales them
  in place.
* **split** (16-bit inputs, where a weight gradient accumulated across chunks would either round
  every partial sum or need a float32 copy twice its size; and ``reduction="none"``): the
  forward computes the loss and ``dx`` of the summed loss; the backward scales ``dx`` (per token
  for ``"none"``) and recomputes the logits one block of classes at a time for the weight and
  bias gradients — four GEMMs, each gradient written once, no accumulator. Saved per token:
  ``dx`` (``H`` values in ``x``'s dtype) and the float32 log-sum-exp (one value); plus ``x``,
  the weight, bias and target themselves (the inputs, not copies).

Never saved: anything of size ``[tokens, classes]``, nor (split) of size ``[classes, hidden]``.
``backward`` runs once through a graph (the gradients computed in the forward are handed
over in place): ``retain_graph=True`` and a second backward raises.

No host synchronisation: the number of non-ignored tokens and ``num_items`` stay on the device.

Host time per call: with the extension built, on the default backend, the call runs as the
``memkern::linear_cross_entropy_layer`` op (:mod:`memkern.ops.linear_cross_entropy_layer`: this
algorithm, loops and autograd, in C++ — on the GPU too, 16-bit inputs included); the Python
Function below serves the rest (a forced backend, ``torch.compile``, saved-tensor recording, no
extension).
"""
from __future__ import annotations

import torch

from memkern import backend, ops
from memkern._extension import compiled
from memkern.ops.linear_cross_entropy import block_sizes
from memkern.ops.linear_cross_entropy_layer import linear_cross_entropy_layer_entry
from memkern.profile.saved import note_saved, recording

REDUCTIONS = ("mean", "sum", "none")


def splits(reduction: str, dtype: torch.dtype) -> bool:
    """Whether the weight gradient is computed in the backward (by blocks of classes) rather
    than accumulated across chunks of tokens in the forward: for 16-bit inputs and for
    ``reduction="none"`` (whose per-token incoming gradient the forward cannot know)."""
    return reduction == "none" or dtype in (torch.float16, torch.bfloat16)


def _in_dtype(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out`` cast to ``dtype``, never as an alias of itself: torch 2.11's torch.compile traces
    the incoming gradient of an autograd.Function as zeros when the Function returns a no-op
    ``.to()`` of an intermediate (all-zero gradients; torch 2.13 traces it right)."""
    return out if out.dtype == dtype else out.to(dtype)


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, target, num_items, reduction, ignore_index,
                label_smoothing, chunk_size, vocab_block, softcap):
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and bias is not None
        split = splits(reduction, x.dtype)
        in_forward_w, in_forward_b = (False, False) if split else (need_w, need_b)
        ctx.cfg = (reduction, ignore_index, label_smoothing, vocab_block, softcap)
        loss, lse, dx, dw, db = ops.linear_cross_entropy_forward(
            x, weight, bias, target, ignore_index, label_smoothing, chunk_size, need_x,
            in_forward_w, in_forward_b, softcap)
        divisor = None
        if reduction == "none":
            out = loss
        else:
            total = loss.sum()
            if num_items is not None:
                divisor = (num_items.to(total.dtype) if isinstance(num_items, torch.Tensor)
                           else float(num_items))
                out = total / divisor
            elif reduction == "mean":
                count = (target != ignore_index).sum(dtype=total.dtype)
                out = total / count  # NaN when every token is ignored, as F.cross_entropy
                divisor = count.clamp(min=1.0)  # ... whose gradient is then 0
            else:
                out = total
        # Kept as attributes, not save_for_backward: the backward hands them over to autograd
        # without another reference, so AccumulateGrad can take them without a copy.
        ctx.grads = [dx if need_x else None, dw if in_forward_w else None,
                     db if in_forward_b else None]
        ctx.divisor = divisor
        note_saved(*ctx.grads)
        ctx.recompute = split and (need_w or need_b)
        if ctx.recompute:
            ctx.save_for_backward(x, weight, bias, target, lse)
        return _in_dtype(out, x.dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        reduction, ignore_index, label_smoothing, vocab_block, softcap = ctx.cfg
        need_w, need_b = ctx.needs_input_grad[1:3]
        if ctx.grads is None:
            raise RuntimeError(
                "memkern linear_cross_entropy: backward ran twice through the same graph. Its "
                "input gradient (and, for float32 inputs, every gradient) is computed in "
                "forward and handed over on the first backward; recompute the loss for a "
                "second backward."
            )
        dx, dw, db = ctx.grads
        ctx.grads = None
        # the incoming gradient in float32 (float64): per token for "none", else one number
        # (which the backward op applies to dW, db in float32: no float16 underflow)
        scale = grad_loss.to(torch.promote_types(grad_loss.dtype, torch.float32))
        if reduction == "none":
            rows = scale.reshape(-1)
            scale = rows[:, None]
        else:
            scale = scale.reshape(())
            if ctx.divisor is not None:
                scale = scale / ctx.divisor
            rows = scale
        ctx.divisor = None
        # scaled in place: a 0-dim (or [N, 1]) float32 factor, multiplied in float32 even
        # for a 16-bit dx; fused dw, db have the weight's float32/float64 dtype
        if dx is not None:
            dx = dx.mul_(scale)
        if dw is not None:
            dw = dw.mul_(scale)
        if db is not None:
            db = db.mul_(scale)
        if ctx.recompute:
            x, weight, bias, target, lse = ctx.saved_tensors
            need_b = need_b and bias is not None
            dw, db = ops.linear_cross_entropy_backward(
                rows, x, weight, bias, target, lse, ignore_index, label_smoothing, vocab_block,
                need_w, need_b, softcap)
            dw, db = dw if need_w else None, db if need_b else None
        return dx, dw, db, None, None, None, None, None, None, None, None


def _cpp_autograd() -> bool:
    """Whether the call runs as ``memkern::linear_cross_entropy_layer`` (this algorithm with its
    loops and autograd in C++, on any device): extension built, default backend, outside
    ``torch.compile`` and saved-tensor recording (which counts what the Python Function keeps),
    and not while planning for a GPU on fake CPU tensors (the C++ loops follow the tensors'
    device; the Python ones the planned device)."""
    return (compiled.has_cpu and backend.requested() is None and not recording()
            and backend.planned() in (None, "cpu") and not torch.compiler.is_compiling())


def linear_cross_entropy(input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0,
                         num_items: int | torch.Tensor | None = None, *,
                         softcap: float | None = None, chunk_size: int | None = None,
                         vocab_block: int | None = None) -> torch.Tensor:
    """``F.cross_entropy(input @ weight.T + bias, target, ...)``, never holding the logits.

    ``input`` ``[..., H]``, ``weight`` ``[V, H]``, ``target`` ``[...]`` (int64 class indices).
    ``num_items``: divide the summed loss by this count (an int, or a device tensor — no host
    sync) instead of by the number of non-ignored tokens: the front end's token-level
    normalisation across micro-batches. Not allowed with ``reduction="none"``.
    ``softcap``: logit soft-capping — the loss of ``softcap * tanh(logits / softcap)`` (Gemma 2's
    ``final_logit_softcapping``); None or 0: none.
    ``chunk_size``: tokens per forward chunk; ``vocab_block``: classes per backward block
    (defaults: :func:`memkern.ops.linear_cross_entropy.block_sizes`, which the environment
    variables ``MEMKERN_LCE_CHUNK`` / ``MEMKERN_LCE_VOCAB_BLOCK`` override). What is saved for
    backward and what is recomputed: this module's docstring.
    """
    if (_cpp_autograd() and input.dim()
            and (num_items is None or isinstance(num_items, torch.Tensor))):
        loss = linear_cross_entropy_layer_entry(input, weight, target, bias, ignore_index,
                                                reduction, label_smoothing, num_items,
                                                0.0 if softcap is None else softcap,
                                                -1 if chunk_size is None else chunk_size,
                                                -1 if vocab_block is None else vocab_block)
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
    for name, size in (("chunk_size", chunk_size), ("vocab_block", vocab_block)):
        if size is not None and size < 1:
            raise ValueError(f"{where}: {name}={size} must be >= 1 (None: the default)")
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
    w, b = weight.contiguous(), None if bias is None else bias.contiguous()
    if chunk_size is None or vocab_block is None:
        default_chunk, default_block = block_sizes(
            x.shape[0], w.shape[0], x.shape[1], x.element_size(),
            w.requires_grad and torch.is_grad_enabled(), splits(reduction, x.dtype))
        chunk_size = chunk_size or default_chunk
        vocab_block = vocab_block or default_block
    if _cpp_autograd():
        tensor_items = num_items if isinstance(num_items, torch.Tensor) else None
        divisor = None if num_items is None or tensor_items is not None else float(num_items)
        loss = ops.linear_cross_entropy_layer(
            x, w, b, t, tensor_items, divisor, reduction, int(ignore_index),
            float(label_smoothing), int(chunk_size), int(vocab_block), softcap)
    else:
        loss = LinearCrossEntropyFunction.apply(
            x, w, b, t, num_items, reduction, int(ignore_index), float(label_smoothing),
            int(chunk_size), int(vocab_block), softcap)
    return loss.view(target.shape) if reduction == "none" else loss
