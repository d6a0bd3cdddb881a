"""The accumulation window of :class:`~memkern.optim.ShardedOptimizer`: the bookkeeping of the
micro-batches between two optimizer steps, on one rank.

A window opens with the first ``backward()`` after a step and closes at the step that applies
it. It records how many micro-batches it holds, how its gradient is normalised (by the number
of micro-batch gradients summed, ``"mean"``, or by the items the losses were summed over,
``"items"``) and the state of the gradient buffer around it: gradients not yet zeroed, and
gradients that reached the buffer outside ``backward()`` (not loss-scaled, not counted), which
the step refuses. Nothing here touches the gradients themselves.

Over several ranks, a rank's micro-batch whose backward reached no parameter is counted like
any other (the ranks' windows must close at the same step) and refused at the window's step
on every rank at once (:meth:`AccumulationWindow.check_every_pass_had_gradients`): raised on
its rank alone, it would leave the other ranks waiting in the step's collectives.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any

import torch

BACKWARD = "memkern.ShardedOptimizer.backward"

GRADLESS_PASS = (
    "memkern.ShardedOptimizer.step: on some rank a micro-batch's loss reached no parameter of "
    "this optimizer (its backward() received no gradient), so no step was taken on any rank "
    "and the window was dropped (zero_grad() clears it). Were the model's parameters replaced "
    "after the optimizer was built on that rank (model.load_state_dict(..., assign=True), a "
    "new model)? Build the optimizer on the parameters the loss is computed from")


def assert_on_device(condition: torch.Tensor, message: str) -> None:
    """RuntimeError(``message``) unless the 0-dim bool ``condition`` is true, checked where it
    lives: on the CPU at once, on a GPU as an asynchronous device-side assert, never a host
    read (the step loop does not wait for the device). torch's private ``_assert_async``:
    the only public check reads the value on the host."""
    torch._assert_async(condition, message)


class AccumulationWindow:
    """The open window on one rank.

    Attributes:
        micro_batches: ``backward()`` calls on this rank since the last step (0: closed).
        gradients: micro-batch gradients summed into the window over all ranks (the
            ``"mean"`` normaliser: micro-batches x world size).
        mode: None (closed), ``"mean"`` or ``"items"``.
        num_items: this rank's total of ``num_items``, a 0-dim float64 tensor on the
            gradients' device (exact counts up to 2**53).
        dirty: the buffer holds gradients that ``zero_grad()`` has not cleared.
        stray: a gradient arrived outside ``backward()``.
        grads_in_pass: parameters that received a gradient in the last ``backward()`` pass.
        gradless: this rank's ``backward()`` passes in the window whose loss reached no
            parameter (several ranks only; one process refuses them in ``backward()``), a 0-dim
            float64 tensor on the gradients' device, summed over the ranks at the step.
    """

    def __init__(self, device: torch.device, accumulation_steps: int) -> None:
        self.micro_batches = 0
        self.gradients = 0
        self.mode: str | None = None
        self.num_items = torch.zeros((), dtype=torch.float64, device=device)
        self.dirty = False
        self.stray = False
        self._in_backward = False
        self.grads_in_pass = 0
        self.gradless = torch.zeros((), dtype=torch.float64, device=device)
        self._gradless_on_host = False  # gradless is non-zero: zero it when the window closes
        self._warned_unzeroed = False
        self._checked_batch_norm = accumulation_steps == 1
        self._accumulation_steps = accumulation_steps

    # ------------------------------------------------------------------------- micro-batch
    def mode_for(self, num_items: Any) -> str:
        """The mode of a micro-batch passed with (``"items"``) or without (``"mean"``)
        ``num_items``; ValueError when the window's earlier micro-batches used the other."""
        mode = "mean" if num_items is None else "items"
        if self.mode not in (None, mode):
            raise ValueError(
                f"{BACKWARD}: this accumulation window's earlier micro-batches were passed "
                + ("with num_items and this one without" if mode == "mean" else
                   "without num_items and this one with")
                + "; pass num_items on every micro-batch of a window or on none"
            )
        return mode

    def add_items(self, num_items: int | float | torch.Tensor) -> None:
        """Adds a micro-batch's ``num_items`` (an int/float > 0 or a one-element tensor,
        checked > 0 on its device) to this rank's total."""
        if isinstance(num_items, torch.Tensor):
            if num_items.numel() != 1 or num_items.dtype in (torch.bool, torch.complex64,
                                                             torch.complex128):
                raise ValueError(f"{BACKWARD}: num_items must be a one-element integer or float "
                                 f"tensor, got {num_items.dtype} of shape "
                                 f"{tuple(num_items.shape)}")
            n = num_items.detach().reshape(()).to(self.num_items.device, non_blocking=True)
            # Checked where the value lives: on a GPU an asynchronous device-side assert.
            assert_on_device(n > 0, f"{BACKWARD}: num_items must be > 0")
            self.num_items.add_(n)
        elif isinstance(num_items, (int, float)) and not isinstance(num_items, bool):
            if not (math.isfinite(num_items) and num_items > 0):
                raise ValueError(f"{BACKWARD}: num_items must be > 0 (the number of items the "
                                 f"loss sums over), got {num_items}")
            self.num_items.add_(num_items)
        else:
            raise TypeError(f"{BACKWARD}: num_items must be an int, a float or a one-element "
                            f"tensor, got {type(num_items).__name__}")

    def check_before_backward(self, loss: torch.Tensor) -> None:
        """Warns once when a new window starts on gradients that were never zeroed, and once
        (on the first backward) when the graph holds a BatchNorm in training mode."""
        if self.micro_batches == 0 and self.dirty and not self._warned_unzeroed:
            self._warned_unzeroed = True
            warnings.warn(
                f"{BACKWARD}: a new accumulation window starts on the previous window's "
                "gradients, which were never zeroed: call zero_grad() after step()",
                RuntimeWarning,
                stacklevel=3,
            )
        if not self._checked_batch_norm:
            self._checked_batch_norm = True
            self._warn_if_batch_norm(loss)

    def _warn_if_batch_norm(self, loss: torch.Tensor) -> None:
        """Walks the graph once: BatchNorm normalises each micro-batch with its own statistics,
        so accumulated micro-batches are not one large batch."""
        seen, stack = set(), [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if "BatchNorm" in type(node).__name__ and getattr(node, "_saved_training", True):
                warnings.warn(
                    "memkern.ShardedOptimizer: the model has BatchNorm layers in training mode "
                    f"and accumulates gradients over {self._accumulation_steps} micro-batches: "
                    "BatchNorm normalises each micro-batch with its own statistics (and updates "
                    "its running statistics per micro-batch), so the result is not that of one "
                    "large batch. Consider GroupNorm/LayerNorm, or larger micro-batches.",
                    RuntimeWarning,
                    stacklevel=4,
                )
                return
            stack.extend(child for child, _ in node.next_functions)

    @contextlib.contextmanager
    def backward_pass(self):
        """Gradients that arrive within it come from ``backward()`` (:meth:`note_grad`)."""
        self._in_backward = True
        self.grads_in_pass = 0
        try:
            yield
        finally:
            self._in_backward = False

    def note_grad(self, p: torch.Tensor) -> None:
        """Post-accumulate hook of every parameter: a gradient outside a backward pass of
        the optimizer is stray."""
        if self._in_backward:
            self.grads_in_pass += 1
        else:
            self.stray = True

    def add_gradless_pass(self) -> None:
        """Counts a ``backward()`` pass whose loss reached no parameter (several ranks)."""
        self.gradless.add_(1)
        self._gradless_on_host = True

    @property
    def holds_gradless_pass(self) -> bool:
        """Whether this rank counted (or a checkpoint restored) a pass that reached no
        parameter in the open window."""
        return self._gradless_on_host

    def add_micro_batch(self, mode: str, world_size: int) -> None:
        """Counts a micro-batch whose backward went through: ``world_size`` gradients (one
        per rank) are now summed into the window."""
        self.mode = mode
        self.micro_batches += 1
        self.gradients += world_size
        self.dirty = True

    # ------------------------------------------------------------------------------- step
    def normaliser(self, num_items_total: torch.Tensor) -> torch.Tensor | int:
        """What the window's summed gradient is divided by: the items' total over all ranks,
        or the number of micro-batch gradients."""
        return num_items_total if self.mode == "items" else self.gradients

    def check_every_pass_had_gradients(self, gradless_total: torch.Tensor) -> None:
        """RuntimeError (on a GPU, a device-side assert) on every rank when the ranks'
        ``gradless`` counts, summed by the step's all-reduce, are not 0; the window is then
        dropped, before any update."""
        try:
            assert_on_device(gradless_total == 0, GRADLESS_PASS)
        except RuntimeError:
            self.reset_items()
            self.close()
            raise

    def reset_items(self) -> None:
        """Zeroes the item count at the window's end (a device op: part of a captured step)."""
        if self.mode == "items":
            self.num_items.zero_()

    def close(self) -> None:
        """The counters after the step that applied the window."""
        self.micro_batches, self.gradients, self.mode = 0, 0, None
        if self._gradless_on_host:
            self.gradless.zero_()
            self._gradless_on_host = False

    def gradients_cleared(self) -> None:
        """``zero_grad()`` cleared the buffer (between windows)."""
        self.dirty = False
        self.stray = False

    # ------------------------------------------------------------------------ checkpoints
    def counters(self) -> dict[str, Any]:
        """``micro_batches``, ``gradients`` and ``mode``, as checkpoints save them."""
        return {"micro_batches": self.micro_batches, "gradients": self.gradients,
                "mode": self.mode}

    def restore(self, window: dict[str, Any] | None, rank: int) -> None:
        """The counters from saved ones (closed when ``window`` is None or holds no
        micro-batch); the saved gradient is loaded separately. One rank carries the saved
        item count: the step sums the ranks' counts."""
        self.close()
        self.num_items.zero_()
        self.gradients_cleared()
        if not window or not window["micro_batches"]:
            return
        self.micro_batches = window["micro_batches"]
        self.gradients = window.get("gradients", window["micro_batches"])
        self.mode = window["mode"]
        self.num_items.fill_(window["num_items"] if rank == 0 else 0)
        if rank == 0 and window.get("gradless"):  # (absent from older checkpoints)
            self.gradless.fill_(window["gradless"])
            self._gradless_on_host = True
        self.dirty = True
