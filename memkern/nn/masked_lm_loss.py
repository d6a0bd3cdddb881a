"""The training loss of a ``transformers`` masked LM through memkern's fused linear cross-entropy.

A ``transformers`` masked LM (BERT, RoBERTa, XLM-R, ELECTRA, DeBERTa-v2 ``*ForMaskedLM``) runs
its encoder, then a head — a transform (dense -> activation -> LayerNorm) and the decoder to
the vocabulary (``get_output_embeddings()``, tied to the input embeddings) — on every token,
and takes the cross-entropy of the ``[tokens, vocab]`` logits with ``labels`` (-100: not a
masked token, ignored). About 85% of the labels are -100, and the logits (XLM-R: 250,002 per
token) are the largest tensors of the step.

:func:`fuse_masked_lm_loss` changes the training call (train mode, ``labels`` given) without
touching transformers' code:

* a forward pre-hook on the model takes ``labels`` out of the call (the model then computes no
  loss of its own) and opens a fused call;
* a forward hook on the encoder (``model.base_model``) keeps only the labelled rows of its
  output, ``[n_labelled, hidden]``, so that the head's transform runs on those rows only;
* the decoder (a memkern class of its ``nn.Linear``, as for causal LMs: see
  :mod:`memkern.nn.causal_lm_loss`) keeps its input the first time the model calls it and
  returns a placeholder that takes no memory instead of logits;
* a forward hook on the model calls the decoder (a memkern class of its
  ``nn.Linear``, as for causal LMs) with the kept rows and a loss request: the call computes
  the loss with :func:`memkern.nn.functional.linear_cross_entropy` from the rows, its weight
  and bias and the labelled rows' labels — the mean over labelled tokens, as
  ``CrossEntropyLoss()``, or the sum divided by ``num_items_in_batch`` when the Trainer passes
  it to a model whose own loss would (``self.loss_function``) — and the hook returns the
  output with that ``loss`` and ``logits=None``.

Saved for backward by the head and loss: the labelled rows' encoder output, the transform's
tensors for those rows, and per labelled row the loss's input gradient and log-sum-exp; never
a ``[tokens, vocab]`` tensor, nor a ``[vocab, hidden]`` one (the decoder's weight gradient is
computed in the backward, recomputing the labelled rows' logits by blocks of the vocabulary).

Without labels, or in eval mode, the model computes its logits (and loss) as before.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from torch import nn

from memkern import _fake
from memkern.nn.causal_lm_loss import (
    _CALL,
    _HEADS,
    _FusedCall,
    _LossRequest,
    output_layer_name,
    output_layer_problem,
)

IGNORE_INDEX = -100
"""The label of unmasked tokens (``CrossEntropyLoss``'s default ignore_index)."""

_FUSED = "_memkern_mlm_fused"
_SUMS_OVER_ITEMS = "_memkern_mlm_sums_over_items"


@dataclasses.dataclass
class _MaskedCall(_FusedCall):
    labels: torch.Tensor | None = None
    rows: torch.Tensor | None = None  # indices of the labelled tokens
    target: torch.Tensor | None = None  # their labels
    num_items_in_batch: torch.Tensor | int | None = None  # the loss's divisor, when given


def _bind_labels(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict, Any]:
    """(args, kwargs) with ``labels`` set to None, and the labels given (None: none)."""
    if "labels" in kwargs:
        labels = kwargs["labels"]
        return args, {**kwargs, "labels": None}, labels
    if not args:
        return args, kwargs, None
    try:
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs)
    except TypeError:  # arguments the forward does not take: the model's own call will say so
        return args, kwargs, None
    labels = bound.arguments.get("labels")
    if labels is None:
        return args, kwargs, None
    bound.arguments["labels"] = None
    return bound.args, bound.kwargs, labels


def _open_call(model: nn.Module, args: tuple, kwargs: dict):
    head = model.get_output_embeddings()
    if not model.training or not isinstance(head, tuple(_HEADS.values())):
        return None
    args, kwargs, labels = _bind_labels(model, args, kwargs)
    if labels is None:
        return None
    call = _MaskedCall(softcap=None, head=head, labels=labels)
    if model.__dict__[_SUMS_OVER_ITEMS]:
        call.num_items_in_batch = kwargs.get("num_items_in_batch")
    for m in (model, head, model.base_model):
        m.__dict__[_CALL] = call
    return args, kwargs


def _rows(labels: torch.Tensor) -> torch.Tensor:
    """The indices of the labelled tokens (in ``labels.reshape(-1)``)."""
    return (labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)


def _target(labels: torch.Tensor) -> torch.Tensor:
    """The labelled tokens' labels."""
    flat = labels.reshape(-1)
    return flat[flat != IGNORE_INDEX]


def _keep_labelled_rows(base: nn.Module, args: tuple, output: Any) -> Any:
    call = base.__dict__.get(_CALL)
    if call is None or output is None or call.rows is not None:
        return None
    hidden = output[0]
    if call.labels.numel() != hidden.shape[:-1].numel():
        raise ValueError(f"memkern.patch: labels have {call.labels.numel()} elements but the "
                         f"encoder output {tuple(hidden.shape[:-1])} tokens")
    if _fake.is_fake(call.labels):  # planned on fake tensors: the rows depend on the data
        real = _fake.data_of(call.labels)
        if real is None:
            raise ValueError("memkern.patch: a masked LM's fused loss keeps the labelled rows, "
                             "whose number fake labels do not say; plan with labels made by "
                             "memkern._fake.fake_with_data(real_labels)")
        call.rows, call.target = (_fake.computed_on_host(f, real) for f in (_rows, _target))
    else:
        labels = call.labels.to(hidden.device)
        call.rows, call.target = _rows(labels), _target(labels)
    kept = hidden.reshape(-1, hidden.shape[-1]).index_select(0, call.rows)
    if isinstance(output, tuple):
        return (kept, *output[1:])
    output[next(iter(output.keys()))] = kept
    return output


def _close_call(model: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    call = model.__dict__.pop(_CALL, None)
    if call is None:
        return None
    model.base_model.__dict__.pop(_CALL, None)
    if output is None:  # the forward raised: only restore
        call.head.__dict__.pop(_CALL, None)
        return None
    if call.placeholder is None or call.rows is None:
        call.head.__dict__.pop(_CALL, None)
        raise RuntimeError(
            f"memkern.patch: {type(model).__name__}.forward did not run its encoder and then its "
            "output layer, so the fused masked-LM loss cannot be computed; patch it with "
            "memkern.patch(model, loss=False)")
    hidden, call.hidden = call.hidden, None
    # Per-row losses, then their mean: the weight gradient is computed in the backward from the
    # few labelled rows (one more [rows, vocab] GEMM, by blocks) instead of being accumulated
    # in the forward and held, [vocab, hidden], until the backward. Through the layer's call,
    # as the causal-LM loss, so that a wrapper (FSDP2) makes its weight available.
    call.loss_request = _LossRequest(call.target, IGNORE_INDEX, None, per_row=True)
    try:
        losses = call.head(hidden)
    finally:
        call.head.__dict__.pop(_CALL, None)
    divisor = call.target.numel() if call.num_items_in_batch is None else call.num_items_in_batch
    if isinstance(divisor, torch.Tensor):
        divisor = divisor.to(losses.device)
    loss = losses.sum() / divisor
    if isinstance(output, tuple):
        return (loss, *(None if o is call.placeholder else o for o in output))
    fields = {k: v for k, v in output.items() if v is not call.placeholder}
    return type(output)(**{**fields, "loss": loss, "logits": None})


def _why_not_fusable(model: nn.Module) -> str | None:
    if getattr(model, "base_model", model) is model:
        return "no encoder (base_model) to take the labelled rows from"
    if "labels" not in inspect.signature(model.forward).parameters:
        return "its forward takes no labels"
    return output_layer_problem(model)


def _sums_over_items(model: nn.Module) -> bool:
    """Whether ``model``'s own loss divides by the Trainer's ``num_items_in_batch`` when it is
    passed: models whose forward calls ``self.loss_function`` (ModernBERT) do; those that take
    ``CrossEntropyLoss()`` (BERT, RoBERTa, XLM-R, ELECTRA, DeBERTa-v2) average over the call's
    labelled tokens whatever the Trainer passes."""
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return False
    return "self.loss_function(" in source


def _is_masked_lm(model: nn.Module) -> bool:
    """transformers' own classification of ``model``: its loss type is the masked-LM loss."""
    loss_function = getattr(type(model), "loss_function", None)
    return (isinstance(loss_function, property)
            and getattr(getattr(model, "loss_function", None), "__name__", "") == "ForMaskedLMLoss")


def fuse_masked_lm_loss(model: nn.Module) -> tuple[str, str, str] | str | None:
    """Route a ``transformers`` masked LM's training loss through the fused linear
    cross-entropy on its labelled rows (in place; see the module docstring).

    Returns ``(name of the output layer, old class, new class)`` when it did, the reason when a
    masked LM cannot be fused, and None when ``model`` is not a ``transformers`` masked LM (or
    was fused by an earlier call).
    """
    if (model.__dict__.get(_FUSED) or not callable(getattr(model, "get_output_embeddings", None))
            or not _is_masked_lm(model)):
        return None
    why = _why_not_fusable(model)
    if why is not None:
        return why
    head, name = model.get_output_embeddings(), output_layer_name(model)
    old = type(head)
    if old in _HEADS:
        head.__class__ = _HEADS[old]
    model.register_forward_pre_hook(_open_call, with_kwargs=True)
    model.base_model.register_forward_hook(_keep_labelled_rows)
    model.register_forward_hook(_close_call, with_kwargs=True, always_call=True)
    model.__dict__[_FUSED] = True
    model.__dict__[_SUMS_OVER_ITEMS] = _sums_over_items(model)
    return (name, f"{old.__module__}.{old.__qualname__}",
            f"memkern.nn.causal_lm_loss.{type(head).__qualname__}")
