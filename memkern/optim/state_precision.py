"""The optimizer state's precision: float32 moments, or moments stored block-wise in 8 bits
(``state_precision="8bit"``; the format, its block size and its accuracy are in
:mod:`memkern.ops.adamw8bit`). A :class:`~memkern.optim.segment.Segment` says which
(``quantized``); whichever part steps it, the update rule's 8-bit kernel reads and writes its
``quantized_state``. For checkpoints, which read and write float32 per-parameter state, 8-bit
moments are shown as float32 state for a while (:func:`show_as_float32`, :func:`hide_float32`).
"""
from __future__ import annotations

from typing import Any

import torch

from memkern.ops import adamw8bit
from memkern.optim.segment import Segment

STATE_PRECISIONS = ("32bit", "8bit")
"""The ``state_precision`` options of the optimizers: float32 state, or block-wise 8 bits."""
MIN_8BIT_NUMEL = 4096
"""With ``state_precision="8bit"``, parameters with fewer elements keep float32 state, as
bitsandbytes' ``min_8bit_size`` does: biases and norm weights save next to nothing in 8 bits."""


def check_state_precision(algorithm: str, precision: Any, where: str = "") -> str:
    """``precision`` if it is one of :data:`STATE_PRECISIONS`, else a ValueError naming it."""
    if precision not in STATE_PRECISIONS:
        raise ValueError(f"memkern {algorithm}: {where}state_precision must be one of "
                         f"{STATE_PRECISIONS}, got state_precision={precision!r}")
    return precision


def wants_8bit_state(algorithm: str, p: torch.Tensor, group: dict[str, Any]) -> bool:
    """Whether ``p``'s state is kept in 8 bits: its param group says ``state_precision="8bit"``
    and it has at least :data:`MIN_8BIT_NUMEL` elements."""
    precision = check_state_precision(algorithm, group.get("state_precision", "32bit"),
                                      "a param group's ")
    return precision == "8bit" and p.numel() >= MIN_8BIT_NUMEL


def make_moments(seg: Segment, algorithm: Any, group: dict[str, Any]) -> None:
    """Zero moments for ``seg`` in its precision: the update rule's 8-bit codes and absmax, or
    its float32 state (``algorithm``: an :class:`~memkern.optim.flat_state.Algorithm`)."""
    seg.quantized_state = {}
    if seg.quantized:
        seg.quantized_state = algorithm.zero_quantized_state(seg.weights, group)
        return
    for key in algorithm.state_keys(group):
        seg.add_state(key, torch.zeros_like(seg.weights, dtype=torch.float32))


def show_as_float32(segments: list[Segment]) -> None:
    """Every 8-bit moment also as float32 state (``seg.state`` and the per-parameter views),
    read back from its codes."""
    for seg in segments:
        for key, (codes, absmax) in seg.quantized_state.items():
            seg.add_state(key, adamw8bit.dequantize(codes, absmax, torch.float32))


def hide_float32(segments: list[Segment], write_back: bool) -> None:
    """Drops the float32 views of the 8-bit moments, first quantizing them back into the codes
    when ``write_back`` (a load). Requantizing values read from the codes gives the same codes,
    so saving and loading is exact."""
    for seg in segments:
        for key, (codes, absmax) in seg.quantized_state.items():
            flat = seg.drop_state(key)
            if write_back and flat is not None:
                adamw8bit.quantize(flat, codes, absmax)
