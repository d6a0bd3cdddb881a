"""Host memory of the optimizer front end: every tensor a part of
:class:`~memkern.optim.ShardedOptimizer` keeps in host memory for a model on a GPU (``offload``'s
and ``gradients="host"``'s copies, masters, optimizer state, the window's gradient sums, pinned
staging buffers) is created inside :func:`allocating`, most through :func:`empty`.

That is the one place where host memory is made, and the seam through which a tool tells it
from device memory: while planning, the model's "device" is the CPU too (the planner runs on
fake CPU tensors as a stand-in for a GPU), so only the call site says what is host memory.
:func:`observe` registers a context-manager factory that is entered around every such
allocation (the planner counts what is created inside it as host memory).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

Scope = Callable[[], contextlib.AbstractContextManager]
"""A context-manager factory entered around each host allocation (see :func:`observe`)."""

_scopes: list[Scope] = []


def observe(scope: Scope) -> Callable[[], None]:
    """Enters ``scope()`` around every host allocation from now on; returns the function that
    stops it."""
    _scopes.append(scope)
    return lambda: _scopes.remove(scope)


@contextlib.contextmanager
def allocating() -> Iterator[None]:
    """Tensors created inside are host memory (the observers' scopes are entered)."""
    with contextlib.ExitStack() as stack:
        for scope in list(_scopes):
            stack.enter_context(scope())
        yield


def empty(numel: int, dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
    """A 1-D host tensor of ``numel`` elements, page-locked when ``pinned`` (what copies to and
    from a GPU on a side stream need; only when a GPU is used: pinning needs the CUDA
    driver). Its values are undefined."""
    with allocating():
        return torch.empty(numel, dtype=dtype, pin_memory=pinned)
