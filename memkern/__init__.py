"""memkern: memory-efficient training for PyTorch. The public API (contract v1) is re-exported here."""
from memkern import ops
from memkern._extension import compiled
from memkern.backends import backends

__version__ = "0.1.0"

__all__ = ["__version__", "backends", "compiled", "ops"]
