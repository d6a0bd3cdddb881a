"""The output layer and its loss, fused: cross-entropy of a linear layer's output without ever
holding the ``[tokens, classes]`` logits (:class:`LinearCrossEntropy`,
:func:`linear_cross_entropy`, also :func:`memkern.nn.functional.linear_cross_entropy`).

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

The algorithm is one op with C++ autograd, ``memkern::linear_cross_entropy_layer``
(:mod:`memkern.ops.linear_cross_entropy_layer`, csrc/autograd/linear_cross_entropy.cpp), for
eager calls and ``torch.compile`` alike: its node runs the two loop ops, which a compiled graph
holds as two opaque ops. In eager mode the call goes through the op's typed entry point
(:data:`memkern.ops.linear_cross_entropy_layer.linear_cross_entropy_layer_entry`). Without the
compiled extension this is torch's ``F.cross_entropy(F.linear(...))``
(:mod:`memkern.nn.functional`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from memkern.ops.linear_cross_entropy import block_sizes
from memkern.ops.linear_cross_entropy_layer import (
    linear_cross_entropy_layer,
    linear_cross_entropy_layer_entry,
)

REDUCTIONS = ("mean", "sum", "none")


def splits(reduction: str, dtype: torch.dtype) -> bool:
    """Whether the weight gradient is computed in the backward (by blocks of classes) rather
    than accumulated across chunks of tokens in the forward: for 16-bit inputs and for
    ``reduction="none"`` (whose per-token incoming gradient the forward cannot know)."""
    return reduction == "none" or dtype in (torch.float16, torch.bfloat16)


def check_call(input, weight, target, bias, reduction, label_smoothing, num_items, softcap,
               chunk_size, vocab_block,
               where="memkern.nn.functional.linear_cross_entropy") -> float:
    """Raises the error of an invalid call of ``where``; returns ``softcap`` as a number
    (0: none)."""
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
    return softcap


def flat_operands(input, weight, bias, target, chunk_size, vocab_block, split):
    """The layer ops' operands: ``input`` as contiguous ``[N, H]`` rows, ``weight``, ``bias``
    contiguous, ``target`` as contiguous ``[N]``, and the token chunk and vocabulary block
    (:func:`~memkern.ops.linear_cross_entropy.block_sizes` where not given; ``split``: the
    two-GEMM backward, :func:`splits`)."""
    x = input.reshape(-1, input.shape[-1]).contiguous()
    t = target.reshape(-1).contiguous()
    w, b = weight.contiguous(), None if bias is None else bias.contiguous()
    # computed here, not left to the op (0: its default): under torch.compile the sizes may be
    # symbolic, which the op's C++ cannot read
    if chunk_size is None or vocab_block is None:
        default_chunk, default_block = block_sizes(
            x.shape[0], w.shape[0], x.shape[1], x.element_size(),
            w.requires_grad and torch.is_grad_enabled(), split)
        chunk_size = chunk_size or default_chunk
        vocab_block = vocab_block or default_block
    return x, w, b, t, chunk_size, vocab_block


def _torch_loss(input, weight, target, bias, ignore_index, reduction, label_smoothing, num_items,
                softcap):
    """The same loss as torch's layers compute it (the logits held whole): no extension."""
    logits = F.linear(input, weight, bias)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(logits.reshape(-1, weight.shape[0]), target.reshape(-1),
                           ignore_index=ignore_index, label_smoothing=label_smoothing,
                           reduction="sum" if num_items is not None else reduction)
    if num_items is not None:
        loss = loss / num_items
    return loss.view(target.shape) if reduction == "none" else loss


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
    if (linear_cross_entropy_layer_entry is not None and not torch.compiler.is_compiling()
            and input.dim() and (num_items is None or isinstance(num_items, torch.Tensor))):
        loss = linear_cross_entropy_layer_entry(input, weight, target, bias, ignore_index,
                                                reduction, label_smoothing, num_items,
                                                0.0 if softcap is None else softcap,
                                                -1 if chunk_size is None else chunk_size,
                                                -1 if vocab_block is None else vocab_block)
        if loss is not None:
            return loss
    softcap = check_call(input, weight, target, bias, reduction, label_smoothing, num_items,
                         softcap, chunk_size, vocab_block)
    if linear_cross_entropy_layer_entry is None:
        return _torch_loss(input, weight, target, bias, ignore_index, reduction, label_smoothing,
                           num_items, softcap)
    x, w, b, t, chunk_size, vocab_block = flat_operands(
        input, weight, bias, target, chunk_size, vocab_block,
        splits(reduction, input.dtype))
    tensor_items = num_items if isinstance(num_items, torch.Tensor) else None
    divisor = None if num_items is None or tensor_items is not None else float(num_items)
    loss = linear_cross_entropy_layer(x, w, b, t, tensor_items, divisor, reduction,
                                      int(ignore_index), float(label_smoothing), int(chunk_size),
                                      int(vocab_block), softcap)
    return loss.view(target.shape) if reduction == "none" else loss


class LinearCrossEntropy(nn.Module):
    """``F.cross_entropy(nn.Linear(in_features, num_classes, bias)(hidden), target)`` computed
    in chunks of tokens (:func:`linear_cross_entropy`).

    Parameters ``weight`` ``[num_classes, in_features]`` (and ``bias``), as ``nn.Linear``'s, so
    a language-model head's weights load (and can be tied to the embedding) unchanged.
    ``forward(hidden, target, num_items=None) -> loss``.
    """

    def __init__(self, in_features: int, num_classes: int, bias: bool = False,
                 ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 device=None, dtype=None) -> None:
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"memkern.nn.LinearCrossEntropy: reduction={reduction!r} is not one "
                             f"of {REDUCTIONS}")
        self.in_features = in_features
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.weight = nn.Parameter(torch.empty(num_classes, in_features, device=device,
                                               dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.empty(num_classes, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:  # as nn.Linear
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, hidden: torch.Tensor, target: torch.Tensor,
                num_items: int | torch.Tensor | None = None) -> torch.Tensor:
        return linear_cross_entropy(hidden, self.weight, target, self.bias, self.ignore_index,
                                    self.reduction, self.label_smoothing, num_items)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, num_classes={self.num_classes}, "
                f"bias={self.bias is not None}, reduction={self.reduction!r}")
