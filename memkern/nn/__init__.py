"""memkern.nn: drop-in layers that save less for backward and recompute what is cheap.

Each module has the constructor, parameters and ``state_dict`` keys of its torch counterpart
and documents what it saves for backward. A layer's module and the function deciding it (the
call of the layer's op) share one file named by the layer (``linear.py``, ``norm.py``,
``modulated_norm.py``, ``dropout.py``, ``mlp.py``, ``swiglu.py``, ``swiglu_unit.py``, ``lora.py``,
``linear_cross_entropy.py``);
:mod:`memkern.nn.functional` is the functions' public namespace. :func:`checkpoint` applies a
recompute policy to any module and :func:`patch` swaps a model's torch layers for these in
place.
"""
from memkern.nn import functional
from memkern.nn.checkpoint import checkpoint
from memkern.nn.dropout import Dropout
from memkern.nn.linear import Conv1D, Linear
from memkern.nn.linear_cross_entropy import LinearCrossEntropy
from memkern.nn.mlp import MLP
from memkern.nn.norm import LayerNorm, RMSNorm
from memkern.nn.patch import PatchReport, patch, patch_report
from memkern.nn.swiglu import SwiGLU

__all__ = ["Conv1D", "Dropout", "LayerNorm", "Linear", "LinearCrossEntropy", "MLP",
           "PatchReport", "RMSNorm", "SwiGLU", "checkpoint", "functional", "patch",
           "patch_report"]
