"""Not saving for backward what is cheap to recompute, under ``torch.compile``:
:func:`compiled_region`.

In eager mode the layers do it in C++: a memkern norm's output (and a modulated LayerNorm's,
and SwiGLU's gated unit's) carries a *recipe*, a ``WeakNormRecipe`` (``memkern._C.NormRecipe``)
that the C++ entry points put in its ``_memkern_recipe`` attribute (csrc/autograd/python_entry.h):
how to rebuild it from tensors that are saved anyway. A memkern layer that saves that output —
the Linear or MLP right after the norm saves its input for the weight gradient — saves the
recipe's tensors instead and rebuilds the output in backward (csrc/autograd/saved_input.h). The
recipe holds only weak references and the tensors' version counters; if anything was freed or
modified in place since, the consumer saves the output itself.

Under ``torch.compile`` tensors carry no Python attributes, and the compiler merges a
backward's recomputation with the forward op it repeats (then keeps that op's output). There
the norms, the MLP and SwiGLU run inside :func:`compiled_region` instead: a
selective-checkpoint region (``torch.utils.checkpoint`` with a policy) whose "must recompute"
ops the compiler's partitioner rebuilds in backward rather than saving — what the eager
mechanism does.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Collection

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from memkern._extension import check_same_in_cpp

_ATTR = "_memkern_recipe"
"""The attribute of a norm's output holding its recipe; the C++ entry points set and read it
too (kNormRecipeAttr, csrc/autograd/python_entry.h)."""
check_same_in_cpp(__name__, {"NORM_RECIPE_ATTR": _ATTR})




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
