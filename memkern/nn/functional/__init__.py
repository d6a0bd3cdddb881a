"""The autograd layer of :mod:`memkern.nn`: one ``torch.autograd.Function`` per concept, each
deciding exactly what is saved for backward and what is recomputed (see each file's docstring).

=====================  ===========================================================
file                   what it saves for backward
=====================  ===========================================================
linear.py              the input (weight grad accumulated into ``weight.grad``)
norm.py                the input and per-row statistics, never the normalised output
dropout.py             an 8-byte seed, never a mask
mlp.py                 per ``recompute``: x, pre-activation (and activation)
swiglu.py              per ``recompute``: x, gate, up (and h)
linear_cross_entropy   never a [tokens, classes] tensor
_saved.py              the "recomputable output" mechanism (norm outputs)
_grad.py               accumulation of weight gradients into existing ``.grad``
=====================  ===========================================================
"""
from memkern.nn.functional.dropout import dropout
from memkern.nn.functional.linear import linear
from memkern.nn.functional.linear_cross_entropy import linear_cross_entropy
from memkern.nn.functional.mlp import mlp
from memkern.nn.functional.norm import layer_norm, rms_norm
from memkern.nn.functional.swiglu import swiglu

__all__ = ["dropout", "layer_norm", "linear", "linear_cross_entropy", "mlp", "rms_norm", "swiglu"]
