"""The host step of offloading: bytes per second of memkern's C++ CPU AdamW, against DeepSpeed's.

``ShardedOptimizer(offload="cpu")`` steps the optimizer on the host: per parameter it reads the
16-bit gradient the GPU sent down, the float32 master and the two moments, and writes the
master, the moments and the new 16-bit weight that goes back up. What that costs a training
step is its bytes over the host's speed at moving them, so every case here is reported in bytes
of state, gradients and weights processed per second, and in parameters per second:

1. memkern, 32-bit state: ``memkern.ops.adamw_step_`` over flat buffers of N parameters, bf16
   gradients and weights, float32 master and moments (28 bytes per parameter: 2 + 12 read,
   12 + 2 written);
2. memkern, 8-bit state: ``memkern.ops.adamw8bit_step_``, the moments in 8-bit codes with a
   float32 absmax per 256 (16 bytes per parameter, 16.03 with the absmax);
3. DeepSpeed's ``DeepSpeedCPUAdam(adamw_mode=True)`` (ZeRO-Offload's host step) on one float32
   tensor of N with a float32 gradient, as ZeRO-Offload runs it (its master is the parameter;
   the 16-bit copy for the GPU is made after it, by the copy that uploads it): 28 bytes per
   parameter (16 read, 12 written) -- the same bytes as case 1 for the same work;
4. ``torch.optim.AdamW(fused=True)`` on the same float32 tensor: torch's own composition.

Each thread count (``--threads``, default 1 and 2) is a separate set of interleaved repetitions
(the cases take turns, so the machine's load falls on all alike); each case is the median with
its range, each ratio the median of per-repetition ratios. DeepSpeed JIT-builds its ``cpu_adam``
op with ninja on first use; if it cannot be imported or built, the case is skipped with the
reason.

Usage: python benchmarks/bench_host_step.py [--params N] [--reps R] [--threads 1,2]
                                            [--save PATH]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import memkern as mk  # noqa: E402
from memkern.kernels.state8bit import num_blocks  # noqa: E402

LR, BETAS, EPS, WD = 1e-4, (0.9, 0.999), 1e-8, 0.01
BYTES_PER_PARAM = {"memkern 32-bit state": 28, "memkern 8-bit state": 16,
                   "DeepSpeedCPUAdam": 28, "torch AdamW(fused=True)": 28}
"""Bytes of state, gradient and weights each case reads and writes per parameter."""
CPU = torch.device("cpu")
Case = tuple[Callable[[], None], Callable[[], object]]


def memkern_32bit(n: int) -> Case:
    grads = torch.randn(n).mul_(1e-3).bfloat16()
    weights = torch.randn(n).mul_(0.02).bfloat16()
    master, m, v, step = weights.float(), torch.zeros(n), torch.zeros(n), torch.zeros(())
    return common.nothing, lambda: mk.ops.adamw_step_(master, m, v, grads, weights, step, None,
                                                      None, LR, *BETAS, EPS, WD)


def memkern_8bit(n: int) -> Case:
    grads = torch.randn(n).mul_(1e-3).bfloat16()
    weights = torch.randn(n).mul_(0.02).bfloat16()
    master, step = weights.float(), torch.zeros(())
    m, v = torch.zeros(n, dtype=torch.int8), torch.zeros(n, dtype=torch.uint8)
    m_absmax, v_absmax = torch.zeros(num_blocks(n)), torch.zeros(num_blocks(n))
    return common.nothing, lambda: mk.ops.adamw8bit_step_(
        master, m, m_absmax, v, v_absmax, grads, weights, step, None, None, LR, *BETAS, EPS, WD)


def _fp32_param(n: int) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.randn(n).mul_(0.02))
    p.grad = torch.randn(n).mul_(1e-3)
    return p


def deepspeed_adam(n: int) -> Case | str:
    """DeepSpeedCPUAdam over one float32 tensor, or why it cannot run here."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as exc:  # ImportError, or deepspeed failing to initialise on this host
        return f"deepspeed is not importable ({type(exc).__name__}: {exc})"
    try:  # the constructor JIT-builds the cpu_adam op (ninja, a C++ compiler) on first use
        opt = DeepSpeedCPUAdam([_fp32_param(n)], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                               adamw_mode=True)
        opt.step()
    except Exception as exc:
        return f"DeepSpeedCPUAdam did not build or run ({type(exc).__name__}: {exc})"
    return common.nothing, opt.step


def torch_fused(n: int) -> Case:
    opt = torch.optim.AdamW([_fp32_param(n)], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                            fused=True)
    return common.nothing, opt.step


def bench(n: int, threads: int, warmup: int, reps: int) -> dict[str, object]:
    torch.set_num_threads(threads)
    cases = {"memkern 32-bit state": memkern_32bit(n), "memkern 8-bit state": memkern_8bit(n),
             "torch AdamW(fused=True)": torch_fused(n)}
    skipped = {}
    deepspeed = deepspeed_adam(n)
    if isinstance(deepspeed, str):
        skipped["DeepSpeedCPUAdam"] = deepspeed
    else:
        cases["DeepSpeedCPUAdam"] = deepspeed
    load = os.getloadavg()[0]
    times = common.interleaved_times(cases, warmup=warmup, reps=reps, device=CPU)
    summary = {}
    for name, t in times.items():
        median = statistics.median(t)
        summary[name] = {"median_s": median, "min_s": min(t), "max_s": max(t),
                         "params_per_s": n / median,
                         "bytes_per_s": BYTES_PER_PARAM[name] * n / median}
    ratios = {}
    if "DeepSpeedCPUAdam" in cases:
        ratios["DeepSpeedCPUAdam time / memkern 32-bit time"] = common.ratio(
            times, "DeepSpeedCPUAdam", "memkern 32-bit state")
        ratios["DeepSpeedCPUAdam time / memkern 8-bit time"] = common.ratio(
            times, "DeepSpeedCPUAdam", "memkern 8-bit state")
    ratios["torch fused time / memkern 32-bit time"] = common.ratio(
        times, "torch AdamW(fused=True)", "memkern 32-bit state")
    return {"threads": threads, "load_average_before": load, "cases": summary,
            "ratios": ratios, "times_s": times, "skipped": skipped}


def report(n: int, r: dict[str, object]) -> None:
    print(f"\nhost step over {n / 1e6:.1f}M parameters, {r['threads']} thread(s), load average "
          f"{r['load_average_before']:.1f} before")
    print(f"  {'case':26s} {'median':>9s} {'min':>9s} {'max':>9s}  {'GB/s':>6s}  {'Mparam/s':>8s}")
    for name, c in r["cases"].items():
        print(f"  {name:26s} {c['median_s'] * 1e3:7.1f}ms {c['min_s'] * 1e3:7.1f}ms "
              f"{c['max_s'] * 1e3:7.1f}ms  {c['bytes_per_s'] / 1e9:6.2f}  "
              f"{c['params_per_s'] / 1e6:8.1f}")
    for name, s in r["ratios"].items():
        print(f"  {name}: {s['median']:.2f}x [{s['min']:.2f}, {s['max']:.2f}]")
    for name, why in r["skipped"].items():
        print(f"  {name}: skipped, {why}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=16_000_000,
                        help="parameters stepped (default 16M)")
    parser.add_argument("--reps", type=int, default=9, help="timed repetitions per thread count")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", default="1,2",
                        help="comma-separated thread counts (default 1,2)")
    parser.add_argument("--save", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    backend = mk.backend.select(CPU)
    if backend != "cpu":
        print(f"warning: memkern runs its {backend!r} backend on CPU, not the C++ kernels")
    runs = []
    for threads in (int(t) for t in args.threads.split(",")):
        runs.append(bench(args.params, threads, args.warmup, args.reps))
        report(args.params, runs[-1])
    if args.save:
        common.save(args.save, {"backend": backend, "params": args.params,
                                "bytes_per_param": BYTES_PER_PARAM, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
