"""The training loss of a ``transformers`` causal LM through memkern's fused linear cross-entropy.

A ``transformers`` causal LM (GPT-2, Llama, Mistral, Qwen2, Gemma 2, ...) computes, in its
``forward``::

    logits = self.lm_head(hidden_states)             # [batch, seq, vocab]
    (optional post-processing, e.g. Gemma 2's soft-capping)
    loss = self.loss_function(logits, labels, vocab_size, **kwargs)   # ForCausalLMLoss

so a training step holds the ``[tokens, vocab]`` logits, their float32 copy in the loss and
their gradient. :func:`fuse_causal_lm_loss` routes that loss through
:func:`memkern.nn.functional.linear_cross_entropy` without touching transformers' code:

* during a fused call the output layer's own ``__call__`` (its class is memkern's: see below)
  keeps its input ``hidden_states`` the first time the model calls it and returns a
  placeholder that takes no memory (a float32 zero expanded to ``[..., vocab]``, stride 0)
  instead of the logits, running no weight-using code and none of its hooks;
* ``model.loss_function`` (transformers' public, settable attribute) becomes a
  :class:`FusedCausalLMLoss`: given that placeholder, it calls the output layer with the kept
  hidden states, and that call (through ``nn.Module.__call__`` and its hooks, then the layer's
  ``forward``) computes the loss from them and the layer's weight (and bias) chunk by chunk;
  given real logits it calls the model's original loss function;
* a forward pre-hook on the model opens a fused call when the model is in training mode and
  ``labels`` are given; a forward hook closes it, also when the forward raises, and sets the
  output's ``logits`` to None.
  Soft-capping (``config.final_logit_softcapping``) is folded into the fused loss, the
  config's value being set to None for the call so that the forward does not apply it to the
  placeholder.

So the output layer is called once per forward through ``nn.Module.__call__``, as in the
unfused model, and that call computes the loss: the weight is never read outside a call of its
module, and whatever wraps the layer sees its use as that layer's forward. The module stays in
its seat: ``model.lm_head`` and ``get_output_embeddings()`` are the same layer, with its weight,
during a fused call as outside one, so code that replaces the model's forward and reads the
weight itself (trl's chunked LM head, ``trl.trainer.utils.add_fused_lm_head``) runs unchanged,
the fused call then closing without a loss of its own. Under FSDP2's ``fully_shard`` the weight
is all-gathered for the loss call, the loss gets the hook that gathers it
again for backward, and the gradients are reduced when backward has passed the unit's first
input, in any unit layout (the layer in the root's unit, in its own, or with the final norm as
one unit as torchtitan does). Once fused, nothing assumes the layer's class: wrappers that
subclass modules dynamically (FSDP2 does) keep working. ``patch`` itself recognises the output
layer by its exact class (``nn.Linear`` or memkern's), so it comes before ``fully_shard``: a
model sharded first is reported with its loss left unfused.

Semantics are those of transformers' ``ForCausalLMLoss``: labels shifted left by one (or
``shift_labels`` used as given), ``ignore_index`` (default -100), the mean over non-ignored
tokens, or the sum divided by ``num_items_in_batch`` when the Trainer passes it.

If a model's forward does something else between ``lm_head`` and ``loss_function`` (scales the
logits, computes its loss without ``loss_function``), the call raises a RuntimeError saying so
rather than return a loss computed from the placeholder; ``memkern.patch(model, loss=False)``
keeps such a model's loss unfused.
"""
from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from memkern.nn._autocast import autocast_enabled
from memkern.nn.linear import Linear as _MemkernLinear
from memkern.nn.linear_cross_entropy import linear_cross_entropy

SOFTCAP_ATTR = "final_logit_softcapping"
"""The config field of transformers' families that soft-cap their final logits (Gemma 2/3)."""

_CALL = "_memkern_lce_call"
_FUSED = "_memkern_lce_fused"


@dataclasses.dataclass
class _LossRequest:
    """What the output layer's loss call computes (set by :class:`FusedCausalLMLoss`)."""
    target: torch.Tensor
    ignore_index: int
    num_items: Any
    per_row: bool = False
    """Per-row losses (reduction "none"): the weight gradient is then computed in backward from
    the rows, never held ``[vocab, hidden]`` from the forward (the masked-LM loss)."""


@dataclasses.dataclass
class _FusedCall:
    """One fused forward: what the output layer's first call kept and what the loss must know."""
    softcap: float | None
    head: nn.Linear
    hidden: torch.Tensor | None = None
    placeholder: torch.Tensor | None = None
    loss_request: _LossRequest | None = None
    loss_computed: bool = False


def _head_call(head: nn.Linear, call_module: Callable, args: tuple, kwargs: dict) -> Any:
    """The output layer's ``__call__``: the first call of a fused forward keeps its input for
    the fused loss and returns the placeholder, without the module's hooks (a wrapper such as
    FSDP2 would gather the weight for a call that does not read it); any other call (the
    loss's, a second use of the layer in the same forward, every call outside a fused forward)
    is ``call_module(*args, **kwargs)``, ``nn.Module.__call__``."""
    call = head.__dict__.get(_CALL)
    if (call is None or call.placeholder is not None or call.loss_request is not None
            or len(args) != 1 or kwargs):
        return call_module(*args, **kwargs)
    (input,) = args
    call.hidden = input
    call.placeholder = torch.zeros((), dtype=torch.float32, device=input.device).expand(
        *input.shape[:-1], head.out_features)
    return call.placeholder


def _head_forward(head: nn.Linear, input: torch.Tensor, linear: Callable) -> torch.Tensor:
    """The output layer's forward: the fused loss of ``input`` when :class:`FusedCausalLMLoss`
    calls it with a loss request, else ``linear(input)`` (its class's own forward)."""
    call = head.__dict__.get(_CALL)
    if call is None or call.loss_request is None:
        return linear(input)
    request, call.loss_request = call.loss_request, None
    return _fused_loss(head, input, request, call.softcap)


def _fused_loss(head: nn.Linear, hidden: torch.Tensor, request: _LossRequest,
                softcap: float | None) -> torch.Tensor:
    """The loss of ``hidden`` ``[..., hidden_size]`` through ``head``'s weight and bias against
    ``request.target`` (flat), in the dtype ``F.linear`` would compute in."""
    weight, bias = head.weight, head.bias
    dtype = (torch.get_autocast_dtype(hidden.device.type)
             if autocast_enabled(hidden.device.type)  # as F.linear would compute
             else torch.promote_types(hidden.dtype, weight.dtype))
    num_items = request.num_items
    return linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]).to(dtype), weight.to(dtype), request.target,
        None if bias is None else bias.to(dtype), ignore_index=request.ignore_index,
        reduction="none" if request.per_row else "mean" if num_items is None else "sum",
        num_items=num_items, softcap=softcap)


class CausalLMHead(nn.Linear):
    """An ``nn.Linear`` output layer whose training-with-labels call hands its input to the
    fused loss instead of computing logits (see the module docstring)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _head_call(self, super().__call__, args, kwargs)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _head_forward(self, input, super().forward)


class MemkernCausalLMHead(_MemkernLinear):
    """The same for a :class:`memkern.nn.Linear` output layer."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _head_call(self, super().__call__, args, kwargs)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _head_forward(self, input, super().forward)


_HEADS = {nn.Linear: CausalLMHead, _MemkernLinear: MemkernCausalLMHead}


def _shifted_labels(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``labels[..., 1:]`` padded with ``ignore_index`` at the end: position t predicts t + 1."""
    return nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


class FusedCausalLMLoss:
    """``model.loss_function`` of a fused model: transformers' ``ForCausalLMLoss`` signature.

    ``loss = fused(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
    shift_labels=None, **kwargs)``. With the placeholder logits of a fused call it returns the
    fused loss (in the hidden states' dtype); with any other logits, ``original(...)``.
    """

    def __init__(self, original: Callable[..., torch.Tensor], head: nn.Linear) -> None:
        self.original = original
        self.head = head

    def __call__(self, logits, labels, vocab_size=None, num_items_in_batch=None,
                 ignore_index: int = -100, shift_labels=None, **kwargs):
        call = self.head.__dict__.get(_CALL)
        if call is None or call.placeholder is None:
            return self.original(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                 ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        if logits is not call.placeholder:
            raise RuntimeError(
                "memkern.patch: this model's forward changes the logits between its output layer "
                "and self.loss_function (e.g. scales them), which the fused loss cannot reproduce; "
                "patch it with memkern.patch(model, loss=False) to keep its loss unfused"
            )
        hidden, call.hidden = call.hidden, None  # released as soon as it is consumed
        call.loss_computed = True
        head = self.head
        if vocab_size is not None and vocab_size != head.out_features:
            raise ValueError(f"memkern.patch: vocab_size={vocab_size} but the output layer has "
                             f"{head.out_features} classes")
        if shift_labels is None:
            shift_labels = _shifted_labels(labels, ignore_index)
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(hidden.device)
        call.loss_request = _LossRequest(shift_labels.to(hidden.device).reshape(-1),
                                         ignore_index, num_items_in_batch)
        # Through the layer's call, so that a wrapper (FSDP2) makes its weight available for
        # this use and for its backward.
        return head(hidden)


def _labels_given(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    if "labels" in kwargs:
        return kwargs["labels"] is not None
    if not args:
        return False
    try:
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs)
    except TypeError:
        return False
    return bound.arguments.get("labels") is not None


def _open_call(model: nn.Module, args: tuple, kwargs: dict) -> None:
    head = model.get_output_embeddings()
    fused = model.__dict__.get("_loss_function")
    if not (model.training and isinstance(fused, FusedCausalLMLoss) and fused.head is head
            and isinstance(head, tuple(_HEADS.values())) and _labels_given(model, args, kwargs)):
        return None
    config = getattr(model, "config", None)
    cap = getattr(config, SOFTCAP_ATTR, None)
    call = _FusedCall(softcap=cap or None, head=head)
    if cap is not None:
        setattr(config, SOFTCAP_ATTR, None)  # applied by the fused loss, not to the placeholder
    head.__dict__[_CALL] = call
    model.__dict__[_CALL] = call
    return None


def _close_call(model: nn.Module, args: tuple, output: Any) -> Any:
    call = model.__dict__.pop(_CALL, None)
    if call is None:
        return None
    call.head.__dict__.pop(_CALL, None)
    if call.softcap is not None:
        setattr(model.config, SOFTCAP_ATTR, call.softcap)
    if output is None:  # the forward raised: only restore
        return None
    if call.placeholder is not None and not call.loss_computed:
        raise RuntimeError(
            f"memkern.patch: {type(model).__name__}.forward used its output layer but did not "
            "compute its loss through self.loss_function, so the fused loss was not applied and "
            "its loss is wrong; patch it with memkern.patch(model, loss=False)"
        )
    if isinstance(output, Mapping) and output.get("logits") is call.placeholder:
        output["logits"] = None
    elif isinstance(output, tuple):
        output = tuple(None if o is call.placeholder else o for o in output)
    return output


def output_layer_problem(model: nn.Module) -> str | None:
    """Why ``model``'s output layer (``get_output_embeddings()``) cannot hand its input to a
    fused loss, or None: it must be an ``nn.Linear`` or memkern ``Linear`` (exact classes)."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or type(head) not in (*_HEADS, *_HEADS.values()):
        return "no nn.Linear output layer (get_output_embeddings)"
    return None


def output_layer_name(model: nn.Module) -> str:
    """The name of ``model``'s output layer (``get_output_embeddings()``) among its modules."""
    head = model.get_output_embeddings()
    return next(n for n, m in model.named_modules() if m is head)


def _why_not_fusable(model: nn.Module) -> str | None:
    """None if ``model`` looks like a transformers causal LM whose loss can be fused."""
    problem = output_layer_problem(model)
    if problem is not None:
        return problem
    original = getattr(model, "loss_function", None)
    if original is None:
        return ("no loss_function: this transformers version computes the loss inline "
                "(needs >= 4.46)")
    name = getattr(original, "__name__", "")
    if name != "ForCausalLMLoss" and not isinstance(original, FusedCausalLMLoss):
        return (f"its loss_function is {name or type(original).__name__}, "
                "not ForCausalLMLoss")
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        source = None  # no source to read: the checks at each fused call still hold
    if source is not None and "loss_function" not in source:
        return "its forward does not compute the loss through self.loss_function"
    return None


def fuse_causal_lm_loss(model: nn.Module) -> tuple[str, str, str] | str | None:
    """Route ``model``'s training loss through the fused linear cross-entropy (in place).

    Returns ``(name of the output layer, old class, new class)`` when it did, the reason when a
    model with an output layer (``get_output_embeddings``) cannot be fused, and None when there
    is nothing to do (no such method, or fused by an earlier call).
    """
    if model.__dict__.get(_FUSED) or not callable(getattr(model, "get_output_embeddings", None)):
        return None
    why = _why_not_fusable(model)
    if why is not None:
        return why
    head, name = model.get_output_embeddings(), output_layer_name(model)
    try:
        model.loss_function = FusedCausalLMLoss(model.loss_function, head)
    except AttributeError:
        return "this transformers version's loss_function cannot be set (needs >= 4.46)"
    old = type(head)
    if old in _HEADS:
        head.__class__ = _HEADS[old]
    model.register_forward_pre_hook(_open_call, with_kwargs=True)
    model.register_forward_hook(_close_call, always_call=True)
    model.__dict__[_FUSED] = True
    return name, f"{old.__module__}.{old.__qualname__}", f"{__name__}.{type(head).__qualname__}"
