"""A model's repeated blocks: what :func:`memkern.fit` chooses a recomputation for, and what
``memkern plan --checkpoint`` checkpoints."""
from __future__ import annotations

from torch import nn


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers of the model's largest ``nn.ModuleList`` whose members share one class."""
    best: list[tuple[str, nn.Module]] = []
    best_params = -1
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(m) for m in module}) != 1:
            continue
        params = sum(p.numel() for p in module.parameters())
        if params > best_params:
            best_params = params
            best = [(f"{name}.{i}" if name else str(i), m) for i, m in enumerate(module)]
    if not best:
        raise ValueError("memkern.fit: the model has no nn.ModuleList of repeated blocks; pass "
                         "blocks=[...] (the modules to choose a recomputation for)")
    return best
