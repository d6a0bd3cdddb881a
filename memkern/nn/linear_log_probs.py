"""The per-token log-probability head: ``log softmax(x @ weight.T + bias)[target]`` of each
token, and the statistics a trainer reads beside it (the entropy of each token's distribution,
whether the target is its most likely class, the mean logit), without ever holding the
``[tokens, classes]`` logits (:func:`linear_log_probs`, also
:func:`memkern.nn.functional.linear_log_probs`). What trl's trainers consume at every policy
forward (:mod:`memkern.integrations.trl` puts it in their models).

The same loops as :func:`memkern.nn.functional.linear_cross_entropy` with
``reduction="none"`` (:mod:`memkern.nn.linear_cross_entropy`'s split algorithm): the forward
walks chunks of tokens — each chunk's ``[chunk, V]`` logits, their log-sum-exp, the statistics
asked (one pass over each row: the entropy from one more running sum beside the log-sum-exp's,
the mean from the row sum it keeps anyway, is-top-1 from the row maximum and, for a target at
the maximum, the columns before it), their gradient and the input gradient of those tokens;
the backward recomputes the logits by blocks of classes for the weight and bias gradients.

Saved for backward: the input gradient of the log-probabilities (``H`` values per token, in
``x``'s dtype) and the float32 log-sum-exp and entropy (one value each per token), plus ``x``,
the weight, bias and target themselves. Never anything of size ``[tokens, classes]`` or
``[classes, hidden]``.

The entropy's gradient (``d entropy / dz = -p (log p + entropy)``), when the entropy is
differentiated (an entropy bonus), costs one more GEMM per block of classes: the backward then
computes the input gradient too, by blocks of classes (summed in float32 for 16-bit inputs),
each recomputed block weighted for both outputs; the forward's input gradient goes unused. The
mean logit and is-top-1 have no gradient.

The layer op is ``memkern::linear_log_prob_layer`` (:mod:`memkern.ops.linear_log_prob_layer`,
its node in csrc/autograd/linear_cross_entropy.cpp). Without the compiled extension this is
plain torch over the whole logits.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from memkern._extension import compiled
from memkern.nn.linear_cross_entropy import check_call, flat_operands
from memkern.ops.cross_entropy import ROW_ENTROPY, ROW_IS_TOP1, ROW_MEAN_LOGIT
from memkern.ops.linear_log_prob_layer import linear_log_prob_layer

WHERE = "memkern.nn.functional.linear_log_probs"


class LogProbs(NamedTuple):
    """:func:`linear_log_probs`' result: each ``target.shape``, 0 at ignored tokens, None when
    not asked. ``log_probs`` and ``entropy`` float32 (float64 for float64 inputs) with
    gradients; ``is_top1`` bool; ``mean_logits`` float32 (float64), without gradient."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    is_top1: torch.Tensor | None
    mean_logits: torch.Tensor | None


def _torch_log_probs(x, weight, target, bias, ignore_index, softcap, outputs):
    """The same outputs over the whole logits, in plain torch: no extension."""
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    z = F.linear(x, weight, bias).to(cd)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    valid = target != ignore_index
    logp = torch.log_softmax(z, -1)
    log_probs = logp.gather(-1, torch.where(valid, target, 0)[:, None])[:, 0]
    zero = z.new_zeros(())
    entropy = is_top1 = mean = None
    if outputs & ROW_ENTROPY:
        p = logp.exp()
        entropy = torch.where(valid, -torch.where(p == 0, zero, p * logp).sum(-1), zero)
    if outputs & ROW_IS_TOP1:
        is_top1 = valid & (z.argmax(-1) == target)
    if outputs & ROW_MEAN_LOGIT:
        mean = torch.where(valid, z.detach().mean(-1), zero)
    return torch.where(valid, log_probs, zero), entropy, is_top1, mean


def linear_log_probs(input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                     bias: torch.Tensor | None = None, *, entropy: bool = False,
                     is_top1: bool = False, mean_logits: bool = False, ignore_index: int = -100,
                     softcap: float | None = None, chunk_size: int | None = None,
                     vocab_block: int | None = None) -> LogProbs:
    """``log_softmax(input @ weight.T + bias)`` at ``target``, per token, never holding the
    logits; with ``entropy`` / ``is_top1`` / ``mean_logits``, those per-token statistics too.

    ``input`` ``[..., H]``, ``weight`` ``[V, H]`` and ``bias`` ``[V]`` of one dtype, ``target``
    ``[...]`` int64 class indices (``ignore_index``: outputs 0, no gradient). ``entropy``:
    ``-sum p log p`` of ``p = softmax(z)`` (``0 log 0 = 0``); ``is_top1``: whether the target is
    ``z.argmax(-1)`` (the first maximum, as torch's argmax); ``mean_logits``: ``z.mean(-1)``.
    ``softcap``: the logits soft-capped first, ``softcap * tanh(z / softcap)``, as in
    :func:`memkern.nn.functional.linear_cross_entropy`; ``chunk_size`` / ``vocab_block`` too.
    Returns a :class:`LogProbs`. What is saved and recomputed: this module's docstring.
    """
    softcap = check_call(input, weight, target, bias, "none", 0.0, None, softcap, chunk_size,
                         vocab_block, where=WHERE)
    outputs = ((ROW_ENTROPY if entropy else 0) | (ROW_IS_TOP1 if is_top1 else 0)
               | (ROW_MEAN_LOGIT if mean_logits else 0))
    if not compiled.has_cpu:
        results = _torch_log_probs(input.reshape(-1, input.shape[-1]), weight,
                                   target.reshape(-1), bias, ignore_index, softcap, outputs)
    else:
        x, w, b, t, chunk_size, vocab_block = flat_operands(input, weight, bias, target,
                                                            chunk_size, vocab_block, True)
        results = linear_log_prob_layer(x, w, b, t, outputs, int(ignore_index), int(chunk_size),
                                        int(vocab_block), softcap)
        asked = (True, entropy, is_top1, mean_logits)
        results = tuple(r if on else None for r, on in zip(results, asked))
    return LogProbs(*(None if r is None else r.view(target.shape) for r in results))
