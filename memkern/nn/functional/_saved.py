"""Saving activations for backward — and not saving the ones that are cheap to recompute.

A memkern norm marks its output as *recomputable*: it records how to rebuild it from tensors
that are saved anyway (its input, its weight and bias). When a memkern layer saves that
output — the Linear or MLP right after the norm saves its input for the weight gradient — it
saves the recipe's tensors instead, which share storage with what the norm already saved,
and rebuilds the normalised output in backward. So no normalised output is ever kept between
forward and backward, by the norm or by its consumer.

The recipe holds only weak references (it never keeps a tensor alive) and the tensors' version
counters; if anything was freed or modified in place since, the consumer saves the output
itself, as it would without this mechanism.

A recipe says which norm (``kind``, one of :mod:`memkern.ops._norm_recipe`'s kinds), over how
many trailing dimensions, with which eps, and ``rebuild(x, weight, bias)`` runs it. A norm on
the C++ path (the extension built, the default backend) leaves a ``memkern._C.NormRecipe``,
which the layers' C++ entry points (csrc/python_entries.cpp) read and pass to their ops as the
``norm_*`` arguments (csrc/autograd/saved_input.h); a norm on the Python path (a forced
backend, no extension) leaves a :class:`_Recipe`, which the GEMM layers' C++ entries do not
read (the layer then saves its input).

Under ``torch.compile`` tensors carry no Python attributes, and the compiler merges a
backward's recomputation with the forward op it repeats (then keeps that op's output). There
the norms, the MLP and SwiGLU run inside :func:`compiled_region` instead: a
selective-checkpoint region (``torch.utils.checkpoint`` with a policy) whose "must recompute"
ops the compiler's partitioner rebuilds in backward rather than saving — what the eager
mechanism does.
"""
from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Collection

import torch
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from memkern._extension import check_same_in_cpp

_ATTR = "_memkern_recipe"
"""The attribute of a norm's output holding its recipe; the C++ entry points set and read it
too (kNormRecipeAttr, csrc/python_entries.h)."""
check_same_in_cpp(__name__, {"NORM_RECIPE_ATTR": _ATTR})


class _Recipe:
    """How to rebuild a norm's output (a plain class with slots: one is made per norm call, and
    a dataclass's construction costs several times as much host time)."""

    __slots__ = ("rebuild", "refs", "versions", "kind", "dims", "eps")

    def __init__(self, rebuild: Callable[..., torch.Tensor], refs: tuple, versions: tuple,
                 kind: int, dims: int, eps: float) -> None:
        self.rebuild = rebuild  # rebuild(x, weight, bias) -> the norm's output
        self.refs = refs  # weak references to the norm's (x, weight, bias); None for an absent one
        self.versions = versions  # their version counters at the norm's call
        self.kind = kind  # memkern.ops._norm_recipe: NATIVE_LAYER_NORM, LAYER_NORM or RMS_NORM
        self.dims = dims  # normalised trailing dimensions
        self.eps = eps

    def tensors(self) -> list[torch.Tensor | None] | None:
        out = []
        for ref, version in zip(self.refs, self.versions):
            if ref is None:
                out.append(None)
                continue
            t = ref()
            if t is None or t._version != version:
                return None
            out.append(t)
        return out


def mark_recomputable(out: torch.Tensor, rebuild: Callable[..., torch.Tensor],
                      tensors: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None], *,
                      kind: int, dims: int, eps: float) -> None:
    """Record that ``out == rebuild(x, weight, bias)`` (bit for bit) for the consumers of
    ``out``, ``rebuild`` being the norm ``kind`` (:mod:`memkern.ops._norm_recipe`) over the last ``dims``
    dimensions of ``x`` with ``eps``."""
    if torch.compiler.is_compiling() or not isinstance(out, torch.Tensor):
        return
    x, weight, bias = tensors  # spelled out: this runs on every norm call
    refs = (weakref.ref(x), None if weight is None else weakref.ref(weight),
            None if bias is None else weakref.ref(bias))
    versions = (x._version, None if weight is None else weight._version,
                None if bias is None else bias._version)
    setattr(out, _ATTR, _Recipe(rebuild, refs, versions, kind, dims, eps))


def has_recipe(t: torch.Tensor) -> bool:
    """Whether ``t`` was marked recomputable (a consumer would save the recipe instead)."""
    return getattr(t, _ATTR, None) is not None


def _policy(recomputed: Collection | None, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if recomputed is None or op in recomputed:
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_SAVE


def compiled_region(fn: Callable[..., torch.Tensor], *args,
                    recomputed: Collection | None = None) -> torch.Tensor:
    """``fn(*args)``; under ``torch.compile``, inside a selective-checkpoint region where the
    ops in ``recomputed`` (``torch.ops`` overloads; None: every op) are recomputed in
    backward instead of saved. Outside compilation it is a plain call."""
    if not torch.compiler.is_compiling():
        return fn(*args)
    context = functools.partial(create_selective_checkpoint_contexts,
                                functools.partial(_policy, recomputed))
    return checkpoint(fn, *args, use_reentrant=False, context_fn=context)
