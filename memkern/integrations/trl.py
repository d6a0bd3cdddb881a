"""memkern's per-token log-probability head in trl's trainers: :func:`use_memkern_head`.

trl 1.16 gives the models its trainers train a fused LM head
(``trl.trainer.utils.add_fused_lm_head``): called with ``fused_lm_head=True``, the model runs
its backbone and hands the hidden states to ``trl.kernels.ChunkedLogProbFunction``, which
returns each token's log-probability of its label and whatever else the trainer asked for when
it added the head (``outputs``):

=========================  ===============================================================
trainer                    outputs
=========================  ===============================================================
``SFTTrainer``             log-probabilities (the loss), entropy and is-top-1 (metrics)
``DPOTrainer``             the same and the mean logit (metrics); WPO (``use_weighting``)
                           also ``log_sum_sq_probs``
``GRPOTrainer``            log-probabilities and entropy (metric, high-entropy mask, and the
                           entropy bonus — ``entropy_coef`` — which differentiates it)
reference models           log-probabilities
=========================  ===============================================================

:func:`use_memkern_head` makes those models compute them with
:func:`memkern.nn.functional.linear_log_probs` (memkern's linear cross-entropy loops, which
never hold the ``[tokens, vocab]`` logits), in place of trl's function; the rest of trl's
forward (the backbone call, the label shift, masks, FSDP2's gathered weight, the MoE loss) is
trl's own, unchanged. trl's temperature, ``logit_scale`` and ``final_logit_softcapping`` carry
over exactly: the logits ``softcap * tanh(scale * z / softcap) / T`` are those of the input
scaled by ``scale / T`` with the cap ``softcap / T`` (in 16-bit inputs, that scaling rounds the
input once more than trl does). trl's head runs where memkern's computes nothing like it: WPO's
``log_sum_sq_probs``, and a DeepSpeed ZeRO-3 weight (gathered only for the forward)::

    from memkern.integrations.trl import use_memkern_head

    trainer = SFTTrainer(model=model, args=SFTConfig(...), train_dataset=dataset)
    use_memkern_head(trainer)   # the policy's and the reference model's heads
    trainer.train()

Imported only when used: memkern itself needs no trl. Tested with trl 1.16.0.
"""
from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from trl.kernels import ChunkedLogProbFunction
from trl.kernels.chunked_logprob import OPTIONAL_OUTPUTS

from memkern.nn.linear_log_probs import linear_log_probs

_TRL_HEAD = "_ChunkedLogProbFunction"
"""The name under which trl's fused forward (``add_fused_lm_head``'s ``_fused_forward``, a
closure in ``trl.trainer.utils``) looks up its head at each call: the one private name of
trl's this module relies on."""


class MemkernLogProbHead:
    """What trl's fused forward calls in place of ``ChunkedLogProbFunction``: ``apply`` takes
    that function's arguments and returns its tuple ``(log_probs, entropy, log_sum_sq_probs,
    mean_logits, is_top1)``, each ``[N]`` or None where ``outputs`` does not ask for it."""

    @staticmethod
    def apply(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              targets: torch.Tensor, temperature: float, chunk_size: int,
              final_logit_softcapping: float | None = None, logit_scale: float = 1.0,
              outputs: tuple[str, ...] = OPTIONAL_OUTPUTS) -> tuple:
        if "log_sum_sq_probs" in outputs or hasattr(weight, "ds_id"):
            return ChunkedLogProbFunction.apply(hidden, weight, bias, targets, temperature,
                                                chunk_size, final_logit_softcapping,
                                                logit_scale, outputs)
        device = hidden.device.type
        # trl's projection dtype: autocast's where it is on, else the hidden states'
        dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                 else hidden.dtype)
        factor = logit_scale / temperature
        with torch.autocast(device, enabled=False):
            x = hidden.to(dtype)
            b = None if bias is None else bias.to(dtype)
            if factor != 1.0:
                x = x * factor
                b = None if b is None else b * factor
            result = linear_log_probs(
                x, weight.to(dtype), targets, b, entropy="entropy" in outputs,
                is_top1="is_top1" in outputs, mean_logits="mean_logits" in outputs,
                softcap=(None if final_logit_softcapping is None
                         else final_logit_softcapping / temperature))
        return (result.log_probs, result.entropy, None, result.mean_logits, result.is_top1)


def _is_trl_fused_forward(forward: Any) -> bool:
    function = getattr(forward, "__func__", None)
    return (function is not None and function.__code__.co_name == "_fused_forward"
            and function.__globals__.get("__name__") == "trl.trainer.utils")


def _with_memkern_head(forward: types.MethodType) -> types.MethodType:
    """trl's fused forward, bound to the same model, looking up memkern's head: the very
    function (code, closure, defaults, signature) over a copy of its module's globals."""
    function = forward.__func__
    if _TRL_HEAD not in function.__code__.co_names:
        raise RuntimeError(
            "memkern.integrations.trl.use_memkern_head: this trl's fused LM head does not call "
            f"{_TRL_HEAD}; memkern's head was written for trl 1.16 — use trl's own head with "
            "this version (do not call use_memkern_head)")
    namespace = dict(function.__globals__)
    namespace[_TRL_HEAD] = MemkernLogProbHead
    swapped = types.FunctionType(function.__code__, namespace, function.__name__,
                                 function.__defaults__, function.__closure__)
    swapped.__kwdefaults__ = function.__kwdefaults__
    swapped.__dict__.update(function.__dict__)  # functools.wraps' __wrapped__: the signature
    return types.MethodType(swapped, forward.__self__)


def use_memkern_head(trainer: Any) -> list[nn.Module]:
    """Makes the models of ``trainer`` (a trl trainer, built: trl adds its head in
    ``__init__``) compute their fused LM head's outputs with memkern's loops; or, given an
    ``nn.Module``, the models with trl's head inside it. Returns the modules whose forward now
    calls memkern's head (the model under any PEFT wrapper, the reference model). Calling it
    again changes nothing. Raises ``ValueError`` when no model has trl's head."""
    roots = ([trainer] if isinstance(trainer, nn.Module)
             else [getattr(trainer, "model", None), getattr(trainer, "ref_model", None)])
    found = []
    for root in roots:
        if not isinstance(root, nn.Module):
            continue
        for module in root.modules():
            forward = module.__dict__.get("forward")
            if not _is_trl_fused_forward(forward):
                continue
            if forward.__func__.__globals__.get(_TRL_HEAD) is not MemkernLogProbHead:
                module.forward = _with_memkern_head(forward)
            found.append(module)
    if not found:
        raise ValueError(
            "memkern.integrations.trl.use_memkern_head: no model of this trainer has trl's fused "
            "LM head (trl.trainer.utils.add_fused_lm_head); call it on a trl trainer after "
            "building it (its __init__ adds the head), or on a model given that head")
    return found
