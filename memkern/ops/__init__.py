"""Every memkern kernel as a ``torch.library`` op in the ``memkern`` namespace.

One Python entry per op checks its arguments and runs the backend chosen by
:mod:`memkern.backend`; ``torch.ops.memkern.<name>`` is the registered op itself.
"""
from memkern.backend import force
from memkern.ops.adamw import adamw_step_
from memkern.ops.l2_norm import l2_norm
from memkern.ops.sgd import sgd_step_
from memkern.ops.unscale import unscale_

ALL = (unscale_, l2_norm, adamw_step_, sgd_step_)

__all__ = ["ALL", "adamw_step_", "force", "l2_norm", "sgd_step_", "unscale_"]
