"""Autocast as memkern's layers read it: whether autocast is on, and the dtype a GEMM layer
computes in (with the error for mixed dtypes without autocast)."""
from __future__ import annotations

import functools

import torch


@functools.cache
def _autocast_available(device_type: str) -> bool:
    return torch.amp.is_autocast_available(device_type)


def autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled(device_type)``, False for a device type autocast does not
    know (the meta device: torch raises there)."""
    if torch.compiler.is_compiling():
        # Dynamo on torch 2.11 cannot trace torch._C._is_autocast_available (a graph break in
        # every layer: memkern-full+compile 3.6x slower on an H200), and what it compiles
        # runs on CUDA or CPU tensors, whose autocast torch knows.
        return torch.is_autocast_enabled(device_type)
    return _autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def compute_dtype(x: torch.Tensor, *params: torch.Tensor | None) -> torch.dtype:
    """The dtype a GEMM layer computes in: autocast's when it is on for ``x``'s device, else
    ``x``'s own (which its parameters must then share, as for ``nn.Linear``)."""
    device_type = x.device.type
    if autocast_enabled(device_type) and x.is_floating_point():
        return torch.get_autocast_dtype(device_type)
    for p in params:
        if p is not None and p.dtype != x.dtype:
            raise RuntimeError(
                f"memkern: input has dtype {x.dtype} but a parameter has {p.dtype}; cast the "
                "module (module.to(dtype)) or the input, or run under torch.autocast"
            )
    return x.dtype
