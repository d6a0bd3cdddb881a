"""DTensor parameters (FSDP2's ``fully_shard``, tensor parallelism) in the fused optimizers.

A DTensor parameter's storage belongs to whoever sharded it (FSDP2 all-gathers from it), so the
optimizer never moves it into a flat buffer: it steps each parameter's local shard in place,
one kernel call per parameter, with the gradient FSDP2 reduce-scattered (``p.grad``, a DTensor
of the parameter's placements). The math is elementwise, so the local shards' update equals
the update of the full tensors. The optimizer state is local shards too, and
``state[p][key]`` presents them as DTensors of ``p``'s mesh and placements, which is what
``torch.distributed.checkpoint`` saves and reshards to another world size.

What needs the ranks to agree: ``found_inf`` (a GradScaler's or a LossScaler's flag), which is
max-reduced over the mesh before the step, so an inf in one rank's shard skips the step on
every rank.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DeviceMesh, DTensor, distribute_tensor

from memkern._fake import local_tensor


def dtensor_mesh(groups: list[dict[str, Any]], owner: str) -> DeviceMesh | None:
    """The one device mesh of the parameters in ``groups`` if they are DTensors, None if none
    is; a ValueError when plain tensors and DTensors are mixed or the DTensors lie on several
    meshes (``owner`` names the optimizer in the message)."""
    params = [p for g in groups for p in g["params"]]
    dtensors = [i for i, p in enumerate(params) if isinstance(p, DTensor)]
    if not dtensors:
        return None
    if len(dtensors) != len(params):
        plain = next(i for i in range(len(params)) if i not in set(dtensors))
        raise ValueError(
            f"memkern.{owner}: params mixes DTensors (e.g. params[{dtensors[0]}]) and plain "
            f"tensors (e.g. params[{plain}]); shard every parameter (fully_shard the root "
            "module too) or none, or give each kind its own optimizer")
    mesh = params[0].device_mesh
    for i in dtensors:
        if params[i].device_mesh != mesh:
            raise ValueError(
                f"memkern.{owner}: params[{i}] lies on device mesh {params[i].device_mesh}, "
                f"params[0] on {mesh}; one optimizer steps the parameters of one mesh: make "
                "one optimizer per mesh")
    return mesh


def local_flat(t: torch.Tensor, what: str) -> torch.Tensor:
    """This rank's elements of ``t`` (a DTensor's local shard, or a plain tensor) as a 1-D view
    of its storage, so that the kernels update it in place. (``DTensor.to_local()`` is an
    autograd op, and this runs per parameter per step: :func:`memkern._fake.local_tensor`
    reads the shard itself.)"""
    local = local_tensor(t)
    if not local.is_contiguous():
        raise ValueError(f"memkern: {what} has a non-contiguous local shard of shape "
                         f"{tuple(local.shape)} and strides {local.stride()}; the fused step "
                         "updates contiguous shards only (FSDP2's Shard(0) shards are)")
    return local.view(-1)


def local_grad(p: DTensor) -> torch.Tensor | None:
    """The local shard of ``p``'s gradient, flat; None if ``p`` has no gradient."""
    grad = p.grad
    if grad is None:
        return None
    if not isinstance(grad, DTensor) or grad.placements != p.placements:
        got = grad.placements if isinstance(grad, DTensor) else "a plain tensor"
        raise ValueError(
            f"memkern: a DTensor parameter with placements {p.placements} has a gradient with "
            f"placements {got}; the step needs gradients sharded like their parameters "
            "(reduce them first, as FSDP2 does in backward)")
    return local_flat(grad, "a parameter's gradient")


def as_dtensor_like(local: torch.Tensor, p: DTensor) -> DTensor:
    """``local`` (``p``'s local shard's elements, any shape) as a DTensor of ``p``'s mesh,
    placements and global shape: a view, no copy and no communication."""
    local_shape = local_tensor(p).shape
    return DTensor.from_local(local.view(local_shape), p.device_mesh, p.placements,
                              run_check=False, shape=p.shape, stride=p.stride())


def local_values(value: torch.Tensor, p: DTensor) -> torch.Tensor:
    """The elements of ``value`` (a saved state tensor of ``p``'s global shape: a DTensor of any
    placements on ``p``'s mesh, or a full plain tensor, the same on every rank) that ``p``'s
    local shard holds, flat."""
    if isinstance(value, DTensor):
        if value.device_mesh != p.device_mesh:
            raise ValueError(
                f"memkern: saved state lies on device mesh {value.device_mesh}, its parameter "
                f"on {p.device_mesh}; load it with torch.distributed.checkpoint, which reshards "
                "it to the parameter's placements")
        local = value.redistribute(p.device_mesh, p.placements).to_local()
    else:
        local = distribute_tensor(value.to(p.device), p.device_mesh, p.placements,
                                  src_data_rank=None).to_local()
    return local.reshape(-1)


def agree_on_found_inf(found_inf: torch.Tensor, mesh: DeviceMesh) -> None:
    """Max-reduces ``found_inf`` in place over every rank of ``mesh``: an inf/NaN seen by any
    rank skips the step on all of them (and, when the caller's scaler reads the same tensor
    afterwards, backs the scale off on all of them)."""
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        if dist.get_world_size(group) > 1:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
