"""Registration and dispatch of the ops behind :mod:`memkern.nn` (the layers' fused math).

These ops follow the same rule as the flat-buffer ops (:mod:`memkern.ops._registry`): the schema
is defined here in Python in the ``memkern`` namespace, with a fake (meta) implementation and
a reference implementation in plain torch. No C++ kernel is built for them, so the reference
is always the ``CPU`` kernel, and the ``CUDA`` kernel is the Triton one (the reference where
``triton`` is missing).

:class:`NNOp` is the Python entry: it checks the arguments (errors name the argument, what was
wrong and what to do), then runs the backend :func:`memkern.backend.select` picks, so
``memkern.ops.force("triton")`` runs the Triton kernels on CPU tensors under
``TRITON_INTERPRET=1``. Under ``torch.compile`` the entry calls the registered op itself, which
the compiler treats as one opaque node with the fake implementation giving its output metadata.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from memkern import backend
from memkern.ops._registry import LIBRARY

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# float64 is accepted so that the reference implementation can serve as a float64 oracle.
ORACLE_DTYPES = FLOAT_DTYPES + (torch.float64,)


class NNOp:
    """One op of :mod:`memkern.nn`: schema, fake, reference and (optionally) Triton kernel."""

    def __init__(
        self,
        name: str,
        schema: str,
        *,
        check: Callable[..., torch.device],
        fake: Callable[..., Any],
        reference: Callable[..., Any],
        triton: str | None,
    ) -> None:
        self.name = name
        self.check = check
        self.reference = reference
        self._triton_path = triton
        LIBRARY.define(name + schema)
        self.op = getattr(torch.ops.memkern, name).default
        torch.library.register_fake(f"memkern::{name}", fake, lib=LIBRARY)
        LIBRARY.impl(name, reference, "CPU")
        LIBRARY.impl(name, self._cuda, "CUDA")

    @property
    def has_triton(self) -> bool:
        return self._triton_path is not None

    def triton(self, *args: Any) -> Any:
        """The Triton implementation (imports triton on first use)."""
        if self._triton_path is None:
            return self.reference(*args)
        module, _, attr = self._triton_path.rpartition(".")
        return getattr(importlib.import_module(module), attr)(*args)

    def _cuda(self, *args: Any) -> Any:
        if self._triton_path is not None and backend.runs_on("triton", torch.device("cuda")):
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


# ----------------------------------------------------------------------------------------------
# argument checks shared by the nn ops


def tensor(op: str, name: str, t: Any, dtypes: tuple[torch.dtype, ...] = ORACLE_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"memkern.ops.{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(
            f"memkern.ops.{op}: {name} has dtype {t.dtype}; expected one of "
            f"{', '.join(str(d) for d in dtypes)} (cast it with .to(...))"
        )
    if not t.is_contiguous():
        raise ValueError(
            f"memkern.ops.{op}: {name} must be contiguous (shape {tuple(t.shape)}, strides "
            f"{t.stride()}); pass {name}.contiguous()"
        )


def same_device(op: str, name: str, t: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    if t.device != like.device:
        raise ValueError(
            f"memkern.ops.{op}: {name} is on {t.device} but {like_name} is on {like.device}; "
            "move them to one device"
        )


def same_shape(op: str, name: str, t: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    if t.shape != like.shape:
        raise ValueError(
            f"memkern.ops.{op}: {name} has shape {tuple(t.shape)} but {like_name} has "
            f"{tuple(like.shape)}; they must match"
        )


def same_dtype(op: str, name: str, t: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    if t.dtype != like.dtype:
        raise TypeError(
            f"memkern.ops.{op}: {name} has dtype {t.dtype} but {like_name} has {like.dtype}; "
            "they must match"
        )


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the math runs in: float32 for 16-bit inputs, the input's own otherwise."""
    return torch.promote_types(dtype, torch.float32)
