"""Copies between the model's device and host memory, on side streams: the one place where the
optimizer front end's host parts (:mod:`memkern.optim.offload`, :mod:`memkern.optim.streamed_grads`)
touch CUDA streams and events.

On a GPU a copy down (device to host) runs on the download stream after the work enqueued so
far on the current stream, a copy up on the upload stream, both ``non_blocking`` into or from
pinned memory, and each returns the CUDA event of its completion. For a model on the CPU the
same calls copy at once and return None, so every other line of those parts runs unchanged on
a CPU (which is how the tests exercise them). :class:`HostWorker` is the host thread that waits
for copies down and works on what they brought.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from memkern import _fake, _host


class Transfers:
    """The side streams of one device. ``cuda``: whether ``device`` is a GPU; ``pinned``:
    whether the host buffers it copies are pinned (a GPU, or a GPU planned for:
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
        """The current stream waits for both side streams (the next forward reads the
        weights, the next backward writes what the copies read)."""
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.upload)
            current.wait_stream(self.download)


class HostWorker:
    """One host thread running jobs in the order they were submitted (``name``: the thread's
    name prefix). Under a fake tensor mode (the planner's), whose state is not thread-safe,
    each job runs at once on the submitting thread instead."""

    def __init__(self, name: str) -> None:
        self._pool = (None if _fake.fake_mode_active()
                      else ThreadPoolExecutor(1, thread_name_prefix=name))

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        if self._pool is not None:
            return self._pool.submit(fn, *args)
        done: Future = Future()
        try:
            done.set_result(fn(*args))
        except BaseException as e:  # handed to the caller, as the thread's would be
            done.set_exception(e)
        return done
