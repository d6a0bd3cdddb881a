"""PNG bar charts: memory by component for each configuration."""
from __future__ import annotations

from collections.abc import Sequence

from memkern.bench.runner import Row
from memkern.plot import stacked_bars

COMPONENTS = (
    ("parameters", "params_bytes", "#4c72b0"),
    ("gradients", "grads_bytes", "#55a868"),
    ("master weights", "master_bytes", "#c44e52"),
    ("optimizer state", "optimizer_state_bytes", "#8172b2"),
    ("saved activations", "saved_activation_bytes", "#ccb974"),
)


def memory_chart(rows: Sequence[Row], path: str, title: str) -> None:
    """Stacked bars (MiB) of each row's memory components, with its measured peak marked."""
    mib = 1 << 20
    stacked_bars([r.config for r in rows],
                 [(label, [getattr(r, field) / mib for r in rows], color)
                  for label, field, color in COMPONENTS],
                 [r.peak_bytes / mib for r in rows], "measured peak", path, title)
