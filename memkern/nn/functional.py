"""The functional layer of :mod:`memkern.nn`: per layer, the call of its layer op, which decides
exactly what is saved for backward and what is recomputed. Each function lives in its layer's
file, with the layer's module (the table below; that file's docstring says what is saved and
recomputed); this module is their public namespace.

No layer has a Python autograd: every call runs the layer op's C++ node
(:mod:`memkern.ops.linear_layer`, :mod:`memkern.ops.dropout_layer`,
:mod:`memkern.ops.norm_layer`, :mod:`memkern.ops.modulated_norm_layer`,
:mod:`memkern.ops.mlp_layer`, :mod:`memkern.ops.swiglu_layer`,
:mod:`memkern.ops.swiglu_unit_layer`, :mod:`memkern.ops.lora_layer`,
:mod:`memkern.ops.linear_cross_entropy_layer`, :mod:`memkern.ops.linear_log_prob_layer`), and
without the compiled extension they are
plain torch, with the same defaults — ``F.linear``, ``F.dropout``, ``F.layer_norm``,
``F.rms_norm``, the modulated LayerNorm as ``F.layer_norm(x, (features,)) * (1 + scale) +
shift``, the MLP as ``F.linear(act(F.linear(x, fc1)), fc2)``, SwiGLU as
``F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)``, SwiGLU's gated unit as
``F.silu(gate) * up``, the LoRA adapter as ``base +
F.linear(F.linear(F.dropout(x), A), B) * scaling``, the linear cross-entropy as
``F.cross_entropy(F.linear(x, weight, bias), target)`` (the logits soft-capped, the summed loss
divided by ``num_items`` where asked), saving what torch saves (the only Python path a layer
has).

=====================  ======================  ==================================================
function               file (memkern/nn/)      what it saves for backward
=====================  ======================  ==================================================
linear                 linear.py               the input (weight grad accumulated into
                                               ``weight.grad``)
layer_norm, rms_norm   norm.py                 the input and per-row statistics, never the
                                               normalised output
modulated_layer_norm   modulated_norm.py       adaLN's LayerNorm: the input, its statistics,
                                               scale and shift
dropout                dropout.py              an 8-byte seed, never a mask
mlp                    mlp.py                  per ``recompute``: x, pre-activation (and
                                               activation)
swiglu                 swiglu.py               per ``recompute``: x, gate, up (and h)
swiglu_unit            swiglu_unit.py          gate and up, never its output (its consumer
                                               rebuilds it)
lora                   lora.py                 the adapter's input (nothing new after a memkern
                                               norm) and an 8-byte dropout seed
linear_cross_entropy   linear_cross_entropy.py never a ``[tokens, classes]`` tensor
linear_log_probs       linear_log_probs.py     the same (reduction "none"), and the per-token
                                               log-sum-exp and entropy
=====================  ======================  ==================================================
"""
from memkern.nn.dropout import dropout
from memkern.nn.linear import linear
from memkern.nn.linear_cross_entropy import linear_cross_entropy
from memkern.nn.linear_log_probs import LogProbs, linear_log_probs
from memkern.nn.lora import lora
from memkern.nn.mlp import mlp
from memkern.nn.modulated_norm import modulated_layer_norm
from memkern.nn.norm import layer_norm, rms_norm
from memkern.nn.swiglu import swiglu
from memkern.nn.swiglu_unit import swiglu_unit

__all__ = ["LogProbs", "dropout", "layer_norm", "linear", "linear_cross_entropy",
           "linear_log_probs", "lora", "mlp", "modulated_layer_norm", "rms_norm", "swiglu",
           "swiglu_unit"]
