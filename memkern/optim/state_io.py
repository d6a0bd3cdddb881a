"""State I/O of :class:`~memkern.optim.ShardedOptimizer`: where one rank keeps each parameter's
optimizer state and the open window's gradient, and the front end's own state (loss scaler,
skipped steps, the open window) as its state dicts and sharded checkpoints
(:mod:`memkern.optim.checkpoint`) save and restore it.

State is addressed in per-parameter coordinates, which do not depend on the world size or the
zero stage: a *piece* ``(flat, start)`` is a 1-D tensor holding a parameter's flattened
elements ``[start, start + flat.numel())``. In one process a parameter's state is one piece;
across ranks each rank holds the pieces of its shards (:meth:`Shards.owned_piece`).
"""
from __future__ import annotations

from typing import Any

import torch

from memkern.amp.loss_scaler import LossScaler
from memkern.optim.flat_state import FlatOptimizer, Segment
from memkern.optim.process_group import WeakGroup
from memkern.optim.window import AccumulationWindow
from memkern.optim.zero import Shards

Pieces = list[tuple[torch.Tensor, int]]
"""``(flat, start)`` pairs: where a parameter's flattened elements are kept on this rank."""


class StateIO:
    """The state I/O of one rank of a sharded optimizer (see the module docstring).

    Args:
        opt: the optimizer (its param groups, segments and flat state).
        shards: its multi-rank (or offload) machinery; None for one plain process.
        window: its accumulation window.
        scaler: its loss scaler.
        skipped: its count of skipped windows (0-dim int64 device tensor).
        process_group, rank, world_size: where it runs (group None: one process).
    """

    process_group = WeakGroup("memkern.ShardedOptimizer")

    def __init__(self, opt: FlatOptimizer, shards: Shards | None, window: AccumulationWindow,
                 scaler: LossScaler, skipped: torch.Tensor, process_group: Any, rank: int,
                 world_size: int) -> None:
        self.opt, self.shards, self.window = opt, shards, window
        self.scaler, self.skipped = scaler, skipped
        self.process_group, self.rank, self.world_size = process_group, rank, world_size

    def params(self) -> list[torch.Tensor]:
        """The parameters in state-dict index order."""
        return [p for g in self.opt.param_groups for p in g["params"]]

    def segment_of(self, p: torch.Tensor) -> Segment:
        """The segment holding (this rank's part of) ``p``'s state."""
        if self.shards is not None:
            return self.shards.unit_of(p).segment
        return next(seg for seg in self.opt.segments if any(q is p for q in seg.params))

    # ----------------------------------------------------------------------------- pieces
    def state_pieces(self, p: torch.Tensor, key: str) -> Pieces | None:
        """This rank's pieces of state ``key`` of ``p`` (None: the optimizer has no such
        state); the model's own weights for the master of a float32 parameter."""
        if self.shards is None:
            return FlatOptimizer._state_pieces(self.opt, p, key)
        seg = self.shards.unit_of(p).segment
        pieces = []
        if key == "master_param" and not seg.low_precision:
            # The model's float32 weights are the master: every rank takes the whole of it
            # (and offload also its host copy of its slices).
            pieces.append((p.data.view(-1), 0))
            if self.shards.host is None:
                return pieces
            flat = seg.weights
        elif key in seg.state:
            flat = seg.state[key]
        else:
            return None
        piece = self.shards.owned_piece(p, flat)
        return pieces + ([piece] if piece is not None else [])

    def window_grad_pieces(self) -> dict[int, Pieces]:
        """This rank's pieces of the open window's gradient summed over ranks, per
        ``id(param)``; the window is left as it is."""
        return self._grad_pieces(None if self.shards is None else
                                 self.shards.reduced_window_grads())

    def window_grad_targets(self) -> dict[int, Pieces]:
        """Zeroes the gradients; returns where a loaded window's summed gradient goes on this
        rank, per ``id(param)``: with several ranks each takes its own slices only, the others
        stay zero here, so the reduction at ``step`` sums to the loaded values plus what
        comes after."""
        self.opt.grad_buffer.zero_()
        return self._grad_pieces(None if self.shards is None else
                                 self.shards.window_grad_targets())

    def _grad_pieces(self, unit_slices: list[torch.Tensor] | None) -> dict[int, Pieces]:
        """Per ``id(param)``, its pieces in ``unit_slices`` (per unit, this rank's slice of a
        unit-laid-out gradient), or in the gradient buffer for one plain process (None)."""
        if unit_slices is None:
            grad_buffer = self.opt.grad_buffer
            return {id(p): [(grad_buffer.grad(p).view(-1), 0)] for p in self.params()}
        pieces = {}
        for unit, flat in zip(self.shards.units, unit_slices):
            for p in unit.params:
                piece = self.shards.owned_piece(p, flat)
                pieces[id(p)] = [piece] if piece is not None else []
        return pieces

    # ------------------------------------------------------------- full (gathered) state
    def gather_param_states(self) -> dict[int, dict[str, torch.Tensor]]:
        """Every rank's slices of the state, as torch-format per-parameter CPU tensors
        (collective)."""
        if not self.opt._state_ready:
            return {}
        index = {id(p): i for i, p in enumerate(self.params())}
        states = {}
        for unit in self.shards.units:
            seg = unit.segment
            gathered = {key: self.shards.gather_unit(unit, flat)
                        for key, flat in seg.state.items()}
            for j, p in enumerate(unit.params):
                states[index[id(p)]] = {"step": seg.step.detach().to("cpu", copy=True),
                                        **{key: values[j] for key, values in gathered.items()}}
        return dict(sorted(states.items()))

    def window_grads(self) -> dict[int, torch.Tensor]:
        """The open window's gradient per parameter index, summed over ranks (collective)."""
        params = self.params()
        if self.shards is None:
            return {i: self.opt.grad_buffer.grad(p) for i, p in enumerate(params)}
        index = {id(p): i for i, p in enumerate(params)}
        grads = {}
        for unit, local in zip(self.shards.units, self.shards.reduced_window_grads()):
            for p, grad in zip(unit.params, self.shards.gather_unit(unit, local)):
                grads[index[id(p)]] = grad
        return dict(sorted(grads.items()))

    # ------------------------------------------------------------------ front-end state
    def window_totals(self) -> tuple[float, int]:
        """The open window's item count and its count of backward passes that reached no
        parameter, each summed over ranks (one collective; reads the device)."""
        totals = torch.stack([self.window.num_items.to(torch.float64),
                              self.window.gradless.to(torch.float64)])
        if self.shards is not None:
            self.shards.all_reduce(totals)
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
