"""``memkern report``: predicted per-rank memory of each configuration and world size.

Model-state bytes come from the per-parameter formulas of docs/memory.md (Adam, W ranks);
activations are measured: the bytes one micro-batch's forward saves for backward, for the
torch model under bf16 autocast and for the memkern model with and without checkpointing.
"""
from __future__ import annotations

import dataclasses

import torch

from memkern.bench.configs import build
from memkern.bench.data import Batches
from memkern.bench.model import GPTConfig
from memkern.kernels.state8bit import QBLOCK
from memkern.profile import saved_bytes


@dataclasses.dataclass(frozen=True)
class Plan:
    name: str
    activations_from: str
    """The bench configuration whose forward is measured for the activations."""
    device_bytes_per_param: object
    """W -> bytes per parameter held on each rank's device."""
    host_bytes_per_param: object = lambda w: 0.0
    """W -> bytes per parameter held in each rank's host memory."""


PLANS = (
    Plan("torch AMP (DDP)", "torch-amp", lambda w: 16.0),
    Plan("memkern ZeRO-1", "memkern-full", lambda w: 4 + 12 / w),
    Plan("memkern ZeRO-2", "memkern-full", lambda w: 2 + 14 / w),
    Plan("memkern ZeRO-2 + ckpt", "memkern-full-ckpt", lambda w: 2 + 14 / w),
    # offload: master + m + v (12) and pinned copies of the gradients and weights (2 + 2) of
    # the rank's 1/W; in one process also the copy of the state its early steps keep (12)
    Plan("memkern offload=cpu", "memkern-full", lambda w: 4.0,
         host_bytes_per_param=lambda w: 28.0 if w == 1 else 16 / w),
    # state_precision="8bit": 1 + 1 bytes of m and v codes and 2 x 4 bytes of absmax per QBLOCK
    # elements instead of 8 bytes (parameters of >= 4096 elements; smaller ones stay 8).
    Plan("memkern ZeRO-1 8-bit", "memkern-full-8bit", lambda w: 4 + (6 + 8 / QBLOCK) / w),
    Plan("memkern ZeRO-2 8-bit", "memkern-full-8bit", lambda w: 2 + (8 + 8 / QBLOCK) / w),
)


def measured_activations(cfg: GPTConfig, corpus: torch.Tensor, batch: int,
                         device: torch.device) -> tuple[int, dict[str, int]]:
    """Parameter count and saved bytes of one micro-batch's forward per configuration."""
    x, y = Batches(corpus, batch, cfg.seq, device=device).next()
    saved, num_params = {}, 0
    for name in sorted({p.activations_from for p in PLANS}):
        setup = build(name, cfg, device)
        num_params = sum(p.numel() for p in setup.model.parameters())
        with setup.autocast():
            saved[name] = saved_bytes(setup.model, x, y)
        del setup
    return num_params, saved


def predict(num_params: int, saved: dict[str, int], world_sizes: list[int]) -> list[dict]:
    rows = []
    for plan in PLANS:
        for w in world_sizes:
            state = plan.device_bytes_per_param(w) * num_params
            rows.append({"config": plan.name, "world_size": w,
                         "bytes_per_param": plan.device_bytes_per_param(w),
                         "model_state_bytes": int(state),
                         "activation_bytes": saved[plan.activations_from],
                         "device_bytes": int(state) + saved[plan.activations_from],
                         "host_bytes": int(plan.host_bytes_per_param(w) * num_params)})
    return rows
