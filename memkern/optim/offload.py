"""``offload="cpu"``: the optimizer step of :class:`~memkern.optim.ShardedOptimizer` runs on the
CPU, with the float32 master weights, the optimizer state and the step counters in host
memory, updated by the C++ CPU kernels (``memkern.ops.adamw_step_`` / ``sgd_step_`` and their
8-bit forms, on CPU tensors).

When the model is on the CPU already there is nothing to move: the segments read the
gradients and update the weights in place, and only the placement of the state differs from
``offload=None`` (host memory either way). When the model is on a GPU, :class:`HostOffload`
keeps pinned host copies of this rank's slices of the gradients and weights, and moves them
on two CUDA streams of its own: gradients down on one, weights up on the other.

**One process: the step overlaps the backward pass** (:class:`OverlappedHostStep`). During a
window's last backward, each bucket of parameters (a unit of :mod:`memkern.optim.zero`, one
segment) is stepped as soon as its gradients are final::

    GPU compute stream:  backward ... bucket k's grads done | ... bucket k+1's grads done | ...
    download stream:                  D2H grads k            |      D2H grads k+1
    host worker thread:                      CPU step k       |             CPU step k+1
    upload stream:                                 H2D weights k|                   H2D ...
    step():  norm, inf check and clip coefficient on the GPU; then the verdict on every
             bucket; the current stream waits for the last upload (the next forward)

The host steps buckets while the GPU computes the gradients of the earlier layers, so what is
left after backward is the step of the last buckets (the first layers, and the embedding).

**Exact, with clipping, loss scaling and accumulation.** A bucket's step needs the window's
multiplier ``1 / (scale · normaliser) · clip_coef`` and its ``found_inf``, and both depend on
every gradient of the window, which backward has not finished when the first buckets are
ready. The scale and the normaliser are known when the last backward starts (the scale changes
only at a window's end; the normaliser is the window's micro-batch count or item total), the
clip coefficient and the inf check are not. So the buckets that are ready before the verdict
are stepped *speculatively*, with ``clip_coef = 1``, after a copy of their state (masters,
moments or 8-bit codes and absmax, step counter) is kept. At ``step()``:

- the window is finite and was not clipped (``clip_coef`` is exactly 1, so the multiplier is
  bit for bit the one used): the speculative steps are the steps; the copies are dropped;
- an inf/NaN (the window is skipped): each stepped bucket gets its state back from the copy,
  and its weights are rewritten from the restored master (on a GPU, uploaded again): bit for
  bit what they were;
- the window was clipped: each stepped bucket gets its state back and is stepped again with
  the clipped multiplier.

Buckets whose gradients arrive after the verdict (the last ones) are stepped once, exactly,
with no copy. After a clipped window the next window does not speculate (clipping tends to
persist; stepping twice would cost more than waiting): its buckets' gradients still come down
during backward, and their steps run once the verdict is known. Only the window's last
micro-batch overlaps: the earlier ones only accumulate (no step, no copy). With several ranks,
or for a window closed by ``step(force=True)``, the step runs after the verdict, bucket by
bucket with the copies overlapping the other buckets' steps (:meth:`HostOffload.step`).

Costs: host memory for the copies (as much as the state they copy: 12 bytes per parameter with
AdamW, 6 with 8-bit state), and host memory traffic to make them (the state read and written
once more) for the buckets stepped speculatively. Memory per rank on the GPU is the weights
and the gradients and nothing else: 4 bytes per parameter for 16-bit with stage 1,
2 + 2/W with stage 2. The state holds a speculative update from the window's last backward
until its ``step()``: the optimizer's state dict and checkpoints, read in between, first undo
it (the step then runs after the verdict).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from memkern.optim.flat_state import Segment

Update = Callable[[Segment, torch.Tensor | None, torch.Tensor | None], None]
"""``update(segment, grad_multiplier, found_inf)``: one optimizer kernel call on a segment."""


def _use_threads(n: int) -> None:
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


class HostOffload:
    """Pinned host copies of device slices, and the copies between them on two streams.

    Args:
        device_views: per segment, ``(grads, weights)``: this rank's slices of the reduced
            gradients and of the model weights on the GPU (1-D, same length).

    ``grads[i]`` and ``weights[i]`` are the host tensors segment ``i`` is built on: pinned,
    of the device tensors' dtypes. For float32 parameters ``weights[i]`` is the master itself
    (the kernel updates it in place); for 16-bit ones the kernel rewrites it from the master.
    """

    def __init__(self, device_views: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.device_views = device_views
        self.grads = [torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
                      for g, _ in device_views]
        self.weights = [torch.empty(w.shape, dtype=w.dtype, pin_memory=True)
                        for _, w in device_views]
        self.device = device_views[0][1].device
        self.download = torch.cuda.Stream(self.device)
        self.upload = torch.cuda.Stream(self.device)
        # Per segment, the event of its last upload: the host must not rewrite weights[i]
        # before that copy has read it.
        self._uploaded: list[torch.cuda.Event | None] = [None] * len(device_views)
        self._scalars = torch.empty(2, dtype=torch.float32, pin_memory=True)
        self.pull_weights()

    def pull_weights(self) -> None:
        """The device weights into the host copies (waits): before the masters are made from
        them at the first step or load, so weights loaded into the model since count."""
        for (_, device_w), host_w in zip(self.device_views, self.weights):
            host_w.copy_(device_w)

    def fetch(self, host: torch.Tensor, device: torch.Tensor) -> torch.cuda.Event:
        """Copies ``device`` into the pinned ``host`` on the download stream, after the work
        enqueued so far on the current stream; returns the event of its arrival."""
        self.download.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.download):
            host.copy_(device, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(self.download)
        return arrived

    def fetch_grads(self, i: int) -> torch.cuda.Event:
        """Segment ``i``'s gradients down (see :meth:`fetch`)."""
        return self.fetch(self.grads[i], self.device_views[i][0])

    def weights_free(self, i: int) -> None:
        """Waits until the last upload of segment ``i``'s weights has read them."""
        if self._uploaded[i] is not None:
            self._uploaded[i].synchronize()

    def push_weights(self, i: int) -> None:
        """Segment ``i``'s host weights up, on the upload stream (any thread). Its device
        weights must be free: their gradients final, the work that read them done."""
        with torch.cuda.stream(self.upload):
            self.device_views[i][1].copy_(self.weights[i], non_blocking=True)
            uploaded = torch.cuda.Event()
            uploaded.record(self.upload)
        self._uploaded[i] = uploaded

    def join(self) -> None:
        """The current stream waits for both copy streams (the next forward reads the
        weights, the next backward writes the gradients)."""
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.upload)
        current.wait_stream(self.download)

    def step(self, segments: list[Segment], update: Update, grad_multiplier: torch.Tensor,
             found_inf: torch.Tensor) -> None:
        """Runs ``update(segment, grad_multiplier, found_inf)`` on the CPU for every segment,
        with its gradients copied down before and its weights copied up after, each copy
        overlapping the steps of other segments."""
        scalars = self._scalars
        ready = self.fetch(scalars, torch.stack([grad_multiplier.reshape(()).float(),
                                                 found_inf.reshape(()).float()]))
        arrived = [self.fetch_grads(i) for i in range(len(segments))]
        ready.synchronize()
        for i, seg in enumerate(segments):
            arrived[i].synchronize()
            self.weights_free(i)
            update(seg, scalars[0:1], scalars[1:2])
            self.push_weights(i)
        self.join()


class OverlappedHostStep:
    """One process's host steps, started during a window's last backward pass (the module
    docstring has the schedule and why it is exact).

    Args:
        segments: the optimizer's segments (host tensors: the state, and either
            ``host``'s pinned copies or, for a model on the CPU, the flat buffers themselves).
        update: the kernel call of one segment.
        host: the copies to and from a GPU; None for a model on the CPU.

    The calls, per window: :meth:`begin` before the last backward, :meth:`segment_ready` for
    each segment whose gradients are final (any thread: the autograd engine's), :meth:`end`
    after that backward, :meth:`finish` in ``step()``; :meth:`undo` instead, to leave the state
    as it was before the window (a backward that raised, a state dict read mid-window).
    """

    def __init__(self, segments: list[Segment], update: Update, host: HostOffload | None,
                 num_threads: int) -> None:
        self.segments, self.update, self.host = segments, update, host
        self._backups: list[dict[str, torch.Tensor] | None] = [None] * len(segments)
        # One thread runs the host steps in the order their gradients arrived; each step's
        # kernel runs on the intra-op threads (with OpenMP the thread's own team, whose size
        # is the thread's own setting: made the process's).
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="memkern-host-step",
                                          initializer=_use_threads, initargs=(num_threads,))
        self._lock = threading.Lock()
        pinned = host is not None
        self._spec = torch.empty(1, dtype=torch.float32, pin_memory=pinned)
        self._verdict_values = torch.empty(2, dtype=torch.float32, pin_memory=pinned)
        self.active = False
        self.speculate = True
        """Whether the next window steps before the verdict (False after a clipped one)."""

    # ------------------------------------------------------------------------------ window
    def begin(self, unclipped_multiplier: torch.Tensor) -> None:
        """A window's last backward pass starts. ``unclipped_multiplier`` (one element, on the
        gradients' device): the window's multiplier should it not be clipped, the one the
        speculative steps use (when :attr:`speculate`)."""
        self.active = True
        self._speculating = self.speculate
        self._jobs: dict[int, Future] = {}
        self._arrived: dict[int, torch.cuda.Event | None] = {}
        self._speculated: set[int] = set()
        self._verdict: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.host is None:
            self._spec.copy_(unclipped_multiplier.reshape(1))
            self._spec_ready = None
        else:
            self._spec_ready = self.host.fetch(self._spec, unclipped_multiplier.reshape(1))

    def segment_ready(self, i: int) -> None:
        """Segment ``i``'s gradients are final: they start down now (after the work enqueued
        so far), and, when speculating, its step is issued."""
        if not self.active or i in self._arrived:
            return
        self._arrived[i] = self.host.fetch_grads(i) if self.host is not None else None
        if self._speculating:
            self._jobs[i] = self._worker.submit(self._run, i)

    def end(self) -> None:
        """The last backward pass is over: segments whose gradients never came (parameters
        without one) are final too."""
        for i in range(len(self.segments)):
            self.segment_ready(i)

    @torch.no_grad()
    def finish(self, grad_multiplier: torch.Tensor, found_inf: torch.Tensor) -> None:
        """``step()``: the window's verdict (device tensors, computed after backward), then
        every segment settled: the speculative steps kept, undone or redone, the others run;
        the current stream then waits for the uploads."""
        verdict = torch.stack([grad_multiplier.reshape(()).float(),
                               found_inf.reshape(()).float()])
        if self.host is None:
            self._verdict_values.copy_(verdict)
        else:
            self.host.fetch(self._verdict_values, verdict).synchronize()
            self._spec_ready.synchronize()
        multiplier, skip = self._verdict_values[0:1], self._verdict_values[1:2]
        with self._lock:
            self._verdict = (multiplier, skip)
        self._wait_jobs()
        skipped = bool(skip.item() != 0)
        # clip_coef == 1 exactly: the multiplier is the unclipped one, bit for bit
        unclipped = bool(multiplier.eq(self._spec).item())
        for i in range(len(self.segments)):
            if i in self._speculated:
                if skipped or not unclipped:
                    self._restore(i)
                    if not skipped:
                        self._step(i, multiplier)
                    self._push(i)
            elif i not in self._jobs:  # not speculating: every segment is stepped here
                self._exact(i)
        if not skipped:  # an overflow says nothing about clipping
            self.speculate = unclipped
        self._close()

    @torch.no_grad()
    def undo(self) -> None:
        """Puts back the state of every segment stepped speculatively (and its weights), and
        ends the window's overlap: ``step()`` then runs after the verdict."""
        if not self.active:
            return
        with self._lock:
            self._verdict = None
        self._wait_jobs()
        for i in sorted(self._speculated):
            self._restore(i)
            self._push(i)
        self._close()

    # ------------------------------------------------------------------------------- steps
    @torch.no_grad()
    def _run(self, i: int) -> None:
        """Segment ``i``'s job on the worker thread: exactly when the verdict is known by now,
        else speculatively, after keeping a copy of its state."""
        self._await(i)
        with self._lock:
            verdict = self._verdict
        if verdict is not None:
            self._exact(i)
            return
        if self._spec_ready is not None:
            self._spec_ready.synchronize()
        self._backup(i)
        self._speculated.add(i)
        self._step(i, self._spec)
        self._push(i)

    def _exact(self, i: int) -> None:
        """Segment ``i``'s one step after the verdict (none for a skipped window)."""
        multiplier, skip = self._verdict
        self._await(i)
        if skip.item() == 0:
            self._step(i, multiplier)
            self._push(i)

    def _await(self, i: int) -> None:
        """Waits for segment ``i``'s gradients on the host and for its weights to be free."""
        arrived = self._arrived[i]
        if arrived is not None:
            arrived.synchronize()
        if self.host is not None:
            self.host.weights_free(i)

    def _step(self, i: int, multiplier: torch.Tensor) -> None:
        self.update(self.segments[i], multiplier, None)

    def _push(self, i: int) -> None:
        if self.host is not None:
            self.host.push_weights(i)

    def _wait_jobs(self) -> None:
        for job in self._jobs.values():
            job.result()  # re-raises what the worker raised

    def _close(self) -> None:
        if self.host is not None:
            self.host.join()
        self.active = False

    # ---------------------------------------------------------------------- state copies
    @staticmethod
    def _state_tensors(seg: Segment) -> dict[str, torch.Tensor]:
        """What a step writes, but the 16-bit weights (made again from the master)."""
        tensors = {"master": seg.master, "step": seg.step}
        tensors.update({f"state.{k}": t for k, t in seg.state.items() if k != "master_param"})
        for key, (codes, absmax) in seg.quantized_state.items():
            tensors[f"codes.{key}"], tensors[f"absmax.{key}"] = codes, absmax
        return tensors

    def _backup(self, i: int) -> None:
        live = self._state_tensors(self.segments[i])
        backup = self._backups[i]
        if backup is None or backup.keys() != live.keys():
            backup = {k: torch.empty_like(t) for k, t in live.items()}
            self._backups[i] = backup
        for k, t in live.items():
            backup[k].copy_(t)

    def _restore(self, i: int) -> None:
        if self.host is not None:  # the speculative step's upload may still read them
            self.host.weights_free(i)
        seg = self.segments[i]
        for k, t in self._state_tensors(seg).items():
            t.copy_(self._backups[i][k])
        if seg.low_precision:
            seg.weights.copy_(seg.master)
