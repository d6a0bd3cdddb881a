"""memkern's ops, registered with ``torch.library`` in the ``memkern`` namespace
(``torch.ops.memkern.<name>`` is the registered op itself). Two kinds, told apart by name:

* **kernel ops**, named by their kernel (``adamw_step_``, ``norm_forward``, ``dropout``, ...),
  each in its kernel family's file: one Python entry per op
  (:class:`memkern.ops._registry.Op`) checks its arguments and runs the backend chosen by
  :mod:`memkern.backend`. The training front end's are :data:`ALL`, the layers' fused math
  :data:`NN_OPS`.
* **layer ops**, one per layer of :mod:`memkern.nn`, ``<layer>_layer`` in ``<layer>_layer.py``
  (``linear_layer``, ``norm_layer``, ``mlp_layer``, ...): the layer's whole forward as one op
  whose autograd is the C++ node of csrc/autograd/<layer>.cpp; here its schema, its fake
  implementation and its eager entry (``<layer>_layer_entry``). What the GEMM layer ops share:
  ``_gemm_layer.py``.
"""
from memkern.backend import force
from memkern.ops.adamw import adamw_step_
from memkern.ops.adamw8bit import adamw8bit_step_
from memkern.ops.l2_norm import l2_norm
from memkern.ops.sgd import sgd_step_
from memkern.ops.sgd8bit import sgd8bit_step_
from memkern.ops.unscale import unscale_

ALL = (unscale_, l2_norm, adamw_step_, adamw8bit_step_, sgd_step_, sgd8bit_step_)

__all__ = ["ALL", "adamw8bit_step_", "adamw_step_", "force", "l2_norm", "sgd8bit_step_",
           "sgd_step_", "unscale_"]

# The kernel ops behind memkern.nn (the layers' fused math), then the layer ops.
from memkern.ops.activation import act_backward, act_forward  # noqa: E402
from memkern.ops.cross_entropy import cross_entropy_block_grad_, cross_entropy_rows_  # noqa: E402
from memkern.ops.dropout import dropout  # noqa: E402
from memkern.ops.dropout_layer import dropout_layer  # noqa: E402
from memkern.ops.linear_cross_entropy import (  # noqa: E402
           linear_cross_entropy_backward,
           linear_cross_entropy_forward,
)
from memkern.ops.linear_cross_entropy_layer import linear_cross_entropy_layer  # noqa: E402
from memkern.ops.linear_layer import linear_layer  # noqa: E402
from memkern.ops.linear_log_prob_layer import linear_log_prob_layer  # noqa: E402
from memkern.ops.lora_layer import lora_layer  # noqa: E402
from memkern.ops.mlp_layer import mlp_layer  # noqa: E402
from memkern.ops.modulated_norm_layer import modulated_norm_layer  # noqa: E402
from memkern.ops.norm import norm_backward, norm_forward  # noqa: E402
from memkern.ops.norm_layer import norm_layer  # noqa: E402
from memkern.ops.swiglu import swiglu_backward, swiglu_forward  # noqa: E402
from memkern.ops.swiglu_layer import swiglu_layer  # noqa: E402
from memkern.ops.swiglu_unit_layer import swiglu_unit_layer  # noqa: E402

NN_OPS = (act_forward, act_backward, swiglu_forward, swiglu_backward, dropout, norm_forward,
          norm_backward, cross_entropy_rows_, cross_entropy_block_grad_,
          linear_cross_entropy_forward, linear_cross_entropy_backward)
__all__ += ["NN_OPS", "act_backward", "act_forward", "cross_entropy_block_grad_",
            "cross_entropy_rows_", "dropout",
            "dropout_layer", "linear_cross_entropy_backward",
            "linear_cross_entropy_forward", "linear_cross_entropy_layer", "linear_layer",
            "linear_log_prob_layer", "lora_layer",
            "mlp_layer", "modulated_norm_layer",
            "norm_backward", "norm_forward", "norm_layer", "swiglu_backward", "swiglu_forward",
            "swiglu_layer", "swiglu_unit_layer"]
