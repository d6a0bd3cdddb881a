"""Copies between a device and host memory, kept off the compute stream: the one seam between
memkern's offloading (:mod:`memkern.nn.checkpoint`'s policies, :mod:`memkern.nn.input_offload`;
the optimizer's host parts, :mod:`memkern.optim.offload` and :mod:`memkern.optim.streamed_grads`)
and CUDA's streams and events. On any device but CUDA (the CPU, and the CPU stand-in of a planned
step) every copy runs at once and there is nothing to wait for, so the same code runs there.

Two kinds of waiting, for two kinds of user:

* :func:`copies_for` (the activations' offloading): a copy started after the work queued so far
  on the current stream, which the *current stream* later waits for (``wait``): the compute
  stream, not the host, is ordered after it. Copies both ways run in order on one side stream
  per device (:func:`side_stream`).
* :class:`Transfers` (the optimizer's host step): copies down whose arrival the *host* waits for
  (a host thread reads what they brought), copies up from any host thread, and :meth:`join`,
  after which the current stream is ordered after both. Down and up run on two streams of
  their own, so a bucket's gradients can come down while another's weights go up.

:func:`copies_for` gives, for a tensor's device, an object with three methods:

* ``start(dst, src)``: ``dst.copy_(src)``, started after the work queued so far on the current
  stream; returns what :meth:`wait` takes to know it is done.
* ``wait(done)``: the current stream's next work runs after that copy.
* ``let_go(t)``: ``t``, which a started copy may still read or write, is about to be let go
  without the current stream having waited for that copy: its memory is not reused before the
  copies started so far are done.

A device tensor read or written by a started copy must be kept alive until the current stream
(or, for :class:`Transfers`, the host) has waited for the copy: the caching allocator may hand a
freed block to the current stream's next allocation, which is safe only once that stream is
ordered after the copy.
"""
from __future__ import annotations

import torch

from memkern import _host

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


class Transfers:
    """Copies between one device and host memory for the optimizer's host parts (see the module
    docstring). ``cuda``: whether ``device`` is a GPU (streams and events); ``pinned``: whether
    the host buffers it copies are pinned (a GPU, or a GPU planned for:
    :func:`memkern._host.pin_for`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.pinned = _host.pin_for(device)
        if self.cuda:
            self.download = torch.cuda.Stream(device)
            self.upload = torch.cuda.Stream(device)

    def down(self, host: torch.Tensor, source: torch.Tensor) -> torch.cuda.Event | None:
        """Copies the device tensor ``source`` into the host tensor ``host``: after the work
        enqueued so far on the current stream; returns the event of its arrival (None: done)."""
        if not self.cuda:
            host.copy_(source)
            return None
        self.download.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.download):
            host.copy_(source, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(self.download)
        return arrived

    def up(self, target: torch.Tensor, host: torch.Tensor) -> torch.cuda.Event | None:
        """Copies the host tensor ``host`` into the device tensor ``target`` (from any thread);
        returns the event of its completion (None: done)."""
        if not self.cuda:
            target.copy_(host)
            return None
        with torch.cuda.stream(self.upload):
            target.copy_(host, non_blocking=True)
            uploaded = torch.cuda.Event()
            uploaded.record(self.upload)
        return uploaded

    @staticmethod
    def wait(event: torch.cuda.Event | None) -> None:
        """Blocks the calling host thread until ``event`` (None: nothing to wait for)."""
        if event is not None:
            event.synchronize()

    def join(self) -> None:
        """The current stream waits for both streams (the next forward reads the weights, the
        next backward writes what the copies read)."""
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.upload)
            current.wait_stream(self.download)
