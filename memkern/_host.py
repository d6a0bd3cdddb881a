"""Host memory that memkern allocates for offloading, in one place the planner can see.

Offloading keeps things in host memory: the float32 masters and the optimizer state
(``ShardedOptimizer(offload="cpu")``), the window's gradients and host copies of the weights,
blocks' saved inputs. Each such buffer is made by :func:`empty` or :func:`empty_like`, or by
ops run inside :func:`allocating`, which say what it holds and how it is pinned. Tensors that
ops make from these buffers alone (the masters ``host_weights.float()``, the moments
``zeros_like(master)``) are host memory too.

The planner (:mod:`memkern.profile.plan`) runs a training step on fake CPU tensors, so a tensor's
device cannot tell it host memory from the planned GPU's: it reads :func:`current` (the buffer
being made on this thread) and plans the host's memory apart from the device's. (A planned step
runs on one thread: work that a real step hands to worker threads runs on the step's own,
:func:`memkern._fake.thread_pool`.)

What to allocate follows the planned device, how to copy the real one: :func:`pin_for` is true
for a GPU model, and while a step is planned for a GPU on the CPU stand-in, so the planned step
makes the buffers a GPU run makes.

**Pinned memory** (page-locked: what a GPU copies from and to asynchronously) comes in two kinds:

* ``pinned=True``: torch's pinned caching allocator (``pin_memory=True``), which rounds every
  request up to a power of two (up to 2x the bytes: :func:`footprint`) and keeps freed blocks
  cached for requests of the same rounded size;
* ``pinned=True, exact=True``: pageable memory of exactly the requested size, page-locked where
  it is (``cudaHostRegister``) and unlocked when its storage is freed: for large buffers made
  once, where the rounding would cost most.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import torch

from memkern import _fake, backend

HOLDS = ("weights", "gradients", "master weights", "optimizer state", "activations",
         "state copies")
"""What a host buffer holds (the planner's categories for host memory): copies of the 16-bit
weights or gradients (or their window's sums), float32 masters, optimizer state, blocks' saved
inputs, and copies of the optimizer state kept to undo a speculative step."""

KINDS = ("pageable", "pinned", "pinned exact")
"""How a host buffer's memory is taken (see the module docstring)."""

_making = threading.local()


def pin_for(device: torch.device) -> bool:
    """Whether host buffers that a model on ``device`` copies to and from are pinned: for a
    GPU (or a GPU planned for, :func:`memkern.backend.device_type`)."""
    return backend.device_type(device) == "cuda"


def kind(pinned: bool, exact: bool = False) -> str:
    """The :data:`KINDS` entry of a buffer made with these arguments."""
    if exact and not pinned:
        raise ValueError("memkern._host: exact=True goes with pinned=True (pageable memory is "
                         "always its exact size)")
    return "pinned exact" if exact else "pinned" if pinned else "pageable"


def footprint(nbytes: int, kind: str) -> int:
    """Host bytes a buffer of ``nbytes`` of this :data:`KINDS` kind occupies: a "pinned" one
    is a block of torch's pinned caching allocator, the request rounded up to a power of two
    (``CachingHostAllocator::allocate``, default settings); the others, their size."""
    if kind != "pinned" or nbytes == 0:
        return nbytes
    return 1 << (nbytes - 1).bit_length()


def current() -> tuple[str, str] | None:
    """``(kind, holds)`` of the host memory being made on this thread (inside
    :func:`allocating`, :func:`empty` or :func:`empty_like`), or None."""
    return getattr(_making, "what", None)


@contextlib.contextmanager
def allocating(holds: str, *, pinned: bool = False, exact: bool = False) -> Iterator[None]:
    """Inside the block, on this thread, every tensor made is host memory holding ``holds``
    (:data:`HOLDS`), as :func:`empty` makes it (``pinned``/``exact``: the kind it is made as,
    for the planner; the ops inside choose their own ``pin_memory``)."""
    if holds not in HOLDS:
        raise ValueError(f"memkern._host: holds={holds!r}: expected one of {', '.join(HOLDS)}")
    what = (kind(pinned, exact), holds)
    outer = current()
    _making.what = what
    try:
        yield
    finally:
        _making.what = outer


def empty(shape: tuple[int, ...] | torch.Size | int, dtype: torch.dtype, *, pinned: bool,
          holds: str, exact: bool = False) -> torch.Tensor:
    """An uninitialised host tensor holding ``holds`` (:data:`HOLDS`), page-locked when
    ``pinned`` and CUDA is present (without CUDA nothing can be pinned; the planner still plans
    it as pinned); ``exact``: pinned at exactly its size (see the module docstring)."""
    with allocating(holds, pinned=pinned, exact=exact):
        t = torch.empty(shape, dtype=dtype, pin_memory=pinned and not exact and _can_pin())
    if exact and _can_pin():
        _page_lock(t)
    return t


def empty_like(t: torch.Tensor, *, pinned: bool, holds: str,
               exact: bool = False) -> torch.Tensor:
    """:func:`empty` of ``t``'s shape, strides and dtype (a fake ``t``: a fake tensor)."""
    with allocating(holds, pinned=pinned, exact=exact):
        out = torch.empty_like(t, device="cpu",
                               pin_memory=pinned and not exact and _can_pin())
    if exact and _can_pin():
        _page_lock(out)
    return out


def _can_pin() -> bool:
    return torch.cuda.is_available()


def _page_lock(t: torch.Tensor) -> None:
    """Page-locks ``t``'s memory where it is, exactly its bytes, until its storage is freed.
    torch has no public call for it: ``torch.cuda.cudart()`` is the CUDA runtime torch links."""
    storage = t.untyped_storage()
    if storage.nbytes() == 0 or _fake.is_fake(t):
        return
    cudart, ptr = torch.cuda.cudart(), storage.data_ptr()
    status = cudart.cudaHostRegister(ptr, storage.nbytes(), 0)
    if int(status) != 0:
        raise RuntimeError(f"memkern._host: cudaHostRegister of {storage.nbytes()} bytes failed "
                           f"({status}); use pinned=True without exact=True")
    weakref.finalize(storage, cudart.cudaHostUnregister, ptr)
