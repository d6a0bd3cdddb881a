"""Copies between a device and host memory, kept off the compute stream: the one seam between
:mod:`memkern.nn.checkpoint`'s offloading policies and CUDA's streams and events.

:func:`copies_for` gives, for a tensor's device, an object with two methods:

* ``start(dst, src)``: ``dst.copy_(src)``, started after the work queued so far on the current
  stream; returns what :meth:`wait` takes to know it is done.
* ``wait(done)``: the current stream's next work runs after that copy.
* ``let_go(t)``: ``t``, which a started copy may still read or write, is about to be let go
  without the current stream having waited for that copy: its memory is not reused before the
  copies started so far are done.

On a CUDA device the copy runs on a side stream (one per device) and ``done`` is an event; on
any other device (the CPU, and the CPU stand-in of a planned step) it runs at once and ``done`` is
None. A device tensor read or written by a started copy must be kept alive until the current
stream has waited for the copy: the caching allocator may hand a freed block to the current
stream's next allocation, which is safe only once that stream is ordered after the copy.
"""
from __future__ import annotations

import torch

_streams: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream memkern's offloading copies of ``device`` (a CUDA device) run on."""
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


def dense(t: torch.Tensor) -> bool:
    """``t``'s elements exactly fill ``t.numel()`` distinct slots (a permutation of strides)."""
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.size()) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


class _StreamCopies:
    """Copies on the device's side stream, ordered against the current stream by events."""

    def __init__(self, device: torch.device) -> None:
        self.stream = side_stream(device)

    def start(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event:
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        done = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done.record(self.stream)
        return done

    def wait(self, done: torch.cuda.Event | None) -> None:
        if done is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(done)

    def let_go(self, t: torch.Tensor) -> None:
        t.record_stream(self.stream)


class _InlineCopies:
    """Copies that are done when :meth:`start` returns (one stream of work: the CPU's)."""

    @staticmethod
    def start(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    @staticmethod
    def wait(done: None) -> None:
        pass

    @staticmethod
    def let_go(t: torch.Tensor) -> None:
        pass


INLINE = _InlineCopies()


def copies_for(device: torch.device) -> _StreamCopies | _InlineCopies:
    """How copies between ``device`` and host memory run (see the module docstring)."""
    return _StreamCopies(device) if device.type == "cuda" else INLINE
