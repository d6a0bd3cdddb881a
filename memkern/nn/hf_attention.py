"""transformers' SDPA attention, its ``[batch, heads, tokens, tokens]`` probabilities recomputed
in backward instead of kept.

Where ``torch.nn.functional.scaled_dot_product_attention`` runs its math kernel — on the CPU
whenever attention dropout is on (BERT, RoBERTa, XLM-R train with ``p = 0.1``) — autograd keeps,
per layer, the softmax output, the dropout mask and the dropped probabilities: three float32
``[b, h, t, t]`` tensors, more than everything else the layer keeps at ``t`` above ~4 × the
head size. :func:`sdpa_attention_forward` runs transformers' own SDPA attention under
:func:`memkern.nn.checkpoint.recompute_in_backward` there instead: the call keeps only its
inputs (``query``, ``key``, ``value`` — the projections' outputs, which the attention kernel
keeps anyway — and the attention mask, one tensor shared by the layers), and backward runs
the same forward again before differentiating it. The dropout mask is regenerated, not
stored: the recomputation replays the random-number state of the forward, so it draws the
very same mask (torch's own dropout inside SDPA; the outputs and gradients are those of the
unpatched model with the same seed). Cost: one more attention forward per layer in backward
(two batched GEMMs, softmax, dropout).

Where SDPA runs a fused kernel (no dropout, or on a GPU: flash / memory-efficient / cuDNN
attention keep ``O(t)`` per row and regenerate dropout from a seed), the call is
transformers' SDPA attention unchanged: nothing to gain.

:func:`install` makes a ``transformers`` model use it through transformers' attention interface
(``AttentionInterface.register`` + ``model.set_attn_implementation``; the attention masks are
built as for SDPA), only for a model whose attention implementation is ``"sdpa"``.
"""
from __future__ import annotations

import torch
from torch import nn

from memkern import backend
from memkern.nn.checkpoint import recompute_in_backward

NAME = "memkern_sdpa"
"""The name under which transformers' attention interface knows this attention."""
_SDPA = "sdpa"


def _sdpa_keeps_probabilities(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              mask: torch.Tensor | None, dropout: float, is_causal: bool,
                              scale: float | None) -> bool:
    """Whether SDPA would run its math kernel on these inputs (the one that keeps the
    ``[b, h, t, t]`` probabilities for backward). ``torch._fused_sdp_choice`` is torch's own
    kernel choice; it is private, hence read here only, and an error in it counts as "math"
    whenever dropout is on (the fused CPU kernel has no dropout). A GPU step planned on the
    CPU (:mod:`memkern.profile.plan`) is answered as on the GPU, whose fused kernels apply
    dropout: not the math kernel."""
    if backend.device_type(query.device) == "cuda" and not query.is_cuda:
        return False
    try:
        choice = torch._fused_sdp_choice(query, key, value, mask, dropout, is_causal, scale=scale,
                                         enable_gqa=query.shape[1] != key.shape[1])
    except (RuntimeError, TypeError):
        return dropout > 0
    return choice == int(torch.nn.attention.SDPBackend.MATH)


def sdpa_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, attention_mask: torch.Tensor | None,
                           dropout: float = 0.0, scaling: float | None = None,
                           is_causal: bool | None = None, **kwargs):
    """transformers' ``sdpa_attention_forward`` (same arguments: ``query`` ``[b, h, t, d]``,
    ``key``/``value`` ``[b, h_kv, s, d]``, an additive or boolean ``attention_mask``
    broadcastable to ``[b, h, t, s]``), returning ``(attention output [b, t, h, d], None)``;
    recomputed in backward where SDPA would keep the probabilities (see the module doc)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward as sdpa

    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    causal = causal and attention_mask is None and query.shape[2] > 1
    if (torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            and _sdpa_keeps_probabilities(query, key, value, attention_mask, dropout, causal,
                                          scaling)):
        return recompute_in_backward(sdpa, module, query, key, value, attention_mask,
                                     dropout=dropout, scaling=scaling, is_causal=is_causal,
                                     **kwargs)
    return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                is_causal=is_causal, **kwargs)


class _Name(str):
    """:data:`NAME` as the model's configs hold it: unpickling it (a patched model loaded in a
    new process) registers the attention with transformers before the model can call it."""

    def __reduce__(self):
        return _registered_name, ()


def _registered_name() -> _Name:
    """Register this attention, and SDPA's mask format for it, with transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, sdpa_attention_forward)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS[_SDPA])
    return _Name(NAME)


def install(model: nn.Module) -> str | None:
    """Make ``model`` (a ``transformers`` model whose attention implementation is SDPA) run
    :func:`sdpa_attention_forward`. Returns None when installed (or already), else why not."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current == NAME:
        return None
    if current != _SDPA or not hasattr(model, "set_attn_implementation"):
        return f"attention implementation {current!r} (only 'sdpa' is recomputed)"
    model.set_attn_implementation(_registered_name())
    if config._attn_implementation != NAME:
        return "the model does not take an attention implementation from transformers' interface"
    return None
