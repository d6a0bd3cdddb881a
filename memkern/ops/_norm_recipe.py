"""The ``norm_*`` arguments of memkern's C++ autograd layers (``memkern::linear_layer``,
``memkern::mlp_layer``, ``memkern::swiglu_layer``): the layer input's *recipe* when it is a
memkern norm's output (:mod:`memkern.nn._saved`), or a modulated LayerNorm's
(:mod:`memkern.ops.modulated_norm_layer`), so that the layer saves the norm's input and
parameters instead of the normalised output and rebuilds it in backward
(csrc/autograd/saved_input.h).

Arguments
    norm_x, norm_weight, norm_bias   the norm's input and parameters (None: no recipe; the
                                     layer saves its input itself); for
                                     :data:`MODULATED_LAYER_NORM`, its input, scale and shift.
    norm_kind    which op rebuilds the output: :data:`NATIVE_LAYER_NORM`
                 (``torch.native_layer_norm``), :data:`LAYER_NORM` / :data:`RMS_NORM`
                 (``memkern::norm_forward`` over the flattened trailing dimensions),
                 :data:`MODULATED_LAYER_NORM` (``torch.native_layer_norm`` without affine
                 parameters, then ``* (1 + scale) + shift`` per sample).
    norm_dims    how many trailing dimensions of ``norm_x`` are normalised.
    norm_eps     the norm's eps.
"""
from __future__ import annotations

from memkern._extension import check_same_in_cpp

NATIVE_LAYER_NORM, LAYER_NORM, RMS_NORM, MODULATED_LAYER_NORM = 1, 2, 3, 4

check_same_in_cpp(__name__, {"NORM_KINDS": {"native_layer_norm": NATIVE_LAYER_NORM,
                                            "layer_norm": LAYER_NORM, "rms_norm": RMS_NORM,
                                            "modulated_layer_norm": MODULATED_LAYER_NORM}})

SCHEMA = ("Tensor? norm_x=None, Tensor? norm_weight=None, Tensor? norm_bias=None, "
          "int norm_kind=0, int norm_dims=0, float norm_eps=0.")
