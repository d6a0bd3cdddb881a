"""``Segment``: what one optimizer kernel call updates, and the flat state it keeps (see
:mod:`memkern.optim.flat_state` for where segments come from)."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from memkern.optim import dtensor_params


@dataclasses.dataclass(eq=False)
class Segment:
    """What one optimizer kernel call updates: a contiguous run of one param group and one
    dtype in the flat layout (for the single-process optimizers, all of that group's
    parameters of that dtype).

    ``grads`` is the flat gradient the kernel reads and ``weights`` the flat weights it updates
    (of the parameters' dtype, same length); ``state`` maps state names to flat float32 tensors
    of that length, created on ``weights``' device, and ``step`` is a one-element float32
    tensor there. ``params`` are the parameters that lie wholly in the run at ``offsets``:
    ``param_states`` are their per-parameter state dicts, holding views of the flat state.
    A rank's shard of a sharded optimizer cuts through parameters and lists none.
    State and step exist from the optimizer's first step or load on.
    """

    group: int
    grads: torch.Tensor
    weights: torch.Tensor
    params: list[torch.Tensor] = dataclasses.field(default_factory=list)
    offsets: list[int] = dataclasses.field(default_factory=list)  # each one's offset in the run
    state: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    param_states: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    step: torch.Tensor | None = None
    quantized: bool = False
    """Its moments are stored block-wise in 8 bits (``state_precision="8bit"``)."""
    quantized_state: dict[str, tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(
        default_factory=dict)
    """State name -> ``(codes, absmax)`` of a quantized segment (int8/uint8 codes of the
    segment's length, one float32 absmax per block; :mod:`memkern.ops.adamw8bit`). Such a
    moment appears in ``state`` only while a checkpoint reads or writes it, as float32."""
    dtensor: bool = False
    """The local shard of one DTensor parameter (:mod:`memkern.optim.dtensor_params`):
    ``weights`` is that shard itself, ``grads`` its gradient's shard (set at each step), and
    the per-parameter state views are DTensors like the parameter."""

    def __post_init__(self) -> None:
        self.low_precision = self.weights.dtype != torch.float32

    @property
    def master(self) -> torch.Tensor:
        """Float32 master weights: ``weights`` themselves when they are float32."""
        return self.state["master_param"] if self.low_precision else self.weights

    @property
    def model_weights(self) -> torch.Tensor | None:
        """The kernels' ``params`` output: the 16-bit weights rewritten from the master in the
        same pass, or None when the master is the float32 ``weights``."""
        return self.weights if self.low_precision else None

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of a segment-length flat tensor."""
        if self.dtensor:
            return [dtensor_params.as_dtensor_like(flat, self.params[0])]
        return [flat[o:o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets)]

    def add_state(self, key: str, flat: torch.Tensor) -> torch.Tensor:
        """Stores ``flat`` as state ``key`` and its views in the per-parameter state dicts."""
        self.state[key] = flat
        for state, view in zip(self.param_states, self.views(flat)):
            state[key] = view
        return flat

    def drop_state(self, key: str) -> torch.Tensor | None:
        """Removes state ``key`` (and its per-parameter views); returns it (None if absent)."""
        for state in self.param_states:
            state.pop(key, None)
        return self.state.pop(key, None)

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of optimizer state it holds, by name (memory accounting)."""
        stored = dict(self.state)
        for key, (codes, absmax) in self.quantized_state.items():
            stored.setdefault(key, codes)
            stored[key + "_absmax"] = absmax
        return stored
