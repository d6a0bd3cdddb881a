"""``offload="cpu"`` (and ``gradients="host"``): the optimizer step of
:class:`~memkern.optim.ShardedOptimizer` runs on the CPU, with the float32 master weights, the
optimizer state and the step counters in host memory, updated by the C++ CPU kernels
(``memkern.ops.adamw_step_`` / ``sgd_step_`` and their 8-bit forms, on CPU tensors):
:class:`HostStep`, the :class:`~memkern.optim.step_placement.StepPlacement` that runs it.

:class:`HostOffload` keeps host copies of this rank's slices of the gradients and weights, the
buffers the kernels run on: pinned, and moved on two CUDA streams
(:class:`~memkern._copies.Transfers`: gradients down on one, weights up on the other)
when the model is on a GPU; for a model on the CPU the gradients are read in place and the
weights copied; gradients already in host memory (``gradients="host"``: the window's sums) are
read in place. (Across several ranks a model on the CPU needs no copies of its weights: its
segments are the flat buffers themselves.)

**One process: the step overlaps the backward pass** (:class:`OverlappedHostStep`). During a
window's last backward, each bucket of parameters (a unit of :mod:`memkern.optim.zero`, one
segment) is stepped on the host as soon as its gradients are final::

    GPU compute stream:  backward ... bucket k's grads done | ... bucket k+1's grads done | ...
    download stream:                  D2H grads k            |      D2H grads k+1
    host worker thread:                      CPU step k       |             CPU step k+1
    step():  norm, inf check and clip coefficient on the GPU, then the verdict on every
             bucket; upload stream: H2D weights of each bucket, overlapping the steps of the
             buckets still running; the current stream waits for the last upload

The host steps buckets while the GPU computes the gradients of the earlier layers, so what is
left after backward is the step of the last buckets (the first layers, and the embedding), and
the uploads, which overlap it. The model's weights change in ``step()`` only: until then the
steps write the host copies.

**Exact, with clipping, loss scaling and accumulation.** A bucket's step needs the window's
multiplier ``1 / (scale · normaliser) · clip_coef`` and its ``found_inf``, and both depend on
every gradient of the window, which backward has not finished when the first buckets are
ready. The scale and the normaliser are known when the last backward starts (the scale changes
only at a window's end; the normaliser is the window's micro-batch count or item total), the
clip coefficient and the inf check are not. So the buckets that are ready before the verdict
are stepped *speculatively*, with ``clip_coef = 1``, after a copy of their state (masters,
moments or 8-bit codes and absmax, step counter) is kept. At ``step()``:

- the window is finite and was not clipped (``clip_coef`` is exactly 1, so the multiplier is
  bit for bit the one used): the speculative steps are the steps; their weights go up;
- an inf/NaN (the window is skipped): each stepped bucket gets its state back from the copy
  and its host weights rewritten from the restored master; the model's weights were never
  touched;
- the window was clipped: each stepped bucket gets its state back and is stepped again with
  the clipped multiplier. So is a bucket whose param group's hyper-parameters (the learning
  rate, ...) were changed after its early step: the step uses those of ``step()``'s time.

Buckets whose gradients arrive after the verdict (the last ones) are stepped once, exactly,
with no copy. After a clipped window the next window does not speculate (clipping tends to
persist; stepping twice would cost more than waiting): its buckets' gradients still come down
during backward, and their steps run once the verdict is known. With clipping that bites every
window, the overlap is therefore the gradients' transfers only: a clipped step cannot start
before the norm of the whole window's gradient is known, and that is the last thing backward
yields. Only the window's last micro-batch overlaps: the earlier ones only accumulate. With
several ranks, or for a window closed by ``step(force=True)``, the step runs after the verdict,
bucket by bucket with the copies overlapping the other buckets' steps (:meth:`HostOffload.step`).

Costs: host memory for the copies of the state (as much as the state: 12 bytes per parameter
with AdamW, 6 with 8-bit state) and host memory traffic to make them (the state read and
written once more) for the buckets stepped speculatively. Memory per rank on the GPU is the
weights and the gradients and nothing else: 4 bytes per parameter for 16-bit with stage 1,
2 + 2/W with stage 2. Between the window's last backward and its ``step()`` the optimizer's
state holds the speculative steps: its state dict and checkpoints, read in between, first undo
them (the step then runs after the verdict).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from memkern import _fake, _host
from memkern._copies import Transfers
from memkern.optim.grad_placement import GradPlacement
from memkern.optim.segment import Segment
from memkern.optim.step_placement import StepPlacement, Update


def _use_threads(n: int) -> None:
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


class HostStep(StepPlacement):
    """The step on the host (see the module docstring): the
    :class:`~memkern.optim.step_placement.StepPlacement` of ``offload="cpu"`` and
    ``gradients="host"``.

    Args:
        update: the kernel call of one segment.
        overlapped: one process: the steps start during the window's last backward pass
            (:class:`OverlappedHostStep`), on host copies of the weights.
        num_threads: the intra-op threads of each overlapped step (the process's).
        hyperparameters: ``hyperparameters(i)``, the current hyper-parameters of segment
            ``i``'s param group (what its step reads besides the state and gradients).
        setting: the argument that chose this part, for error messages.
    """

    def __init__(self, update: Update, overlapped: bool, num_threads: int,
                 hyperparameters: Callable[[int], dict[str, Any]], setting: str) -> None:
        self.update, self.overlapped, self.num_threads = update, overlapped, num_threads
        self.hyperparameters, self.setting = hyperparameters, setting
        self.overlap: OverlappedHostStep | None = None
        self._grads: GradPlacement | None = None

    def home(self, segments: list[Segment], grads_on_host: bool) -> None:
        """Re-homes each segment on :class:`HostOffload`'s host tensors."""
        device = segments[0].weights.device
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"memkern.ShardedOptimizer: {self.setting} needs the model on the "
                             f"CPU or a CUDA GPU, not on {device}")
        transfers = Transfers(device)
        # Copies of the weights: from a GPU (or a GPU planned for), and in one process, where
        # the host steps start before step() and must not touch the model's weights.
        self.copies_weights = transfers.pinned or self.overlapped
        self.host = HostOffload([(seg.grads, seg.weights) for seg in segments], transfers,
                                self.copies_weights, grads_on_host)
        for seg, grads, weights in zip(segments, self.host.grads, self.host.weights):
            seg.grads, seg.weights = grads, weights
        if self.overlapped:
            self.overlap = OverlappedHostStep(segments, self.update, self.host, self.num_threads,
                                              self.hyperparameters)

    def allocating(self, holds: str) -> contextlib.AbstractContextManager:
        return _host.allocating(holds)

    def pull_weights(self) -> None:
        self.host.pull_weights()

    def run(self, segments: list[Segment], update: Update, grad_multiplier: torch.Tensor,
            found_inf: torch.Tensor) -> None:
        """Settles the overlapped steps of the window, or (several ranks, a window closed by
        ``step(force=True)``, one whose early steps were undone) steps every segment now."""
        if self.overlap is not None and self.overlap.active:
            self.overlap.finish(grad_multiplier, found_inf)
            return
        self.host.step(segments, update, grad_multiplier, found_inf)

    def begin_last_backward(self, prepare: Callable[[], torch.Tensor],
                            grads: GradPlacement) -> None:
        if self.overlap is None:
            return
        self.overlap.begin(prepare())
        self._grads = grads
        grads.watch_units(self.overlap.segment_ready)

    def end_last_backward(self) -> None:
        if self.overlap is None or not self.overlap.active:
            return
        self._grads.watch_units(None)
        self.overlap.end()

    def settle(self) -> None:
        if self.overlap is None or not self.overlap.active:
            return
        self._grads.watch_units(None)
        self.overlap.undo()


class HostOffload:
    """Host copies of this rank's slices of the gradients and weights, and the copies between
    them and the model's.

    Args:
        views: per segment, ``(grads, weights)``: this rank's slices of the reduced gradients
            (on the model's device, or already in host memory: ``gradients="host"``) and of
            the model weights (1-D, same length).
        transfers: the copies to and from the model's device.
        copy_weights: the weights are stepped on host copies (else in place: a model on the
            CPU across ranks).
        grads_on_host: the gradients are in host memory already.

    ``grads[i]`` and ``weights[i]`` are the host tensors segment ``i`` is built on, of the
    views' dtypes: gradients on a GPU (or a GPU planned for) are copied down into pinned
    memory, those already in host memory and a CPU model's read in place; weights are copies
    when ``copy_weights``. All made by :func:`memkern._host.empty`. For float32
    parameters ``weights[i]`` is the master itself (the kernel updates it in place); for
    16-bit ones the kernel rewrites it from the master. The model's weights change in
    :meth:`push_weights` only.
    """

    def __init__(self, views: list[tuple[torch.Tensor, torch.Tensor]], transfers: Transfers,
                 copy_weights: bool, grads_on_host: bool) -> None:
        self.views, self.transfers = views, transfers
        self.cuda = transfers.cuda
        pinned = transfers.pinned
        self.grads = [_host.empty(g.numel(), g.dtype, pinned=True, holds="gradients")
                      if pinned and not grads_on_host else g for g, _ in views]
        self.weights = [_host.empty(w.numel(), w.dtype, pinned=pinned, holds="weights")
                        if copy_weights else w for _, w in views]
        # Per segment, the event of its last upload: the host must not rewrite weights[i]
        # before that copy has read it.
        self._uploaded: list[torch.cuda.Event | None] = [None] * len(views)
        self._scalars = _host.empty(2, torch.float32, pinned=pinned, holds="optimizer state")
        self.pull_weights()

    def pull_weights(self) -> None:
        """The model's weights into the host copies (waits): before the masters are made from
        them at the first step or load, so weights loaded into the model since count."""
        for (_, model_w), host_w in zip(self.views, self.weights):
            if host_w is not model_w:
                host_w.copy_(model_w)

    def fetch(self, host: torch.Tensor, source: torch.Tensor) -> torch.cuda.Event | None:
        """Copies ``source`` into the host tensor ``host`` (see :meth:`Transfers.down`)."""
        return self.transfers.down(host, source)

    def fetch_grads(self, i: int) -> torch.cuda.Event | None:
        """Segment ``i``'s gradients down (nothing to do when they are read in place)."""
        grads, source = self.grads[i], self.views[i][0]
        return None if grads is source else self.fetch(grads, source)

    def weights_free(self, i: int) -> None:
        """Waits until the last upload of segment ``i``'s weights has read them."""
        self.wait(self._uploaded[i])

    def push_weights(self, i: int) -> None:
        """Segment ``i``'s host weights into the model: on the upload stream from a GPU (any
        thread), at once on the CPU (nothing to do when they were stepped in place)."""
        model_w = self.views[i][1]
        if self.weights[i] is not model_w:
            self._uploaded[i] = self.transfers.up(model_w, self.weights[i])

    def join(self) -> None:
        """The current stream waits for both copy streams (the next forward reads the
        weights, the next backward writes the gradients)."""
        self.transfers.join()

    wait = staticmethod(Transfers.wait)

    def step(self, segments: list[Segment], update: Update, grad_multiplier: torch.Tensor,
             found_inf: torch.Tensor) -> None:
        """Runs ``update(segment, grad_multiplier, found_inf)`` on the CPU for every segment,
        with its gradients copied down before and its weights copied up after, each copy
        overlapping the steps of other segments."""
        ready = self.fetch(self._scalars, torch.stack([grad_multiplier.reshape(()).float(),
                                                       found_inf.reshape(()).float()]))
        arrived = [self.fetch_grads(i) for i in range(len(segments))]
        self.wait(ready)
        for i, seg in enumerate(segments):
            self.wait(arrived[i])
            self.weights_free(i)
            update(seg, self._scalars[0:1], self._scalars[1:2])
            self.push_weights(i)
        self.join()


class OverlappedHostStep:
    """One process's host steps, started during a window's last backward pass (the module
    docstring has the schedule and why it is exact).

    Args:
        segments: the optimizer's segments, built on ``host``'s copies.
        update: the kernel call of one segment.
        host: the copies between the model and the host.
        num_threads: the intra-op threads of each step (the process's).
        hyperparameters: ``hyperparameters(i)``, the current hyper-parameters of segment
            ``i``'s param group (what its step reads besides the state and gradients).

    The calls, per window: :meth:`begin` before the last backward, :meth:`segment_ready` for
    each segment whose gradients are final (any thread: the autograd engine's), :meth:`end`
    after that backward, :meth:`finish` in ``step()``; :meth:`undo` instead, to leave the state
    as it was before the window (a backward that raised, a state dict read mid-window).
    """

    def __init__(self, segments: list[Segment], update: Update, host: HostOffload,
                 num_threads: int, hyperparameters: Callable[[int], dict[str, Any]]) -> None:
        self.segments, self.update, self.host = segments, update, host
        self.hyperparameters = hyperparameters
        self._backups: list[dict[str, torch.Tensor] | None] = [None] * len(segments)
        # One thread runs the host steps in the order their gradients arrived; each step's
        # kernel runs on the intra-op threads (with OpenMP the thread's own team, whose size
        # is the thread's own setting: made the process's).
        self._worker = _fake.thread_pool(host.weights[0], 1,
                                         thread_name_prefix="memkern-host-step",
                                         initializer=_use_threads, initargs=(num_threads,))
        self._lock = threading.Lock()
        pinned = host.transfers.pinned
        self._spec = _host.empty(1, torch.float32, pinned=pinned, holds="optimizer state")
        self._verdict_values = _host.empty(2, torch.float32, pinned=pinned,
                                           holds="optimizer state")
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
        self._used: dict[int, dict[str, Any]] = {}  # the hyper-parameters of each early step
        self._verdict: tuple[torch.Tensor, torch.Tensor] | None = None
        self._spec_ready = self.host.fetch(self._spec, unclipped_multiplier.reshape(1))

    def segment_ready(self, i: int) -> None:
        """Segment ``i``'s gradients are final: they start down now (after the work enqueued
        so far), and, when speculating, its step is issued."""
        if not self.active or i in self._arrived:
            return
        self._arrived[i] = self.host.fetch_grads(i)
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
        every segment settled and its weights into the model: the speculative steps kept,
        undone or redone, the others run; the current stream then waits for the uploads."""
        verdict = torch.stack([grad_multiplier.reshape(()).float(),
                               found_inf.reshape(()).float()])
        self.host.wait(self.host.fetch(self._verdict_values, verdict))
        self.host.wait(self._spec_ready)
        multiplier, skip = self._verdict_values[0:1], self._verdict_values[1:2]
        skipped = bool(skip.item() != 0)
        # clip_coef == 1 exactly: the multiplier is the unclipped one, bit for bit
        unclipped = bool(multiplier.eq(self._spec).item())
        with self._lock:
            self._verdict = (multiplier, skip)
            speculated = sorted(self._speculated)
        # The steps done so far go up first: their uploads overlap the steps still to run.
        kept = set()
        if not skipped and unclipped:
            for i in speculated:
                self._jobs.pop(i).result()
                if self._used[i] == self.hyperparameters(i):  # e.g. no lr set since
                    kept.add(i)
                    self.host.push_weights(i)
        self._wait_jobs()
        for i in range(len(self.segments)):
            if i in self._speculated and i not in kept:
                self._restore(i)
                if not skipped:
                    self._step(i, multiplier)
                    self.host.push_weights(i)
            elif i not in self._speculated and i not in self._jobs:
                self._exact(i)  # not speculating: every segment is stepped here
        if not skipped:  # an overflow says nothing about clipping
            self.speculate = unclipped
        self._close()

    @torch.no_grad()
    def undo(self) -> None:
        """Puts back the state of every segment stepped speculatively, and ends the window's
        overlap: ``step()`` then runs after the verdict. (The model's weights were not
        touched.)"""
        if not self.active:
            return
        with self._lock:
            self._verdict = None
        self._wait_jobs()
        for i in sorted(self._speculated):
            self._restore(i)
        self._close()

    # ------------------------------------------------------------------------------- steps
    @torch.no_grad()
    def _run(self, i: int) -> None:
        """Segment ``i``'s job on the worker thread: exactly when the verdict is known by now
        (its weights then go up), else speculatively, after keeping a copy of its state."""
        self._await(i)
        with self._lock:
            verdict = self._verdict
            if verdict is None:
                self._speculated.add(i)
        if verdict is not None:
            self._exact(i)
            return
        self.host.wait(self._spec_ready)
        self._backup(i)
        self._used[i] = self.hyperparameters(i)
        self._step(i, self._spec)

    def _exact(self, i: int) -> None:
        """Segment ``i``'s one step after the verdict (none for a skipped window)."""
        multiplier, skip = self._verdict
        self._await(i)
        if skip.item() == 0:
            self._step(i, multiplier)
            self.host.push_weights(i)

    def _await(self, i: int) -> None:
        """Waits for segment ``i``'s gradients on the host and for its weights to be free."""
        self.host.wait(self._arrived[i])
        self.host.weights_free(i)

    def _step(self, i: int, multiplier: torch.Tensor) -> None:
        self.update(self.segments[i], multiplier, None)

    def _wait_jobs(self) -> None:
        for job in self._jobs.values():
            job.result()  # re-raises what the worker raised

    def _close(self) -> None:
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
            with _host.allocating("state copies"):
                backup = {k: torch.empty_like(t) for k, t in live.items()}
            self._backups[i] = backup
        for k, t in live.items():
            backup[k].copy_(t)

    def _restore(self, i: int) -> None:
        seg = self.segments[i]
        for k, t in self._state_tensors(seg).items():
            t.copy_(self._backups[i][k])
        if seg.low_precision:
            seg.weights.copy_(seg.master)
