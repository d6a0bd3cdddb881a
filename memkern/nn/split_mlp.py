"""An encoder MLP split across two modules, run as one memkern MLP.

BERT-family encoders (BERT, RoBERTa, XLM-R, ELECTRA, DeBERTa-v2) compute a layer's MLP in two
child modules that the layer calls one after the other, ``self.output(self.intermediate(x), x)``:

* the *intermediate* module: ``h = act(dense(x))``;
* the *output* module: ``LayerNorm(dropout(dense(h)) + x)`` (post-LN: the residual sum is
  normalised).

Unfused, ``h`` (``[tokens, intermediate_size]``) is kept twice between forward and backward: the
activation keeps its input, the output's ``dense`` keeps ``h``. Fused, the two GEMMs and the
activation run as one :func:`memkern.nn.functional.mlp` call, which keeps, per ``recompute``,
the pre-activation only (``"activation"``) or nothing beyond ``x`` (``"full"``); dropout, the
residual add and the LayerNorm then run as the output module's own layers (memkern's after
:func:`memkern.patch`): what is saved is that of memkern's MLP followed by a residual LayerNorm.

How, without touching the layer's code: the layer's forward (a memkern subclass's) opens a
*call* around its own; during it the intermediate module returns its input unchanged (the call
remembers it) and the output module, given that very tensor, computes the fused block. Outside a
layer call (the intermediate module called on its own) both modules compute what they always did. If
the layer uses the intermediate's result for anything but the output module, the call raises a
RuntimeError rather than compute a wrong result (``memkern.patch(model, mlp=False)`` keeps such
a layer unfused). If a dense layer is no longer a plain linear layer (a LoRA adapter put in its
place after ``patch``) or has a hook, the modules compute what they always did
(:func:`fused_over`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memkern.nn.linear import Linear
from memkern.nn.mlp import mlp

_CALL = "_memkern_split_mlp"


def fused_over(layer: nn.Module) -> bool:
    """Whether a fused block may read ``layer``'s weight and bias instead of calling it:
    ``layer`` is a plain ``nn.Linear`` (memkern's or torch's) with no hook. A module put in its
    place after ``patch`` (a LoRA adapter, which wraps the layer and adds its own term) or a
    hook on it (FSDP2's unshard, a user's) would otherwise be skipped without a word."""
    return type(layer) in (nn.Linear, Linear) and not hooked(layer)


def hooked(m: nn.Module) -> bool:
    """Whether a hook is registered on ``m`` itself (forward, forward-pre or backward)."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or m._backward_pre_hooks)


class SplitMLPCall:
    """One layer's fused MLP: its two modules, the attributes they keep their layers in, and
    the input the intermediate module passed through in the open layer call (None: none)."""

    __slots__ = ("intermediate", "fc", "activation", "proj", "dropout", "norm", "recompute",
                 "open", "passed")

    def __init__(self, intermediate: nn.Module, fc: str, activation: str, proj: str,
                 dropout: str, norm: str, recompute: str) -> None:
        self.intermediate = intermediate
        self.fc, self.activation, self.proj = fc, activation, proj
        self.dropout, self.norm, self.recompute = dropout, norm, recompute
        self.open = False
        self.passed: torch.Tensor | None = None


def intermediate_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """The intermediate module: in an open layer call, pass the input through (see the module
    docstring); else ``act(dense(x))`` as before."""
    call = self.__dict__.get(_CALL)
    if (call is None or not call.open or call.passed is not None
            or not fused_over(getattr(self, call.fc))):
        return self._memkern_base.forward(self, hidden_states)
    call.passed = hidden_states
    return hidden_states


def output_forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
    """The output module: given the tensor the intermediate module passed through, the fused
    block ``norm(dropout(mlp(x)) + input_tensor)``; else its own forward."""
    call = self.__dict__.get(_CALL)
    if call is None or call.passed is None:
        return self._memkern_base.forward(self, hidden_states, input_tensor)
    if hidden_states is not call.passed:
        call.passed = None
        raise RuntimeError(
            "memkern.patch: this layer changes its intermediate module's output before its output "
            "module, which the fused MLP cannot reproduce; patch the model with "
            "memkern.patch(model, mlp=False) to keep its MLP unfused")
    call.passed = None
    fc, proj = getattr(call.intermediate, call.fc), getattr(self, call.proj)
    if not fused_over(proj):
        intermediate = call.intermediate
        h = intermediate._memkern_base.forward(intermediate, hidden_states)
        return self._memkern_base.forward(self, h, input_tensor)
    y = mlp(hidden_states, fc.weight, fc.bias, proj.weight, proj.bias,
            activation=call.activation, recompute=call.recompute)
    return getattr(self, call.norm)(getattr(self, call.dropout)(y) + input_tensor)


def layer_forward(self, *args: Any, **kwargs: Any) -> Any:
    """The layer: its own forward, as one open call (see the module docstring). Its forward
    itself, not hooks around it, opens the call: transformers' gradient checkpointing reruns a
    layer's forward in backward without its hooks."""
    call = self.__dict__[_CALL]
    call.open, call.passed = True, None
    try:
        output = self._memkern_base.forward(self, *args, **kwargs)
    finally:
        passed, call.passed, call.open = call.passed, None, False
    if passed is not None:
        raise RuntimeError(
            f"memkern.patch: {self._memkern_base.__name__} used its intermediate module's "
            "output for something other than its output module, so the fused MLP did not run "
            "and its output is wrong; patch the model with memkern.patch(model, mlp=False)")
    return output


def fuse(layer: nn.Module, intermediate: nn.Module, output: nn.Module, call: SplitMLPCall) -> None:
    """Route ``layer``'s MLP through one memkern MLP call (the caller swaps the three modules'
    classes to ones whose forwards are :func:`layer_forward`, :func:`intermediate_forward` and
    :func:`output_forward`)."""
    for m in (layer, intermediate, output):
        m.__dict__[_CALL] = call


def is_fused(layer: nn.Module) -> bool:
    return _CALL in layer.__dict__
