"""A spy on every read of a tensor's value by the host (the tests of "no host sync")."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostReadSpy(TorchDispatchMode):
    """Records every read of a tensor's value by the host: the aten ops behind item(),
    bool(), float(), int(), equal() (dispatch level: ``item`` itself when C++ code calls
    Tensor::item(), whose ``_local_scalar_dense`` then runs below the mode) and the
    Python-level tensor methods that bypass the dispatcher (tolist, numpy) or copy to the CPU."""

    READS = {"_local_scalar_dense", "item", "equal", "is_nonzero", "allclose"}
    METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")

    def __init__(self, monkeypatch):
        super().__init__()
        self.reads = []
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._spy(name, original))

    def _spy(self, name, original):
        def method(tensor, *args, **kwargs):
            self.reads.append(f"Tensor.{name}")
            return original(tensor, *args, **kwargs)
        return method

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.READS:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))
