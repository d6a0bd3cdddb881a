"""``memkern::linear_log_prob_layer``: :func:`memkern.nn.linear_log_probs` as one op whose
autograd is C++ (csrc/autograd/linear_cross_entropy.cpp, the node of
:mod:`memkern.ops.linear_cross_entropy_layer` with reduction "none"): the per-token
log-probability of the target under ``softmax(x @ weight.T + bias)`` and the per-token
statistics a trainer asks beside it, from the loop ops of :mod:`memkern.ops.linear_cross_entropy`
(one block of logits at a time).

Arguments: ``x`` ``[N, H]`` and ``weight`` ``[V, H]`` contiguous, one dtype; ``bias``
optional ``[V]``; ``target`` int64 ``[N]``; ``outputs`` a mask of
:data:`memkern.ops.cross_entropy.ROW_ENTROPY`, ``ROW_IS_TOP1``, ``ROW_MEAN_LOGIT``;
``ignore_index``, ``chunk_size``, ``vocab_block`` (0: the defaults of
:func:`memkern.ops.linear_cross_entropy.block_sizes`), ``softcap`` as in
:func:`memkern.nn.functional.linear_cross_entropy`.

Returns ``(log_prob, entropy, is_top1, mean_logit)``, each ``[N]`` (0 at ignored tokens), or an
empty ``[0]`` tensor where ``outputs`` does not ask for it: ``log_prob`` and ``entropy`` in
float32 (float64 for float64 inputs) and differentiable, ``is_top1`` bool, ``mean_logit``
without gradient.

Saved for backward: the forward's input gradient of the log-probabilities (``[N, H]``), and,
when the weight or bias needs a gradient or the entropy is asked, ``x``, the weight, bias,
target, the per-token log-sum-exp and entropy (the inputs themselves, not copies). With a
gradient on the entropy, the backward recomputes every gradient by blocks of classes, each
block's logits gradient weighted for both outputs (the forward's input gradient is dropped).
"""
from __future__ import annotations

import torch

from memkern.ops._registry import LIBRARY
from memkern.ops.cross_entropy import ROW_ENTROPY, ROW_IS_TOP1, ROW_MEAN_LOGIT

LIBRARY.define(
    "linear_log_prob_layer(Tensor x, Tensor weight, Tensor? bias, Tensor target, int outputs, "
    "int ignore_index, int chunk_size, int vocab_block, float softcap) "
    "-> (Tensor, Tensor, Tensor, Tensor)"
)


@torch.library.register_fake("memkern::linear_log_prob_layer", lib=LIBRARY)
def _fake(x, weight, bias, target, outputs, ignore_index, chunk_size, vocab_block, softcap):
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    n = x.shape[0]

    def per_token(bit, dtype=cd):
        return x.new_empty((n if outputs & bit else 0,), dtype=dtype)

    return (x.new_empty((n,), dtype=cd), per_token(ROW_ENTROPY),
            per_token(ROW_IS_TOP1, torch.bool), per_token(ROW_MEAN_LOGIT))


linear_log_prob_layer = torch.ops.memkern.linear_log_prob_layer.default
