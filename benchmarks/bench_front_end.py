"""ShardedOptimizer.step() against the bare fused kernel and the plain-torch composition.

The work: one optimizer step over N bfloat16 parameters (default 100M, in four tensors of odd
sizes) whose bfloat16 gradients were accumulated under a dynamic loss scale; clip to a total
norm of 1.0; AdamW with float32 master weights; write the bfloat16 weights back.

1. memkern front end: ``ShardedOptimizer(..., loss_scale="dynamic", max_grad_norm=1.0).step()``
   (norm pass, a few one-element device ops, one ``adamw_step_`` pass, scaler update).
2. bare kernel: ``memkern.ops.adamw_step_`` alone on buffers of the same size, given a
   ready-made grad multiplier and found_inf: the floor the front end is measured against.
3. plain torch: float32 master parameters; bf16 grads cast into their float32 ``.grad``,
   ``GradScaler.unscale_``, ``clip_grad_norm_(foreach=True)``, ``GradScaler.step`` of
   ``torch.optim.AdamW`` (the faster of ``fused=True`` and ``foreach=True``), ``update()``,
   cast the masters back into the bf16 weights.

Each timed step starts from fresh gradients copied in outside the timer. Times are medians
after warm-up, all measured in this process with the three taking turns in every repetition;
the backend memkern picked is printed.

Usage: python benchmarks/bench_front_end.py [--params N] [--reps R] [--warmup W]
                                            [--threads T] [--device cpu|cuda] [--save PATH]
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

LR, BETAS, EPS, WD, MAX_NORM, SCALE = 1e-4, (0.9, 0.999), 1e-8, 0.01, 1.0, 2.0**16


def bench(n: int, device: torch.device, warmup: int, reps: int) -> dict[str, float]:
    sizes = common.odd_sizes(n)
    weights = [torch.randn(s, device=device) * 0.02 for s in sizes]
    grads = [(torch.randn(s, device=device) * 1e-3 * SCALE).to(torch.bfloat16) for s in sizes]
    cases = {}

    # 1. memkern front end.
    params = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in weights]
    opt = mk.optim.ShardedOptimizer(params, "adamw", lr=LR, betas=BETAS, eps=EPS,
                                    weight_decay=WD, loss_scale="dynamic", max_grad_norm=MAX_NORM)
    # The loss is a leaf that touches no parameter: backward() only opens the window (its
    # cost is not part of step()); the gradients are copied into the buffer untimed.
    leaf = torch.zeros((), device=device, requires_grad=True)

    def prepare_front_end() -> None:
        opt.zero_grad()
        for p, g in zip(params, grads):
            p.grad.copy_(g)
        opt.backward(leaf)

    cases["front_end_s"] = (prepare_front_end, opt.step)

    # 2. The bare kernel on buffers of the same size.
    flat_grads = torch.cat(grads)
    master = torch.cat(weights)
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    model_weights = master.to(torch.bfloat16)
    step = torch.zeros((), device=device)
    multiplier = torch.full((), 1 / SCALE, device=device)
    found_inf = torch.zeros((), device=device)
    cases["bare_kernel_s"] = (common.nothing, lambda: mk.ops.adamw_step_(
        master, exp_avg, exp_avg_sq, flat_grads, model_weights, step, multiplier, found_inf,
        LR, *BETAS, EPS, WD))

    # 3. Plain torch, with each of its two multi-tensor AdamW implementations.
    for flavour in ("fused", "foreach"):
        try:
            cases[f"torch_{flavour}_s"] = torch_composition(weights, grads, flavour, device)
        except RuntimeError as exc:  # fused=True is not available on every device/version
            print(f"  (torch AdamW {flavour}=True unavailable: {exc})")

    result: dict[str, float] = {"params": n}
    times = common.interleaved_times(cases, warmup=warmup, reps=reps, device=device)
    result.update({name: statistics.median(t) for name, t in times.items()})
    assert opt.skipped_steps == 0
    result["torch_s"] = min(v for k, v in result.items() if k.startswith("torch_"))
    result["front_end_over_bare"] = result["front_end_s"] / result["bare_kernel_s"]
    result["torch_over_front_end"] = result["torch_s"] / result["front_end_s"]
    return result


def torch_composition(weights: list[torch.Tensor], grads: list[torch.Tensor], flavour: str,
                      device: torch.device) -> tuple[Callable[[], None], Callable[[], None]]:
    """GradScaler + clip_grad_norm_ + AdamW(fused|foreach) on float32 masters, with the casts
    from the bf16 gradients and back to the bf16 weights."""
    masters = [torch.nn.Parameter(w.clone()) for w in weights]
    for m in masters:
        m.grad = torch.empty_like(m)
    bf16_weights = [w.to(torch.bfloat16) for w in weights]
    opt = torch.optim.AdamW(masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                            **{flavour: True})
    scaler = torch.amp.GradScaler(device.type, init_scale=SCALE)
    scaler.scale(torch.zeros((), device=device))  # creates the scale, as the first loss would

    def step() -> None:
        torch._foreach_copy_([m.grad for m in masters], grads)  # the bf16 -> fp32 cast
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(masters, MAX_NORM, foreach=True)
        scaler.step(opt)
        scaler.update()
        torch._foreach_copy_(bf16_weights, masters)  # cast the masters back

    return common.nothing, step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=100_000_000,
                        help="number of parameters (default 100M)")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int,
                        help="torch CPU threads (default: torch's choice). On a machine shared "
                             "with other jobs, OpenMP barriers make multi-threaded CPU ops "
                             "erratic: --threads 1 gives stable figures")
    parser.add_argument("--save", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.params < 16:
        parser.error(f"--params must be >= 16, got {args.params}")
    device = torch.device(args.device)
    backend = mk.backend.select(device)
    print(f"memkern backend on {device}: {backend}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    r = bench(args.params, device, args.warmup, args.reps)
    print(f"\nOne step over {r['params'] / 1e6:.1f}M bf16 params (fp32 master/m/v), dynamic loss "
          "scale + clipping + AdamW")
    print(f"  bare memkern adamw_step_ kernel   {r['bare_kernel_s'] * 1e3:9.1f} ms")
    print(f"  ShardedOptimizer.step()           {r['front_end_s'] * 1e3:9.1f} ms   "
          f"{r['front_end_over_bare']:.2f}x the bare kernel (target <= 1.2x)")
    for flavour in ("fused", "foreach"):
        if f"torch_{flavour}_s" in r:
            seconds = r[f"torch_{flavour}_s"]
            print(f"  torch composition, AdamW {flavour:7s}  {seconds * 1e3:9.1f} ms")
    print(f"  front end speed-up over the faster torch composition: "
          f"{r['torch_over_front_end']:.2f}x (target >= 1.5x)")
    if args.save:
        common.save(args.save, {"backend": backend, **r})
    return 0


if __name__ == "__main__":
    sys.exit(main())
