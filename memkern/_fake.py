"""Fake tensors: the private torch APIs memkern uses to run without data, in one place.

memkern runs under ``torch._subclasses.FakeTensorMode`` (tensors with shapes, dtypes and
devices but no storage, every op answered by its meta/fake implementation) so that a training
step can be measured without computing it (:mod:`memkern.profile.plan`). torch exposes fake
tensors only under ``torch._subclasses``, and the active dispatch modes and the running
autograd node only through ``torch._C``; they are wrapped here, with a comment where torch's
own behaviour is worked around, so that a change in a torch release is fixed here alone.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools

import torch


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` carries no data: a fake tensor, or a tensor on the meta device."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return t.device.type == "meta" or _is_fake(t)


def fake_mode_active() -> bool:
    """Whether a ``FakeTensorMode`` is on the dispatch mode stack (every new tensor is fake)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def current_autograd_node():
    """The autograd node whose backward is running on this thread, or None (outside backward).
    torch has no public query; ``torch._C._current_autograd_node`` is what its own tools read."""
    return torch._C._current_autograd_node()


def autograd_node_key(node) -> tuple[str, int]:
    """Which autograd node ``node`` is, without keeping it alive (a reference to a running node
    would keep its saved tensors): its name and torch's sequence number, unique among the nodes
    one thread records. ``Node._sequence_nr`` is private; torch's profiler reads it."""
    return node.name(), node._sequence_nr()


def fake_mode():
    """A new ``FakeTensorMode`` (a context manager) in which models can be built and cast.

    torch's fake mode remembers, through a weak reference, the fake tensor it made for each
    meta tensor, so that converting one real tensor twice gives one fake tensor. It does so
    for every op's output too, and ``Module.to(dtype)`` on fake parameters swaps tensors
    (``torch.utils.swap_tensors``), which refuses a tensor that has a weak reference: a model
    built in fake mode could not be cast. For an op's output the memo would only map the
    result back to an input the op returned unchanged, which autograd's in-place and ``out=``
    kernels never read (they return their input themselves); so this mode memoizes only the
    real tensors it converts (constants it folds), and the fake tensors made inside it have
    no weak references.

    A data-dependent scalar read (``.item()``, ``bool(t)``: ``aten._local_scalar_dense``) of a
    fake tensor has no value to read (but for constants the mode follows, such as
    ``torch.optim``'s step counters); torch's fake mode raises. This one reads 0 (``False``,
    ``0``, ``0.0``), on every thread (a fake tensor dispatches to its own mode, even on a thread
    whose mode stack does not hold it): a planned step takes the branch a zero takes, which
    memkern's code makes the common case (``found_inf`` 0: the step runs).
    """
    mode = _zero_scalars_fake_mode()()
    mode.fake_tensor_converter.set_tensor_memo = lambda tensor, fake: None
    return mode


@functools.cache
def _zero_scalars_fake_mode() -> type:
    """:func:`fake_mode`'s class (made on first use: importing ``torch._subclasses`` is slow)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    class ZeroScalarsFakeMode(FakeTensorMode):
        def dispatch(self, func, types, args=(), kwargs=None):
            try:
                return super().dispatch(func, types, args, kwargs)
            except DataDependentOutputException:
                # a scalar it does not know (it knows constants': torch.optim's step counters)
                if func is not torch.ops.aten._local_scalar_dense.default:
                    raise
                dtype = args[0].dtype
                return (False if dtype is torch.bool else
                        0.0 if dtype.is_floating_point or dtype.is_complex else 0)

    return ZeroScalarsFakeMode


class _OnTheCallersThread(concurrent.futures.Executor):
    """An executor that runs each job at once, on the thread that submits it."""

    def submit(self, fn, /, *args, **kwargs):
        done = concurrent.futures.Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # the job's error, re-raised by result() as a pool's is
            done.set_exception(exc)
        return done


def thread_pool(like: torch.Tensor, max_workers: int, **kwargs) -> concurrent.futures.Executor:
    """``ThreadPoolExecutor(max_workers, **kwargs)`` for jobs on tensors like ``like``; for fake
    tensors an executor that runs each job at once on the submitting thread. torch's fake mode
    is not thread-safe (its ``in_kernel_invocation`` flag is one for all threads: a fake op on
    another thread while one runs here fails), and a planned step's dispatch modes see only
    its own thread's ops."""
    if is_fake(like):
        return _OnTheCallersThread()
    return concurrent.futures.ThreadPoolExecutor(max_workers, **kwargs)


def without_dispatch_modes():
    """A context manager under which no dispatch mode is active (fake or any other): real
    tensors and real kernels, unseen by the modes of the code around it. For the planner's
    measurements of a CPU library's scratch; torch has this only in
    ``torch.utils._python_dispatch``."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """What holds ``t``'s memory on this rank: a DTensor's local shard (FSDP2's parameters,
    their gradients and optimizer state), else ``t``. ``DTensor.to_local()`` is an autograd
    op, which a dispatch mode recording ops would see; its ``_local_tensor`` is the shard."""
    return getattr(t, "_local_tensor", t)


@contextlib.contextmanager
def fake_process_group(world_size: int):
    """``torch.distributed`` initialised as rank 0 of ``world_size`` ranks of torch's "fake"
    backend: collectives return at once and move no data (an all-gather copies this rank's
    input to every output), so one process can run what each rank of a sharded training step
    runs (:func:`memkern.profile.plan_training_step`'s ``world_size``). torch has this backend
    only among its test utilities (``torch.testing._internal.distributed.fake_pg``, importing
    which registers it). Destroyed on exit."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("memkern: planning for several ranks needs a process of its own: "
                           "torch.distributed is already initialised here")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()

_DATA = "_memkern_data"


def _active_fake_mode(caller: str):
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    if mode is None:
        raise RuntimeError(f"memkern._fake.{caller} makes a fake tensor of the active fake mode, "
                           "and none is active: call it while planning (inside a "
                           "FakeTensorMode, e.g. within memkern.profile.plan_training_step)")
    return mode


def fake_with_data(real: torch.Tensor) -> torch.Tensor:
    """A fake tensor of the active fake mode standing for ``real``, which it keeps
    (:func:`data_of`): for what a planned step must compute from data, a shape that depends on
    values (the labelled rows of a masked-LM batch). torch has no public query of the active fake
    mode."""
    fake = _active_fake_mode("fake_with_data").from_tensor(real)
    setattr(fake, _DATA, real)
    return fake


def data_of(t: torch.Tensor) -> torch.Tensor | None:
    """The real tensor a :func:`fake_with_data` tensor stands for (None for any other)."""
    return getattr(t, _DATA, None)


def computed_on_host(fn, *args):
    """``fn(*args)`` on real tensors with no dispatch mode active, its result turned into a fake
    tensor of the active fake mode."""
    with without_dispatch_modes():
        out = fn(*args)
    return _active_fake_mode("computed_on_host").from_tensor(out)
