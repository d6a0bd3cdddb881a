"""Host time of ``ShardedOptimizer.step()`` on many tiny parameters, and of the per-step check
that the parameters are still those the optimizer was built with (``_check_params_as_built``).

On 3-element parameters the update itself is negligible: what is timed is the host path,
which grows with the parameter count. Median and minimum of ``--windows`` timed steps (each
after a one-micro-batch window), single-threaded.

    python benchmarks/bench_step_host.py [--params 256] [--windows 200]
"""
from __future__ import annotations

import argparse
import time
import timeit

import torch

import memkern as mk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=256)
    parser.add_argument("--windows", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(args.params)]
    opt = mk.optim.ShardedOptimizer(params, "adamw", lr=1e-3)

    def timed_step() -> float:
        opt.backward(sum(p.sum() for p in params))
        start = time.perf_counter()
        opt.step()
        elapsed = time.perf_counter() - start
        opt.zero_grad()
        return elapsed

    for _ in range(20):
        timed_step()
    steps = sorted(timed_step() for _ in range(args.windows))
    check = min(timeit.repeat(lambda: opt._check_params_as_built("bench"), number=200,
                              repeat=5)) / 200
    print(f"{args.params} parameters: step() median {steps[len(steps) // 2] * 1e6:.0f} us, "
          f"min {steps[0] * 1e6:.0f} us; the parameter check {check * 1e6:.1f} us")


if __name__ == "__main__":
    main()
