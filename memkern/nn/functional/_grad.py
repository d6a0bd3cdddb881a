"""The weight gradient of a GEMM, accumulated straight into ``weight.grad`` when that exists.

When the front end's :class:`memkern.GradBuffer` (or a previous micro-batch) has given a weight
a ``.grad`` — a view into one flat buffer — the backward runs ``weight.grad.addmm_(a, b)``
(``beta = 1``): no transient ``dW`` tensor is allocated. The autograd Function then returns a
zero-stride expanded zero as the weight's gradient, so the engine still runs the weight's
``AccumulateGrad`` node — in place, ``grad += 0`` allocates nothing — and everything that
listens for the gradient being ready (``register_post_accumulate_grad_hook``, DDP/front-end
hooks on the node) fires exactly as before. (The layers' C++ autograd, csrc/autograd/
weight_grad.h, returns no gradient at all when no hook watches the node, sparing the engine's
``grad += 0`` pass over the gradient; Python has no way to list a node's hooks, so this path
always returns the zero.)

This is only done when it gives exactly what autograd would: ``.grad`` exists, is a dense
contiguous tensor of the weight's shape and of the GEMM's dtype and device, does not require
grad, the backward is not building a graph (``create_graph``), the weight has no tensor hooks
(``register_hook`` hooks see and may change the gradient before it is accumulated), and the
engine is going to accumulate into ``.grad`` at all (not ``torch.autograd.grad(...)``, not a
``backward(inputs=...)`` that leaves this weight out). Otherwise ``dW = a @ b`` is returned.
"""
from __future__ import annotations

import dataclasses
import functools
import weakref

import torch

from memkern._fake import fake_mode_active


@dataclasses.dataclass(frozen=True)
class GradTarget:
    """What a Function's forward records about a weight so that backward can accumulate into it."""

    param: weakref.ref
    node: object  # the weight's AccumulateGrad node


def grad_target(weight: torch.Tensor | None) -> GradTarget | None:
    """Call in forward; None when accumulation in place is impossible for this weight."""
    if weight is None or torch.compiler.is_compiling():
        return None
    if not (weight.requires_grad and weight.is_leaf):
        return None
    return GradTarget(weakref.ref(weight), torch.autograd.graph.get_gradient_edge(weight).node)


def _engine_accumulates(node: object) -> bool:
    # torch has no public way to ask whether the running backward will execute a given
    # AccumulateGrad node (``torch.utils.checkpoint`` uses this same private query). It raises
    # for leaf nodes while ``torch.autograd.grad`` runs — where nothing is accumulated into
    # ``.grad`` — so an error means "no".
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except (RuntimeError, AttributeError):
        return False


def _accumulable_grad(target: GradTarget | None, a: torch.Tensor) -> torch.Tensor | None:
    if target is None or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    param = target.param()
    if param is None:
        return None
    grad = param.grad
    if (
        grad is None
        or grad.layout != torch.strided
        or grad.requires_grad
        or grad.dtype != a.dtype
        or grad.device != a.device
        or grad.shape != param.shape
        or not grad.is_contiguous()
        or param._backward_hooks  # tensor hooks would see (and may change) the gradient
    ):
        return None
    if not _engine_accumulates(target.node):
        return None
    return grad


def weight_grad(target: GradTarget | None, a: torch.Tensor, b: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """The gradient ``a @ b`` of a weight of dtype ``dtype``, or a zero placeholder once it has
    been added into the weight's existing ``.grad`` (see the module docstring)."""
    grad = _accumulable_grad(target, a)
    if grad is not None:
        grad.addmm_(a, b)
        if fake_mode_active():  # a cached zero would belong to another fake mode
            return torch.zeros((), dtype=dtype, device=grad.device).expand(grad.shape)
        return _zero(dtype, grad.device).expand(grad.shape)
    return torch.mm(a, b).to(dtype)


@functools.cache
def _zero(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One read-only zero per dtype and device (a fresh one would be a fill launch per call)."""
    return torch.zeros((), dtype=dtype, device=device)
