"""memkern._host: the one home of the host memory that offloading allocates.

Oracles: torch's pinned caching allocator's rule worked out by hand (a request rounded up to the
next power of two: ``CachingHostAllocator::allocate``, ``c10::llvm::PowerOf2Ceil``); the tensors
themselves (shape, dtype, device, whether they are pinned); what a thread sees of another's
allocation.
"""
from __future__ import annotations

import threading

import pytest
import torch

from memkern import _fake, _host, backend


@pytest.mark.parametrize("nbytes,rounded", [(0, 0), (1, 1), (3, 4), (4096, 4096), (4097, 8192),
                                            (25 << 20, 32 << 20), ((1 << 30) + 1, 2 << 30)])
def test_pinned_footprint_is_the_next_power_of_two_and_the_others_exact(nbytes, rounded):
    assert _host.footprint(nbytes, "pinned") == rounded
    assert _host.footprint(nbytes, "pageable") == nbytes
    assert _host.footprint(nbytes, "pinned exact") == nbytes


def test_kind_of_the_arguments():
    assert _host.kind(False) == "pageable"
    assert _host.kind(True) == "pinned"
    assert _host.kind(True, exact=True) == "pinned exact"
    with pytest.raises(ValueError, match="exact=True goes with pinned=True"):
        _host.kind(False, exact=True)


def test_empty_says_what_it_makes_while_it_makes_it_and_only_then():
    seen = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((func.__name__, _host.current()))
            return func(*args, **(kwargs or {}))

    with Spy():
        t = _host.empty((3, 5), torch.bfloat16, pinned=True, holds="gradients")
        u = _host.empty_like(t, pinned=False, holds="state copies")
        v = torch.empty(2)
    assert seen == [("empty.memory_format", ("pinned", "gradients")),
                    ("empty_like.default", ("pageable", "state copies")),
                    ("empty.memory_format", None)]
    assert t.shape == u.shape == (3, 5) and t.dtype == u.dtype == torch.bfloat16
    assert t.device.type == u.device.type == v.device.type == "cpu"
    assert t.is_pinned() == torch.cuda.is_available()  # nothing can be pinned without CUDA
    assert _host.current() is None


def test_allocating_nests_and_is_this_threads_alone():
    other = []
    with _host.allocating("activations", pinned=True, exact=True):
        assert _host.current() == ("pinned exact", "activations")
        with _host.allocating("master weights"):
            assert _host.current() == ("pageable", "master weights")
        assert _host.current() == ("pinned exact", "activations")
        worker = threading.Thread(target=lambda: other.append(_host.current()))
        worker.start()
        worker.join()
    assert other == [None] and _host.current() is None


def test_bad_holds_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="holds='moments'.*optimizer state"):
        _host.empty(4, torch.float32, pinned=False, holds="moments")
    assert _host.current() is None


def test_pin_for_follows_the_planned_device():
    assert not _host.pin_for(torch.device("cpu"))
    with backend.planning_for("cuda"):
        assert _host.pin_for(torch.device("cpu"))  # the CPU stand-in of a planned GPU
    with backend.planning_for("cpu"):
        assert not _host.pin_for(torch.device("cpu"))


def test_empty_like_of_a_fake_tensor_is_fake_and_exact_pins_nothing_there():
    with _fake.fake_mode():
        t = torch.empty(7, 3)
        u = _host.empty_like(t, pinned=True, holds="activations", exact=True)
        w = _host.empty(11, torch.float32, pinned=True, holds="weights", exact=True)
    assert _fake.is_fake(u) and _fake.is_fake(w) and u.shape == (7, 3) and w.shape == (11,)


@pytest.mark.cuda
def test_exact_pinned_memory_is_page_locked_and_copies_asynchronously():
    t = _host.empty(1000, torch.float32, pinned=True, holds="activations", exact=True)
    assert t.is_pinned()
    t.copy_(torch.arange(1000.0))
    on_gpu = t.to("cuda", non_blocking=True)
    back = _host.empty_like(t, pinned=True, holds="activations", exact=True)
    back.copy_(on_gpu, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, torch.arange(1000.0))
