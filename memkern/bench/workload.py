"""``memkern bench``'s configurations as workloads of the planner
(:func:`memkern.profile.plan_training_step`)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from memkern.bench.configs import CONFIGS, build
from memkern.bench.model import SIZES, GPTConfig
from memkern.profile.plan import TrainingSetup


def bench_workload(config: str, size: str = "small", *, batch: int = 8, seq: int | None = None,
                   param_dtype: torch.dtype = torch.bfloat16) -> Callable[[], TrainingSetup]:
    """``memkern bench``'s configuration ``config`` (:mod:`memkern.bench.configs`) on its GPT of
    ``size``, ``batch`` sequences of ``seq`` tokens (default: the size's own). A step is the
    bench's ``train_step`` on a fresh batch (the windows of ``memkern.bench.data.Batches``:
    inputs and targets are views of one ``[batch, seq + 1]`` int64 tensor)."""
    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r}; choose from {', '.join(CONFIGS)}")
    if "compiled" in config:
        raise ValueError(f"{config}: torch.compile'd configurations cannot be planned (the "
                         "compiler does not run under the planner's fake tensor mode)")
    if config == "memkern-fit":
        raise ValueError("memkern-fit plans itself: memkern.fit reports its planned peak (or "
                         "run memkern bench --configs memkern-fit --memory-budget ...)")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    base = SIZES[size]
    seq = seq or base.seq
    if seq > base.seq:
        raise ValueError(f"seq={seq} is longer than the {size} model's {base.seq}")
    cfg = GPTConfig(base.layers, base.width, base.heads, seq=seq, vocab=base.vocab)

    def make() -> TrainingSetup:
        setup = build(config, cfg, torch.device("cpu"), param_dtype=param_dtype)

        def step() -> None:
            window = torch.randint(0, cfg.vocab, (batch, seq + 1))
            setup.train_step(window[:, :-1], window[:, 1:])

        return TrainingSetup(setup.model, setup.optimizer, step,
                             f"memkern bench {config}, GPT {size}, batch {batch} x {seq}")

    return make
