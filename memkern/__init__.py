"""memkern: memory-efficient training for PyTorch. The public API (contract v1) is re-exported here."""
from memkern import ops
from memkern._extension import compiled
from memkern.backend import backends

__version__ = "0.1.0"

__all__ = ["__version__", "backends", "compiled", "ops"]

# Training front end: flat gradient buffer, loss scaling, fused and sharded optimizers.
from memkern import amp, optim  # noqa: E402
from memkern.amp import LossScaler  # noqa: E402
from memkern.optim import GradBuffer  # noqa: E402

__all__ += ["GradBuffer", "LossScaler", "amp", "optim"]

# Layers (memkern.nn), recompute policies, patching, memory accounting.
from memkern import nn, profile  # noqa: E402
from memkern.nn import checkpoint, patch  # noqa: E402

__all__ += ["checkpoint", "nn", "patch", "profile"]
