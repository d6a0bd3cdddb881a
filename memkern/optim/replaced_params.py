"""Notices a parameter that an optimizer was built with being replaced in its module.

``module.weight = nn.Parameter(...)``, ``model.fc = nn.Linear(...)`` or
``model.load_state_dict(sd, assign=True)`` after the optimizer was built leave the optimizer
holding a parameter the model no longer uses: it would step the old one and never the new one,
silently. torch calls its global registration hooks on every such assignment, before the module
changes; :class:`ReplacementWatch` listens there and notes the slot, and the step checks
the slots noted, whether they hold their parameters again (a slot swapped and put back is no
replacement). Nothing per parameter per step: a few dictionary lookups per assignment anywhere
in the process, a walk of the replaced submodule's parameters, and at the step one of each
noted slot's occupant.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)


class ReplacementWatch:
    """Watches for any of ``params`` being replaced in a module; :meth:`replaced` says which
    and how (None if none is). Watches as long as it lives."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self._numbers = {id(p): i for i, p in enumerate(params)}
        # (module, attribute) -> (what it held first, the watched parameters in it, "=" text):
        # a slot's first occupant only, so a slot swapped on every forward and put back
        # (memkern.patch's fused head + loss) is one entry, and nothing when put back.
        self._slots: dict[tuple[int, str], tuple] = {}
        _install_hooks()
        _WATCHES.add(self)

    def _assigned(self, module: torch.nn.Module, name: str, old, new) -> None:
        """A hook: ``module.name = new`` is about to replace ``old``."""
        if old is None or new is old or (id(module), name) in self._slots:
            return
        watched = [p for p in _parameters_of(old) if id(p) in self._numbers]
        if watched:
            assignment = (f"{type(module).__name__}.{name} = " + (
                "..." if isinstance(old, torch.Tensor) else f"{type(new).__name__}(...)"))
            self._slots[id(module), name] = (module, name, old, watched, assignment)

    def replaced(self) -> str | None:
        """What replaced a watched parameter, if one is replaced now (a slot whose occupant
        holds every watched parameter its first occupant held is as built)."""
        for key, (module, name, old, watched, assignment) in list(self._slots.items()):
            now = module._parameters.get(name) if isinstance(old, torch.Tensor) \
                else module._modules.get(name)
            held = {id(p) for p in _parameters_of(now)}
            lost = [p for p in watched if id(p) not in held]
            if not lost:
                del self._slots[key]
                continue
            p = lost[0]
            return (f"a parameter of shape {tuple(p.shape)} ({p.dtype}, number "
                    f"{self._numbers[id(p)]} in the flat layout) was replaced in its module "
                    f"({assignment}) after the optimizer was built")
        return None


_WATCHES: weakref.WeakSet[ReplacementWatch] = weakref.WeakSet()
_installed = False


def _install_hooks() -> None:
    """torch's two global hooks, once per process, for every live watch. (Never removed: a
    removal while torch iterates over its hooks, as a watch collected during an assignment
    would make, is an error.)"""
    global _installed
    if _installed:
        return
    _installed = True
    register_module_parameter_registration_hook(
        lambda module, name, param: _notify(module, name, module._parameters.get(name), param))
    register_module_module_registration_hook(
        lambda module, name, submodule: _notify(module, name, module._modules.get(name),
                                                submodule))


def _notify(module: torch.nn.Module, name: str, old, new) -> None:
    for watch in list(_WATCHES):
        watch._assigned(module, name, old, new)


def _parameters_of(occupant) -> list[torch.Tensor]:
    """The parameters a module slot's occupant holds: a parameter, a module's, or none."""
    if occupant is None:
        return []
    return [occupant] if isinstance(occupant, torch.Tensor) else list(occupant.parameters())
