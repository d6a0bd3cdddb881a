"""memkern: train bigger models, or bigger batches, on the memory you have.

memkern swaps PyTorch layers for ones that save less for backward and recompute what is
cheap, keeps the gradients in one flat (16-bit if you like) buffer, and folds loss scaling,
clipping and the AdamW/SGD update into one fused step, sharded across processes (ZeRO-1/2)
or offloaded to the CPU. Quick start:

    model = memkern.patch(model)
    opt = memkern.optim.ShardedOptimizer(model.parameters(), "adamw", lr=3e-4)
    opt.backward(loss); opt.step(); opt.zero_grad()

With Hugging Face: ``memkern.integrations.transformers.MemkernTrainer`` in place of
``Trainer``. The public API is re-exported here; the documentation is in ``docs/`` of the
repository (``docs/index.md``), and ``memkern --help`` lists the command-line tools.
"""
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
from memkern.profile.fit import FitReport, MemoryBudgetError, fit  # noqa: E402

__all__ += ["FitReport", "MemoryBudgetError", "checkpoint", "fit", "nn", "patch", "profile"]
