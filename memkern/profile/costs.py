"""What a memory-saving configuration costs in time, on paper: from FLOPs, bytes moved and rates.

``memkern fit`` chooses the cheapest configuration that fits; a configuration's cost is the time
it adds to a training step over the step with everything on the GPU and nothing recomputed.
The parts, each from the plan of the configuration (:class:`memkern.profile.StepPlan`) and a
rate:

=====================  ==========================================================================
recomputation          the FLOPs it adds (the plan's FLOP count less the baseline's) at the GPU's
                       throughput; never hidden
host step              ``offload="cpu"``: the optimizer step on the host, ``params / rate`` (the
                       rate: the C++ CPU kernel's parameters per second, measured on this machine
                       by :func:`host_step_rate`, for the state's precision), times
                       :data:`SPECULATION_FACTOR` for the state copies of the speculative steps
gradients down,        the 16-bit gradients to the host and the new 16-bit weights back, at
weights up             :data:`PCIE_BYTES_PER_S` each way
activations            a checkpoint that offloads blocks' inputs: the bytes it keeps on the host,
                       down in forward and up in backward, at the same rate
=====================  ==========================================================================

What hides: the host steps, and the gradients' way down, run during the window's last backward
(:mod:`memkern.optim.offload`): ``max(host step, gradients down) - backward`` shows, where the
backward's time is two thirds of the step's compute (a GEMM's backward is two GEMMs of its
forward's size). The weights go up in ``step()``, before the next forward: all of it shows.
Activations move on a side stream while the GPU computes: what exceeds the forward (down) and
the backward (up) shows. With clipping that bites every window the host steps wait for the
global norm and none of them hides; this model assumes windows that are not clipped.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

PCIE_BYTES_PER_S = 25e9
"""Pinned host <-> GPU copies, each direction, assumed (no GPU here to measure): PCIe 4.0 x16
carries 31.5 GB/s per direction after its 128b/130b encoding, and pinned ``cudaMemcpyAsync``
reaches about 80% of it. An H100 SXM's PCIe 5.0 link doubles both."""

SPECULATION_FACTOR = {"32bit": 1 + 24 / 28, "8bit": 1 + 12 / 16}
"""The host's work per speculative step over a plain step: the step moves 28 bytes per
parameter with 32-bit state (reads the 16-bit gradient, the master and both moments; writes
them and the 16-bit weight) and 16 with 8-bit state; the copy of the state kept to undo it
reads and writes the master and the moments once more (24 and 12 bytes); time is taken to
follow bytes. (The 32-bit step is memory bound; the 8-bit one, whose quantisation costs
arithmetic, ran at 0.8-0.9x the 32-bit one's parameters per second on a 2-core EPYC:
``benchmarks/bench_host_step.py``, so for it this overstates the copies' share.)"""

BACKWARD_SHARE = 2 / 3
"""The backward's share of a step's GEMM FLOPs (two GEMMs per forward GEMM)."""


def host_step_rate(state_precision: str = "32bit", numel: int = 1 << 22, reps: int = 5) -> float:
    """Parameters per second of memkern's C++ CPU AdamW step on this machine, with its current
    threads: bf16 gradients and weights, float32 masters, 32-bit or 8-bit moments (the host step
    of ``offload="cpu"``). The median of ``reps`` steps over ``numel`` parameters."""
    from memkern import ops
    from memkern.kernels.state8bit import num_blocks

    grads = torch.randn(numel).mul_(1e-3).bfloat16()
    weights = torch.randn(numel).bfloat16()
    master, step = weights.float(), torch.zeros(())
    if state_precision == "8bit":
        blocks = num_blocks(numel)
        m, v = torch.zeros(numel, dtype=torch.int8), torch.zeros(numel, dtype=torch.uint8)
        m_absmax, v_absmax = torch.zeros(blocks), torch.zeros(blocks)

        def run() -> None:
            ops.adamw8bit_step_(master, m, m_absmax, v, v_absmax, grads, weights, step, None,
                                None, 1e-4, 0.9, 0.999, 1e-8, 0.01)
    else:
        m, v = torch.zeros(numel), torch.zeros(numel)

        def run() -> None:
            ops.adamw_step_(master, m, v, grads, weights, step, None, None, 1e-4, 0.9, 0.999,
                            1e-8, 0.01)
    run()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return numel / sorted(times)[len(times) // 2]


@dataclasses.dataclass(frozen=True)
class Rates:
    """The rates a configuration's time is estimated at (see the module docstring)."""

    flops_per_s: float
    """The GPU's throughput for GEMMs of the model's sizes."""
    host_params_per_s: Callable[[str], float]
    """The host step's parameters per second for a state precision ("32bit", "8bit"), asked
    for only when a configuration steps on the host (measuring it takes a moment)."""
    pcie_bytes_per_s: float = PCIE_BYTES_PER_S


@dataclasses.dataclass
class StepCost:
    """The time a configuration adds to a step (seconds), by part, and what of it shows."""

    recompute: float = 0.0
    host_step: float = 0.0
    transfers: float = 0.0
    """PCIe time: gradients down, weights up, activations both ways."""
    exposed: float = 0.0
    """What the step takes longer: recomputation plus what of the rest does not hide."""

    def describe(self) -> str:
        parts = [f"recomputation {self.recompute * 1e3:.0f} ms"] if self.recompute else []
        if self.host_step:
            parts.append(f"host step {self.host_step * 1e3:.0f} ms")
        if self.transfers:
            parts.append(f"PCIe copies {self.transfers * 1e3:.0f} ms")
        hidden = self.recompute + self.host_step + self.transfers - self.exposed
        tail = f" ({hidden * 1e3:.0f} ms of it behind the GPU's work)" if hidden >= 5e-4 else ""
        return f"about {self.exposed * 1e3:.0f} ms per step: " + ", ".join(parts) + tail


def step_cost(*, step_flops: int, extra_flops: int, num_params: int, offload: bool,
              state_precision: str, weight_bytes: int, offloaded_activations: int,
              rates: Rates) -> StepCost:
    """The cost of one configuration (see the module docstring). ``step_flops``: the
    configuration's step, recomputation included; ``extra_flops``: what its recomputation
    adds; ``weight_bytes``: the bytes of one copy of the 16-bit weights (and of the gradients);
    ``offloaded_activations``: the bytes of blocks' inputs kept on the host."""
    recompute = extra_flops / rates.flops_per_s
    compute = (step_flops - extra_flops) / rates.flops_per_s
    forward, backward = compute * (1 - BACKWARD_SHARE), compute * BACKWARD_SHARE
    cost = StepCost(recompute=recompute, exposed=recompute)
    if offload:
        cost.host_step = (num_params / rates.host_params_per_s(state_precision)
                          * SPECULATION_FACTOR[state_precision])
        down = up = weight_bytes / rates.pcie_bytes_per_s
        cost.transfers += down + up
        cost.exposed += max(0.0, max(cost.host_step, down) - backward) + up
    if offloaded_activations:
        move = offloaded_activations / rates.pcie_bytes_per_s
        cost.transfers += 2 * move
        cost.exposed += max(0.0, move - forward) + max(0.0, move - backward)
    return cost
