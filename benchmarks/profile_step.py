"""Where a ``memkern bench`` configuration's step spends its host time: torch.compile's
recompilations and graph breaks over the run, then the profiler's operators of a few steps
sorted by their own host (CPU) time, and the GPU kernels by theirs.

For a configuration that ``memkern bench`` reports host-bound (its host time per step above
its GPU time), this names the operators and Python calls that issue it.

    python benchmarks/profile_step.py [--device cuda] [--config memkern-full] [--compile]
        [--size gpt2-small] [--batch 8] [--steps 8] [--profiled 2] [--top 30]
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from memkern.bench.configs import CONFIGS, build
from memkern.bench.data import Batches, stdlib_corpus
from memkern.bench.model import SIZES


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", default="memkern-full", choices=sorted(CONFIGS))
    parser.add_argument("--compile", action="store_true",
                        help="the memkern configurations' forward under torch.compile")
    parser.add_argument("--size", default="gpt2-small", choices=sorted(SIZES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="steps before profiling")
    parser.add_argument("--profiled", type=int, default=2, help="steps profiled")
    parser.add_argument("--top", type=int, default=30, help="rows per table")
    args = parser.parse_args()
    device = torch.device(args.device)
    cfg = SIZES[args.size]
    setup = build(args.config, cfg, device, compile=args.compile)
    batches = Batches(stdlib_corpus(), args.batch, cfg.seq, device=device)
    times = []
    for _ in range(args.steps):
        x, y = batches.next()
        _sync(device)
        start = time.perf_counter()
        setup.train_step(x, y)
        _sync(device)
        times.append(time.perf_counter() - start)
    print(f"{args.config}{'+compile' if args.compile else ''} on {device}: step times (ms) "
          + " ".join(f"{t * 1e3:.1f}" for t in times))
    from torch._dynamo.utils import counters
    for group in ("recompiles", "graph_break", "frames", "stats"):
        if counters.get(group):
            print(f"dynamo {group}: {dict(counters[group])}")
    pending = [batches.next() for _ in range(args.profiled)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        for x, y in pending:
            setup.train_step(x, y)
        _sync(device)
    events = prof.key_averages()
    print(f"\nper {args.profiled} profiled steps, by own host time:")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=70))
    if device.type == "cuda":
        print("\nby own GPU time:")
        print(events.table(sort_by="self_cuda_time_total", row_limit=args.top,
                           max_name_column_width=70))


if __name__ == "__main__":
    main()
