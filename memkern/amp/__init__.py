"""Mixed precision: loss scaling with the state on the device."""
from memkern.amp.loss_scaler import LossScaler

__all__ = ["LossScaler"]
