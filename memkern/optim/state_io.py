"""State I/O of :class:`~memkern.optim.ShardedOptimizer`: where one rank keeps each parameter's
optimizer state and the open window's gradient, and the front end's own state (loss scaler,
skipped steps, the open window) as its state dicts and sharded checkpoints
(:mod:`memkern.optim.checkpoint`) save and restore it.

State is addressed in per-parameter coordinates, which do not depend on the world size or the
zero stage: a *piece* ``(flat, start)`` is a 1-D tensor holding a parameter's flattened
elements ``[start, start + flat.numel())``. In one process a parameter's state is one piece;
across ranks each rank holds the pieces of its shards
(:meth:`~memkern.optim.grad_placement.GradPlacement.owned_piece`). Everything here goes
through the parts' interfaces: the gradients' part (where each unit and piece lies, the
collectives), the step's part, and the optimizer's state store.
"""
from __future__ import annotations

from typing import Any

import torch

from memkern.amp.loss_scaler import LossScaler
from memkern.optim.flat_state import FlatOptimizer
from memkern.optim.grad_placement import GradPlacement
from memkern.optim.process_group import WeakGroup
from memkern.optim.segment import Segment
from memkern.optim.step_placement import StepPlacement
from memkern.optim.window import AccumulationWindow

Pieces = list[tuple[torch.Tensor, int]]
"""``(flat, start)`` pairs: where a parameter's flattened elements are kept on this rank."""


class StateIO:
    """The state I/O of one rank of a sharded optimizer (see the module docstring): what
    :mod:`memkern.optim.checkpoint` sees of the optimizer.

    Args:
        opt: the optimizer: its param groups, segments and flat state (the state store's
            public interface, :class:`~memkern.optim.flat_state.FlatOptimizer`).
        grads: where its gradients live (the units, this rank's pieces, the collectives).
        steps: where its step runs (whether the segments' weights are copies).
        window: its accumulation window.
        scaler: its loss scaler.
        skipped: its count of skipped windows (0-dim int64 device tensor).
        process_group, rank, world_size: where it runs (group None: one process).
    """

    process_group = WeakGroup("memkern.ShardedOptimizer")

    def __init__(self, opt: FlatOptimizer, grads: GradPlacement, steps: StepPlacement,
                 window: AccumulationWindow, scaler: LossScaler, skipped: torch.Tensor,
                 process_group: Any, rank: int, world_size: int) -> None:
        self.opt, self.grads, self.steps, self.window = opt, grads, steps, window
        self.scaler, self.skipped = scaler, skipped
        self.process_group, self.rank, self.world_size = process_group, rank, world_size

    def params(self) -> list[torch.Tensor]:
        """The parameters in state-dict index order."""
        return [p for g in self.opt.param_groups for p in g["params"]]

    def segment_of(self, p: torch.Tensor) -> Segment:
        """The segment holding (this rank's part of) ``p``'s state."""
        return self.grads.unit_of(p).segment

    # -------------------------------------------------------------------------- the store
    @property
    def state_ready(self) -> bool:
        """Whether the optimizer state exists (from the first step or load on)."""
        return self.opt.state_ready

    @property
    def algorithm_name(self) -> str:
        return self.opt.algorithm.__name__

    def state_keys(self, group: dict[str, Any]) -> set[str]:
        """The float32 state a parameter of param group ``group`` (its saved options) has."""
        return set(self.opt.algorithm.state_keys({**self.opt.defaults, **group}))

    def param_groups(self) -> list[dict[str, Any]]:
        """The param groups in torch's state-dict format (parameters as indices):
        ``Optimizer.state_dict`` skipping the subclasses' (no gathering)."""
        return torch.optim.Optimizer.state_dict(self.opt)["param_groups"]

    def check_param_groups(self, saved_groups: list[dict[str, Any]], name: str,
                           source: str) -> None:
        self.opt.check_param_groups(saved_groups, name, source)

    def adopt_param_groups(self, saved_groups: list[dict[str, Any]], name: str) -> None:
        """Takes the saved param groups' hyper-parameters and makes fresh state with them."""
        self.opt.adopt_param_groups(saved_groups, name)
        self.opt.init_state()

    def set_steps(self, steps: dict[int, float], name: str) -> None:
        """The step counters from per-parameter steps (``id(p)`` -> step)."""
        self.opt.set_steps(steps, name)

    # ----------------------------------------------------------------------------- pieces
    def state_pieces(self, p: torch.Tensor, key: str) -> Pieces | None:
        """This rank's pieces of state ``key`` of ``p`` (None: the optimizer has no such
        state); the model's own weights for the master of a float32 parameter."""
        seg = self.segment_of(p)
        pieces = []
        if key == "master_param" and not seg.low_precision:
            # The model's float32 weights are the master: every rank takes the whole of it
            # (and where the segments step copies of them, also its copy of its slices).
            pieces.append((p.data.view(-1), 0))
            if not self.steps.copies_weights:
                return pieces
            flat = seg.weights
        elif key in seg.state:
            flat = seg.state[key]
        else:
            return None
        piece = self.grads.owned_piece(p, flat)
        return pieces + ([piece] if piece is not None else [])

    def window_grad_pieces(self) -> dict[int, Pieces]:
        """This rank's pieces of the open window's gradient summed over ranks, per
        ``id(param)``; the window is left as it is."""
        return self._grad_pieces(self.grads.reduced_window_grads())

    def window_grad_targets(self) -> dict[int, Pieces]:
        """Zeroes the gradients; returns where a loaded window's summed gradient goes on this
        rank, per ``id(param)``: with several ranks each takes its own slices only, the others
        stay zero here, so the reduction at ``step`` sums to the loaded values plus what
        comes after."""
        self.opt.grad_buffer.zero_()
        return self._grad_pieces(self.grads.window_grad_targets())

    def _grad_pieces(self, unit_slices: list[torch.Tensor]) -> dict[int, Pieces]:
        """Per ``id(param)``, its pieces in ``unit_slices`` (per unit, this rank's slice of a
        unit-laid-out gradient)."""
        pieces = {}
        for unit, flat in zip(self.grads.units, unit_slices):
            for p in unit.params:
                piece = self.grads.owned_piece(p, flat)
                pieces[id(p)] = [piece] if piece is not None else []
        return pieces

    # ------------------------------------------------------------- full (gathered) state
    def gather_param_states(self) -> dict[int, dict[str, torch.Tensor]]:
        """Every rank's slices of the state, as torch-format per-parameter CPU tensors
        (collective)."""
        if not self.state_ready:
            return {}
        index = {id(p): i for i, p in enumerate(self.params())}
        states = {}
        for unit in self.grads.units:
            seg = unit.segment
            gathered = {key: self.grads.gather_unit(unit, flat)
                        for key, flat in seg.state.items()}
            for j, p in enumerate(unit.params):
                states[index[id(p)]] = {"step": seg.step.detach().to("cpu", copy=True),
                                        **{key: values[j] for key, values in gathered.items()}}
        return dict(sorted(states.items()))

    def window_grads(self) -> dict[int, torch.Tensor]:
        """The open window's gradient per parameter index, summed over ranks (collective)."""
        index = {id(p): i for i, p in enumerate(self.params())}
        grads = {}
        for unit, local in zip(self.grads.units, self.grads.reduced_window_grads()):
            for p, grad in zip(unit.params, self.grads.gather_unit(unit, local)):
                grads[index[id(p)]] = grad
        return dict(sorted(grads.items()))

    # ------------------------------------------------------------------ front-end state
    def window_totals(self) -> tuple[float, int]:
        """The open window's item count and its count of backward passes that reached no
        parameter, each summed over ranks (one collective; reads the device)."""
        totals = self.grads.all_reduce(torch.stack([self.window.num_items.to(torch.float64),
                                                    self.window.gradless.to(torch.float64)]))
        num_items, gradless = totals.tolist()
        return num_items, int(gradless)

    def window_state(self) -> dict[str, Any]:
        """The window's counters and totals, as saved (collective). ``gradless``: a pass that
        reached no parameter on some rank, which the window's step refuses on every rank, is
        refused after a resume too."""
        num_items, gradless = self.window_totals()
        return {**self.window.counters(), "num_items": num_items, "gradless": gradless}

    def front_end_state(self) -> dict[str, Any]:
        """The ``"memkern"`` entry of the state dict: the loss scaler, the skipped-step count
        and the open window with its gradient per parameter index, summed over ranks
        (collective; reads the device)."""
        window = self.window_state()
        window["grads"] = self.window_grads() if self.window.micro_batches > 0 else None
        return {"loss_scaler": self.scaler.state_dict(),
                "skipped_steps": int(self.skipped.item()), "window": window}

    def load_front_end_state(self, front: dict[str, Any] | None) -> None:
        """Restores :meth:`front_end_state`'s output (None: a plain torch-format state dict,
        which leaves no window open); each rank keeps its slices of the window's gradient."""
        targets = self.window_grad_targets()
        if front is None:
            self.window.restore(None, self.rank)
            return
        window = front["window"]
        if window["micro_batches"]:
            for i, p in enumerate(self.params()):
                flat = window["grads"][i].reshape(-1)
                for target, start in targets[id(p)]:
                    target.copy_(flat[start:start + target.numel()])
        self.restore(front["loss_scaler"], front["skipped_steps"], window)

    def restore(self, loss_scaler: dict[str, Any], skipped_steps: int,
                window: dict[str, Any]) -> None:
        """The loss scaler's state (empty: a disabled scaler's, nothing to load), the skipped
        count and the window's counters; the window's gradient is loaded separately."""
        if loss_scaler:
            self.scaler.load_state_dict(loss_scaler)
        self.skipped.fill_(skipped_steps)
        self.window.restore(window, self.rank)
