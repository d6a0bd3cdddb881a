"""The ``memkern`` torch.library namespace and the one dispatch rule every op follows.

Each op file defines its schema, argument checks, fake (meta) implementation and reference
implementation, and registers them as an :class:`Op`. The schema lives only here in
Python, so the op exists whether or not the C++ extension was built; ``csrc/`` registers
kernels for the ``CPU`` and ``CUDA`` dispatch keys against it. Where a compiled kernel is
missing, the reference (CPU) or the Triton kernel (CUDA) is registered in its place, so
``torch.ops.memkern.<op>`` always runs on both devices.

On a GPU the default eager path never enters Python: in a build with the CUDA kernels every
op's ``CUDA`` key is served by C++ (CUDA C++ kernels, or torch's own kernels called from
C++), so a layer call goes C++ autograd → dispatcher → launch. A kernel registered from
Python costs tens of microseconds of host time per call, which made small layers host-bound.
CI reads the dispatcher's table and fails when a ``CUDA`` kernel comes from a Python file
(tests/test_dispatch_registrations.py).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from memkern import backend
from memkern._extension import compiled
from memkern._fake import fake_mode_active

LIBRARY = torch.library.Library("memkern", "DEF")

COMPOSITE_REFERENCES: dict[torch._ops.OpOverload, Callable[..., Any]] = {}
"""The reference of each op whose compiled kernel is made of other ops (``compiled_kernels=
"composite"``: the linear cross-entropy's loops), by the op: what :mod:`memkern.profile.plan`
runs in the op's place when C++ reaches it through the dispatcher (a layer's node), so that the
plan sees every buffer those ops allocate (the op's fake implementation makes only its outputs)
and the path the planned device takes (the reference follows :func:`memkern.backend.device_type`;
the C++ kernel, the tensors' device)."""


def eager_entry(name: str) -> Callable[..., Any] | None:
    """A layer op's direct entry point from Python, ``memkern._C.<name>`` (None without the
    extension). The entries (each in its layer's csrc/autograd/<layer>.cpp) reach the op through
    a typed dispatcher handle: a ``torch.ops`` call converts every argument to a boxed value
    against the schema, which for a small layer costs more host time than the layer's own
    dispatch. Each also checks in C++ whether the op serves the call, returning None when not
    (the Python path then takes it); eager mode only, as ``torch.compile`` traces
    ``torch.ops``."""
    if not compiled.has_cpu:
        return None
    from memkern import _C
    return getattr(_C, name)


class Op:
    """The Python entry of one op: checks its arguments, then runs the selected backend.

    ``compiled_kernels``: whether ``csrc/`` registers CPU and CUDA kernels for it (True; a
    tuple of device types, e.g. ``("cpu",)``, where it registers only those; the CUDA ones
    exist in a build with the CUDA kernels; ``"composite"``: one C++ implementation for every
    device, made of other ops — the linear cross-entropy's loops); where it does not, the
    reference serves ``CPU`` and the Triton kernel ``CUDA``. ``triton`` is the dotted path
    of the Triton implementation (None: there is none, the reference runs).

    ``backend="cpu"``/``"cuda"`` go through ``torch.ops.memkern.<name>`` (the dispatcher
    picks the kernel by device; ``"cpu"`` calls the reference directly where no compiled CPU
    kernel exists); ``"triton"`` and ``"reference"`` call those implementations
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
        compiled_kernels: bool | str | tuple[str, ...],
    ) -> None:
        self.name = name
        self.check = check
        self.reference = reference
        self._triton_path = triton
        self._triton_fn: Callable[..., Any] | None = None
        LIBRARY.define(name + schema)
        self.op = getattr(torch.ops.memkern, name).default
        torch.library.register_fake(f"memkern::{name}", fake, lib=LIBRARY)
        composite = compiled_kernels == "composite"
        kernels = (("cpu", "cuda") if compiled_kernels is True or composite
                   else tuple(compiled_kernels or ()))
        has_cpu = "cpu" in kernels and compiled.has_cpu
        # The callable of each backend, resolved once (the Python path runs on every call).
        # "planned:<device>": what runs on that device while memkern.profile plans a step on
        # fake tensors: a kernel is its fake implementation (its outputs), a composite op its
        # reference (every op it runs, so its intermediate buffers are seen).
        has_gpu_kernel = not composite and (triton is not None or "cuda" in kernels)
        self._impl = {"triton": self.triton, "reference": reference, "cuda": self.op,
                      "cpu": self.op if has_cpu else reference,
                      "planned:cpu": self.op if has_cpu and not composite else reference,
                      "planned:cuda": self.op if has_gpu_kernel else reference}
        if composite:
            COMPOSITE_REFERENCES[self.op] = reference
        if not has_cpu:
            LIBRARY.impl(name, reference, "CPU")
        # Triton's place on the dispatcher: the CUDA key of an extension built without its CUDA
        # kernels (no CUDA toolkit at install time, or MEMKERN_BUILD_EXT=0). It also runs where
        # a caller forces it (MEMKERN_BACKEND=triton, backend.force), through self._impl, never
        # the dispatcher.
        if not ("cuda" in kernels and compiled.has_cuda):
            LIBRARY.impl(name, self._triton_or_reference, "CUDA")

    @property
    def has_triton(self) -> bool:
        return self._triton_path is not None

    def triton(self, *args: Any) -> Any:
        """The Triton implementation (imports triton on first use); the reference if none. Under
        a ``FakeTensorMode`` (fake CUDA tensors) the registered op: its fake implementation."""
        if self._triton_path is None:
            return self.reference(*args)
        if fake_mode_active():
            return self.op(*args)
        if self._triton_fn is None:
            module, _, attr = self._triton_path.rpartition(".")
            self._triton_fn = getattr(importlib.import_module(module), attr)
        return self._triton_fn(*args)

    def _triton_or_reference(self, *args: Any) -> Any:
        if self.has_triton and backend.runs_on("triton", torch.device("cuda")):
            return self.triton(*args)
        return self.reference(*args)

    def __call__(self, *args: Any) -> Any:
        if torch.compiler.is_compiling():
            return self.op(*args)
        return self._impl[backend.select(self.check(*args))](*args)
