"""How the optimizers hold their ``torch.distributed`` process group: weakly, so that
``destroy_process_group()`` frees it.

A process group freed while the interpreter still runs joins gloo's worker threads. One that
outlives ``destroy_process_group()`` keeps them running into the interpreter's finalization,
where a worker that drops a finished collective's tensors a moment late asks for the GIL and
Python ends the thread inside a ``noexcept`` destructor: ``std::terminate``, SIGABRT, a
finished run reported as failed (docs/reliability.md, "A finished run does not die at exit").
So no memkern object keeps the group alive: an optimizer lives until the garbage collector
or the interpreter's end frees it (a module-level ``opt``, a reference cycle), which is
after ``destroy_process_group()``.

The group is registered with ``torch.distributed`` until ``destroy_process_group()``
(:func:`~memkern.optim.sharded._group_and_rank` takes no other), so a weak reference reaches
it for as long as collectives can run on it.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch.distributed as dist

if dist.is_available():
    # torch.distributed.nn.functional binds the default group into its functions' default
    # arguments (group=group.WORLD) when it is first imported, and torch imports it lazily:
    # the first torch.optim.Optimizer built imports torch._dynamo, which imports it. Imported
    # after init_process_group, it keeps the group alive past destroy_process_group() (ten
    # references); imported here, with memkern, before it, it binds None.
    import torch.distributed.nn.functional  # noqa: F401


class WeakGroup:
    """An attribute holding a process group (or None) weakly: reading it after the group was
    destroyed and freed raises a RuntimeError naming ``owner``'s attribute.

    ``class Shards: group = WeakGroup("memkern.ShardedOptimizer")`` then ``self.group = g``.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner

    def __set_name__(self, cls: type, name: str) -> None:
        self.name, self.slot = name, f"_{name}_ref"

    def __set__(self, obj: Any, group: Any) -> None:
        obj.__dict__[self.slot] = None if group is None else weakref.ref(group)

    def __get__(self, obj: Any, cls: type | None = None) -> Any:
        if obj is None:
            return self
        ref = obj.__dict__[self.slot]
        if ref is None:
            return None
        group = ref()
        if group is None:
            raise RuntimeError(
                f"{self.owner}: its process group was destroyed "
                "(torch.distributed.destroy_process_group()); it cannot run collectives any "
                "more: build a new optimizer on a live group")
        return group
