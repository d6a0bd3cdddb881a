"""The CPU AdamW step (the offload path's kernel) against torch, DeepSpeed and the copy bandwidth.

All cases run in one process and take turns within every repetition (a shared machine's load
falls on all of them alike); each is reported as median / min / max, and every ratio as the
median of the per-repetition ratios with their range.

fp32: N float32 parameters (default 20M) in four tensors whose sizes are multiples of 64 (with
``--odd-sizes``, four odd sizes: DeepSpeedCPUAdam then took 2-2.7x as long here, see
benchmarks/NOTES.md, so by default no peer pays for a remainder), float32 gradients.
1. ``memkern.optim.FusedAdamW.step()`` (the front end: one ``adamw_step_`` call).
2. ``memkern.ops.adamw_step_`` alone on flat buffers of N (the bare kernel).
3. ``torch.optim.AdamW(fused=True)`` and ``(foreach=True)`` over the same tensors.
4. DeepSpeed's ``DeepSpeedCPUAdam(adamw_mode=True)`` (ZeRO-Offload's SIMD Adam, JIT-built by
   DeepSpeed for the host CPU) when ``deepspeed`` is installed and its op builds; otherwise a
   line says why it was skipped. Not a memkern dependency: ``pip install deepspeed``.
5. A plain copy of the same bytes: the faster of ``dst.copy_(src)`` and an in-place
   ``buf.mul_(1.0)`` over 14 bytes per parameter (14 read + 14 written = 28 bytes, what one AdamW
   step moves per parameter: it reads p, g, m, v and writes p, m, v). Every case's bandwidth is
   28 bytes per parameter over its time, and its share of this copy's.

bf16 with fp32 masters: N bfloat16 parameters and gradients.
6. ``FusedAdamW.step()`` on the bf16 parameters (fp32 master, m, v; the bf16 weights written in
   the same pass: 4+2+4+4 read, 4+4+4+2 written = 28 bytes per parameter).
7. The torch composition of the same work: fp32 master parameters whose ``.grad`` gets the bf16
   gradients cast in, ``AdamW(fused=True)``, the masters cast back into the bf16 weights.

Usage: python benchmarks/bench_cpu_adamw.py [--params N] [--reps R] [--warmup W]
                                            [--threads T] [--odd-sizes] [--save PATH]
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

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
BYTES_PER_PARAM = 28
CPU = torch.device("cpu")
Case = tuple[Callable[[], None], Callable[[], object]]


def tensors(sizes: list[int], dtype: torch.dtype, scale: float = 1.0) -> list[torch.Tensor]:
    return [(torch.randn(s) * scale).to(dtype) for s in sizes]


def with_grads(weights: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return params


def memkern_front_end(weights, grads) -> Case:
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = mk.optim.FusedAdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for p, g in zip(params, grads):
        p.grad.copy_(g)  # p.grad is the optimizer's flat gradient buffer
    return common.nothing, opt.step


def memkern_bare_kernel(n: int) -> Case:
    master, grads = torch.randn(n) * 0.02, torch.randn(n) * 1e-3
    exp_avg, exp_avg_sq, step = torch.zeros(n), torch.zeros(n), torch.zeros(())
    return common.nothing, lambda: mk.ops.adamw_step_(master, exp_avg, exp_avg_sq, grads, None,
                                                      step, None, None, LR, *BETAS, EPS, WD)


def torch_adamw(weights, grads, flavour: str) -> Case:
    opt = torch.optim.AdamW(with_grads(weights, grads), lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WD, **{flavour: True})
    return common.nothing, opt.step


def deepspeed_adamw(weights, grads) -> Case | str:
    """DeepSpeedCPUAdam over the same tensors, or why it cannot run here."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as exc:  # ImportError, or deepspeed failing to initialise on this host
        return f"deepspeed is not importable ({type(exc).__name__}: {exc}); pip install deepspeed"
    params = with_grads(weights, grads)
    try:  # the constructor JIT-builds the cpu_adam op (ninja, a C++ compiler) on first use
        opt = DeepSpeedCPUAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                               adamw_mode=True)
        opt.step()
    except Exception as exc:
        return f"DeepSpeedCPUAdam did not build or run ({type(exc).__name__}: {exc})"
    return common.nothing, opt.step


def plain_copy(n: int) -> dict[str, Case]:
    half = BYTES_PER_PARAM // 2 * n // 4  # float32 elements in 14 bytes per parameter
    src, dst = torch.rand(half), torch.empty(half)
    return {"copy_": (common.nothing, lambda: dst.copy_(src)),
            "in-place mul_(1.0)": (common.nothing, lambda: src.mul_(1.0))}


def memkern_bf16(weights, grads) -> Case:
    params = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in weights]
    opt = mk.optim.FusedAdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for p, g in zip(params, grads):
        p.grad.copy_(g)
    return common.nothing, opt.step


def torch_bf16_composition(weights, grads) -> Case:
    masters = [torch.nn.Parameter(w.clone()) for w in weights]
    for m in masters:
        m.grad = torch.empty_like(m)
    bf16_weights = [w.to(torch.bfloat16) for w in weights]
    opt = torch.optim.AdamW(masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)

    def step() -> None:
        torch._foreach_copy_([m.grad for m in masters], grads)  # the bf16 -> fp32 cast
        opt.step()
        torch._foreach_copy_(bf16_weights, masters)  # cast the masters back

    return common.nothing, step


def summary(times: list[float], n: int, copy_s: float) -> dict[str, float]:
    median = statistics.median(times)
    return {"median_s": median, "min_s": min(times), "max_s": max(times),
            "bytes_per_s": BYTES_PER_PARAM * n / median,
            "share_of_copy_bandwidth": copy_s / median}



def sizes_of(n: int, odd: bool) -> list[int]:
    """Four tensor sizes adding up to n: odd ones, or multiples of 64 (n rounded down)."""
    if odd:
        return common.odd_sizes(n)
    sizes = [s // 64 * 64 for s in common.odd_sizes(n)[:3]]
    return sizes + [n // 64 * 64 - sum(sizes)]


def bench(n: int, warmup: int, reps: int, odd: bool) -> dict[str, object]:
    sizes = sizes_of(n, odd)
    n = sum(sizes)
    weights = tensors(sizes, torch.float32, 0.02)
    grads32 = tensors(sizes, torch.float32, 1e-3)
    grads16 = [g.to(torch.bfloat16) for g in grads32]

    cases: dict[str, Case] = {
        "memkern FusedAdamW.step()": memkern_front_end(weights, grads32),
        "memkern adamw_step_ (bare kernel)": memkern_bare_kernel(n),
        "torch AdamW(fused=True)": torch_adamw(weights, grads32, "fused"),
        "torch AdamW(foreach=True)": torch_adamw(weights, grads32, "foreach"),
    }
    skipped = {}
    deepspeed = deepspeed_adamw(weights, grads32)
    if isinstance(deepspeed, str):
        skipped["DeepSpeedCPUAdam"] = deepspeed
        print(f"skipping DeepSpeedCPUAdam: {deepspeed}")
    else:
        cases["DeepSpeedCPUAdam"] = deepspeed
    copies = plain_copy(n)
    cases.update(copies)
    cases["memkern FusedAdamW.step() bf16"] = memkern_bf16(weights, grads16)
    cases["torch bf16 composition"] = torch_bf16_composition(weights, grads16)

    times = common.interleaved_times(cases, warmup=warmup, reps=reps, device=CPU)
    copy_s = min(statistics.median(times[name]) for name in copies)
    result: dict[str, object] = {
        "params": n, "sizes": sizes, "threads": torch.get_num_threads(), "reps": reps,
        "bytes_per_param": BYTES_PER_PARAM, "copy_bytes_per_s": BYTES_PER_PARAM * n / copy_s,
        "cases": {name: summary(t, n, copy_s) for name, t in times.items()},
        "times_s": times, "skipped": skipped,
    }
    memkern = "memkern FusedAdamW.step()"
    speedups = {"over torch fused": common.ratio(times, "torch AdamW(fused=True)", memkern),
                "over torch foreach": common.ratio(times, "torch AdamW(foreach=True)", memkern),
                "bare kernel time / step() time": common.ratio(
                    times, "memkern adamw_step_ (bare kernel)", memkern),
                "bf16 over torch composition": common.ratio(
                    times, "torch bf16 composition", "memkern FusedAdamW.step() bf16")}
    if "DeepSpeedCPUAdam" in cases:
        speedups["over DeepSpeedCPUAdam"] = common.ratio(times, "DeepSpeedCPUAdam", memkern)
    result["speedups"] = speedups
    return result


def report(r: dict[str, object]) -> None:
    n = r["params"]
    print(f"\nAdamW step over {n / 1e6:.1f}M params {r['sizes']}, {r['threads']} threads, "
          f"{r['reps']} interleaved repetitions; {BYTES_PER_PARAM} B/param moved; copy "
          f"bandwidth of the same bytes in this run: {r['copy_bytes_per_s'] / 1e9:.1f} GB/s")
    print(f"  {'case':36s} {'median':>8s} {'min':>8s} {'max':>8s}   {'GB/s':>6s}  of copy")
    for name, c in r["cases"].items():
        print(f"  {name:36s} {c['median_s'] * 1e3:6.1f}ms {c['min_s'] * 1e3:6.1f}ms "
              f"{c['max_s'] * 1e3:6.1f}ms   {c['bytes_per_s'] / 1e9:6.1f}  "
              f"{c['share_of_copy_bandwidth']:6.0%}")
    targets = {"over torch fused": ">= 1.2x", "over DeepSpeedCPUAdam": ">= 1.2x",
               "bf16 over torch composition": "keep the lead (2.3x before)"}
    print("  memkern FusedAdamW.step() speed-up, median of per-repetition ratios [min, max]:")
    for name, s in r["speedups"].items():
        target = f"   target {targets[name]}" if name in targets else ""
        print(f"    {name:30s} {s['median']:5.2f}x  [{s['min']:.2f}, {s['max']:.2f}]{target}")
    for name, why in r["skipped"].items():
        print(f"  {name}: skipped, {why}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=20_000_000,
                        help="number of parameters (default 20M)")
    parser.add_argument("--reps", type=int, default=11, help="timed repetitions")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: all)")
    parser.add_argument("--odd-sizes", action="store_true",
                        help="four tensors of odd sizes instead of multiples of 64")
    parser.add_argument("--save", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.params < 64:
        parser.error(f"--params must be >= 64, got {args.params}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    backend = mk.backend.select(CPU)
    if backend != "cpu":
        print(f"warning: memkern runs its {backend!r} backend on CPU, not the C++ kernels")
    r = bench(args.params, args.warmup, args.reps, args.odd_sizes)
    report(r)
    if args.save:
        common.save(args.save, {"backend": backend, **r})
    return 0


if __name__ == "__main__":
    sys.exit(main())
