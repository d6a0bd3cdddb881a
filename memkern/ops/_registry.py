"""The ``memkern`` torch.library namespace and the one dispatch rule every op follows.

Each op file defines its schema, argument checks, fake (meta) implementation and reference
implementation, and registers them as an :class:`Op`. The schema lives only here in
Python, so the op exists whether or not the C++ extension was built; ``csrc/`` registers
kernels for the ``CPU`` and ``CUDA`` dispatch keys against it. Where a compiled kernel is
missing, the reference (CPU) or the Triton kernel (CUDA) is registered in its place, so
``torch.ops.memkern.<op>`` always runs on both devices.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from memkern import backend
from memkern._extension import compiled

LIBRARY = torch.library.Library("memkern", "DEF")


class Op:
    """The Python entry of one op: checks its arguments, then runs the selected backend.

    ``compiled_kernels``: whether ``csrc/`` registers CPU/CUDA kernels for it (the flat-buffer
    ops); otherwise the reference serves ``CPU`` and the Triton kernel ``CUDA``. ``triton`` is
    the dotted path of the Triton implementation (None: there is none, the reference runs).

    ``backend="cpu"``/``"cuda"`` go through ``torch.ops.memkern.<name>`` (the dispatcher
    picks the kernel by device); ``"triton"`` and ``"reference"`` call those implementations
    directly, so forcing a backend works even where a compiled kernel exists. Under
    ``torch.compile`` the registered op is called, one opaque node described by its fake.
    """

    def __init__(
        self,
        name: str,
        schema: str,
        *,
        check: Callable[..., torch.device],
        fake: Callable[..., Any],
        reference: Callable[..., Any],
        triton: str | None,
        compiled_kernels: bool,
    ) -> None:
        self.name = name
        self.check = check
        self.reference = reference
        self._triton_path = triton
        LIBRARY.define(name + schema)
        self.op = getattr(torch.ops.memkern, name).default
        torch.library.register_fake(f"memkern::{name}", fake, lib=LIBRARY)
        if not (compiled_kernels and compiled.has_cpu):
            LIBRARY.impl(name, reference, "CPU")
        if not (compiled_kernels and compiled.has_cuda):
            LIBRARY.impl(name, self._triton_or_reference, "CUDA")

    @property
    def has_triton(self) -> bool:
        return self._triton_path is not None

    def triton(self, *args: Any) -> Any:
        """The Triton implementation (imports triton on first use); the reference if none."""
        if self._triton_path is None:
            return self.reference(*args)
        module, _, attr = self._triton_path.rpartition(".")
        return getattr(importlib.import_module(module), attr)(*args)

    def _triton_or_reference(self, *args: Any) -> Any:
        if self.has_triton and backend.runs_on("triton", torch.device("cuda")):
            return self.triton(*args)
        return self.reference(*args)

    def __call__(self, *args: Any) -> Any:
        if torch.compiler.is_compiling():
            return self.op(*args)
        device = self.check(*args)
        chosen = backend.select(device)
        if chosen == "triton":
            return self.triton(*args)
        if chosen == "reference":
            return self.reference(*args)
        return self.op(*args)
