"""FSDP2 (``torch.distributed.fsdp.fully_shard``) in torchtitan's unit layout.

One place decides which modules become FSDP2 units, so that ``MemkernTrainer(fsdp2=True)``
trains the layout ``memkern plan --sharding fsdp2`` plans.
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh


def fully_shard_blocks(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """``fully_shard`` on each block of the model's largest ``ModuleList`` (a causal LM's
    decoder layers), then on the model (the embeddings, final norm and output layer), over
    ``mesh``. In place: the parameters become DTensors sharded on dim 0. Patch with
    :func:`memkern.patch` first: it replaces modules, and FSDP2 manages the parameters of the
    modules it was given."""
    from torch.distributed.fsdp import fully_shard

    blocks = max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len,
                 default=[])
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
