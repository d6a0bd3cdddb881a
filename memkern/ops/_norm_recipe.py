"""The ``norm_*`` arguments of memkern's C++ autograd layers (``memkern::linear_layer``,
``memkern::mlp_layer``, ``memkern::swiglu_layer``): the layer input's *recipe* when it is a
memkern norm's output (:mod:`memkern.nn.functional._saved`), so that the layer saves the
norm's input and parameters instead of the normalised output and rebuilds it in backward
(csrc/autograd/saved_input.h).

Arguments
    norm_x, norm_weight, norm_bias   the norm's input and parameters (None: no recipe; the
                                     layer saves its input itself).
    norm_kind    which computation rebuilds the output (``NormKind`` in
                 csrc/autograd/saved_input.h: torch's ``native_layer_norm``, or
                 ``memkern::norm_forward`` over the flattened trailing dimensions as LayerNorm
                 or RMSNorm); the norm's C++ entry fills it in (csrc/autograd/norm.h).
    norm_dims    how many trailing dimensions of ``norm_x`` are normalised.
    norm_eps     the norm's eps.
"""
from __future__ import annotations

SCHEMA = ("Tensor? norm_x=None, Tensor? norm_weight=None, Tensor? norm_bias=None, "
          "int norm_kind=0, int norm_dims=0, float norm_eps=0.")
