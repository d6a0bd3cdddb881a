"""The ``memkern`` torch.library namespace and the one dispatch rule every op follows.

Each op file defines its schema, argument checks, fake (meta) implementation and reference
implementation, and registers them with :func:`define_op`. The schema lives only here in
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


class FlatOp:
    """The Python entry of one op: checks its arguments, then runs the selected backend.

    ``backend="cpu"``/``"cuda"`` go through ``torch.ops.memkern.<name>`` (the dispatcher
    picks the compiled kernel by device); ``"triton"`` and ``"reference"`` call those
    implementations directly, so forcing a backend works even where a compiled kernel exists.
    """

    def __init__(
        self,
        name: str,
        schema: str,
        *,
        check: Callable[..., torch.device],
        fake: Callable[..., Any],
        reference: Callable[..., Any],
        triton: str,
    ) -> None:
        self.name = name
        self.check = check
        self.reference = reference
        self._triton_path = triton
        LIBRARY.define(name + schema)
        self.op = getattr(torch.ops.memkern, name).default
        torch.library.register_fake(f"memkern::{name}", fake, lib=LIBRARY)
        if not compiled.has_cpu:
            LIBRARY.impl(name, reference, "CPU")
        if not compiled.has_cuda:
            LIBRARY.impl(name, self._triton_or_reference, "CUDA")

    def triton(self, *args: Any) -> Any:
        """The Triton implementation (imports triton on first use)."""
        module, _, attr = self._triton_path.rpartition(".")
        return getattr(importlib.import_module(module), attr)(*args)

    def _triton_or_reference(self, *args: Any) -> Any:
        if backend.runs_on("triton", torch.device("cuda")):
            return self.triton(*args)
        return self.reference(*args)

    def __call__(self, *args: Any) -> Any:
        device = self.check(*args)
        chosen = backend.select(device)
        if chosen == "triton":
            return self.triton(*args)
        if chosen == "reference":
            return self.reference(*args)
        return self.op(*args)
