"""Flat-buffer kernels against the strongest plain-torch composition of the same work.

1. The mixed-precision AdamW step: bf16 grads in; fp32 master, exp_avg, exp_avg_sq; bf16 params
   out; unscale, clip coefficient and inf check inside. memkern: one read-only norm pass
   (``l2_norm``, whose non-finiteness is the inf check) + one fused ``adamw_step_`` pass.
   torch: grads to fp32, ``_amp_foreach_non_finite_check_and_unscale_``, ``clip_grad_norm_``,
   ``AdamW(fused=True)`` on the fp32 master given ``found_inf`` as GradScaler does (no host
   sync), copy back to bf16 — all on one flat buffer, torch's fastest layout. Also the
   ``adamw_step_`` kernel alone. Each as a fraction of the measured copy bandwidth, counting
   the bytes the work must move (target for the step: >= 80%).
2. 8-bit optimizer state: ``adamw8bit_step_`` / ``adamw_step_`` and ``sgd8bit_step_`` /
   ``sgd_step_`` on the device's default backend, fp32 params and bf16 params with an fp32
   master (target: <= 1.1x). ``bench_8bit_state.py --sections step`` has the same pairs
   timed as a waiting caller sees them, on the Triton backend too.
3. Unscale + inf check of one flat buffer against torch's foreach kernel over the same data cut
   into GPT-2-small's parameter shapes.
4. The L2 norm of one flat buffer against ``clip_grad_norm_``'s foreach norm over that list.

GPU times are ``common.device_seconds``: CUDA events over back-to-back calls, what the work
costs the GPU while the host runs ahead (as in training), the copy measured the same way.

Usage: python benchmarks/bench_kernels.py [--adam-params N] [--state8-params N]
       [--device cpu|cuda] [--save PATH]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_8bit_state  # noqa: E402
import common  # noqa: E402
import memkern  # noqa: E402

BETAS, LR, EPS, WD, MAX_NORM = (0.9, 0.999), 1e-4, 1e-8, 0.01, 1.0
STEP_TARGET = 0.8
"""The AdamW step's target fraction of the copy bandwidth on a GPU."""
RATIO_TARGET = 1.1
"""The 8-bit steps' target time relative to their 32-bit steps."""


def gpt2_small_shapes(vocab: int = 50257, ctx: int = 1024, width: int = 768, layers: int = 12):
    """The parameter shapes of GPT-2 small (124M parameters), in model order."""
    shapes = [(vocab, width), (ctx, width)]
    for _ in range(layers):
        shapes += [(width,), (width,), (width, 3 * width), (3 * width,), (width, width), (width,),
                   (width,), (width,), (width, 4 * width), (4 * width,), (4 * width, width),
                   (width,)]
    return shapes + [(width,), (width,)]


def bench_adamw(n: int, device: torch.device) -> dict[str, float]:
    grads = (torch.randn(n, device=device) * 1e-3 * 65536).to(torch.bfloat16)
    inv_scale = torch.full((1,), 1 / 65536, device=device)
    master = torch.randn(n, device=device)

    # memkern: norm pass, a few scalar ops on the device, one fused step pass.
    mk_master, mk_params = master.clone(), master.to(torch.bfloat16)
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    step = torch.zeros(1, device=device)

    def memkern_step() -> None:
        norm = memkern.ops.l2_norm(grads)
        found_inf = (~torch.isfinite(norm)).float().reshape(1)
        clip = torch.clamp(MAX_NORM / (norm * inv_scale + 1e-6), max=1.0)
        memkern.ops.adamw_step_(mk_master, exp_avg, exp_avg_sq, grads, mk_params, step,
                                inv_scale * clip, found_inf, LR, *BETAS, EPS, WD)

    # torch: the same work with torch's fused pieces.
    torch_master = torch.nn.Parameter(master.clone())
    torch_params = master.to(torch.bfloat16)
    opt = torch.optim.AdamW([torch_master], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                            fused=True)
    found_inf = torch.zeros((), device=device)  # 0-dim, as GradScaler keeps it

    def torch_step() -> None:
        grads32 = grads.float()
        found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_([grads32], found_inf,
                                                         inv_scale.reshape(()))
        torch_master.grad = grads32
        torch.nn.utils.clip_grad_norm_([torch_master], MAX_NORM, foreach=True)
        opt.found_inf, opt.grad_scale = found_inf, None  # what GradScaler.step hands over
        opt.step()
        torch_params.copy_(torch_master)

    def kernel_alone() -> None:
        memkern.ops.adamw_step_(mk_master, exp_avg, exp_avg_sq, grads, mk_params, step,
                                multiplier, no_inf, LR, *BETAS, EPS, WD)

    multiplier, no_inf = inv_scale.clone(), torch.zeros(1, device=device)
    t_memkern = common.device_seconds(memkern_step, device=device)
    t_kernel = common.device_seconds(kernel_alone, device=device)
    t_torch = common.device_seconds(torch_step, device=device)
    # the step kernel reads g, w, m, v and writes w, m, v, p; the whole step also reads g for
    # the norm
    kernel_bytes = n * (2 + 3 * 4 + 3 * 4 + 2)
    return {"params": n, "memkern_s": t_memkern, "kernel_s": t_kernel, "torch_s": t_torch,
            "speedup": t_torch / t_memkern,
            "memkern_bytes_per_s": (kernel_bytes + 2 * n) / t_memkern,
            "kernel_bytes_per_s": kernel_bytes / t_kernel}


def bench_state8(n: int, device: torch.device) -> dict[str, dict[str, float]]:
    """The 8-bit steps against their 32-bit steps (``bench_8bit_state``'s pairs), each timed
    alone as ``device_seconds``: time ratio and fractions of the copy bandwidth counting the
    bytes each moves."""
    out = {}
    for optimizer, pair, (state32, state8) in (
            ("adamw", bench_8bit_state.adamw_steps, bench_8bit_state.ADAMW_STATE_BYTES),
            ("sgd", bench_8bit_state.sgd_steps, bench_8bit_state.SGD_STATE_BYTES)):
        for dtype in (torch.float32, torch.bfloat16):
            step32, step8 = pair(n, device, dtype)
            t32 = common.device_seconds(step32, device=device)
            t8 = common.device_seconds(step8, device=device)
            moved = bench_8bit_state.step_bytes(dtype)
            out[f"{optimizer} {str(dtype).replace('torch.', '')} params"] = {
                "elements": n, "state32_s": t32, "state8_s": t8, "ratio": t8 / t32,
                "state32_bytes_per_s": (moved + state32) * n / t32,
                "state8_bytes_per_s": (moved + state8) * n / t8}
            del step32, step8
    return out


def _torch_unscale(views: list[torch.Tensor], found_inf: torch.Tensor):
    """torch's fastest unscale + inf check of ``views`` on this build, and what it is.

    ``_amp_foreach_non_finite_check_and_unscale_`` (GradScaler's kernel) where torch has it for
    this dtype and device (torch 2.11 has no bfloat16 CUDA kernel); otherwise the inf check from
    a foreach norm (inf and NaN propagate into it) and a foreach multiply."""
    probe = [torch.ones(2, dtype=views[0].dtype, device=views[0].device)]
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(probe, torch.zeros_like(found_inf),
                                                         torch.ones_like(found_inf))
    except (NotImplementedError, RuntimeError) as exc:
        print(f"torch {torch.__version__}: GradScaler's unscale kernel does not take "
              f"{views[0].dtype} on {views[0].device} ({str(exc).splitlines()[0][:80]}); "
              "comparing with _foreach_norm + _foreach_mul_")

        def composed(scale: torch.Tensor) -> None:
            norms = torch.stack(torch._foreach_norm(views))
            found_inf.copy_((~norms.isfinite().all()).float())
            # a 0-dim scale: torch 2.11 refuses a 1-element one here (the H200 run crashed)
            torch._foreach_mul_(views, scale.reshape(()))

        return composed, "_foreach_norm + _foreach_mul_"
    return (lambda scale: torch._amp_foreach_non_finite_check_and_unscale_(views, found_inf, scale),
            "_amp_foreach_non_finite_check_and_unscale_")


def bench_unscale(dtype: torch.dtype, device: torch.device) -> dict[str, float]:
    shapes = gpt2_small_shapes()
    n = sum(torch.Size(s).numel() for s in shapes)
    flat = torch.randn(n, device=device).to(dtype)
    views = [t.view(s) for t, s in zip(flat.split([torch.Size(s).numel() for s in shapes]), shapes)]
    # Alternate x0.5 and x2 so repeated runs neither drift to denormals nor overflow.
    scales = [torch.full((1,), s, device=device) for s in (0.5, 2.0)]
    found_inf = torch.zeros(1, device=device)
    turn = [0]

    def next_scale() -> torch.Tensor:
        turn[0] ^= 1
        return scales[turn[0]]

    t_memkern = common.device_seconds(lambda: memkern.ops.unscale_(flat, found_inf, next_scale()),
                                      device=device)
    torch_unscale, torch_path = _torch_unscale(views, found_inf)
    t_torch = common.device_seconds(lambda: torch_unscale(next_scale()), device=device)
    t_norm_memkern = common.device_seconds(lambda: memkern.ops.l2_norm(flat), device=device)
    t_norm_torch = common.device_seconds(
        lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(views))), device=device)
    size = flat.element_size()
    return {"dtype": str(dtype).replace("torch.", ""), "params": n, "tensors": len(shapes),
            "unscale_torch_path": torch_path,
            "unscale_memkern_s": t_memkern, "unscale_torch_s": t_torch,
            "unscale_speedup": t_torch / t_memkern,
            "unscale_memkern_bytes_per_s": 2 * size * n / t_memkern,
            "norm_memkern_s": t_norm_memkern, "norm_torch_s": t_norm_torch,
            "norm_speedup": t_norm_torch / t_norm_memkern,
            "norm_memkern_bytes_per_s": size * n / t_norm_memkern}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--adam-params", type=int, default=24_000_011,
                        help="flat buffer length for the AdamW step (default 24M, odd)")
    parser.add_argument("--state8-params", type=int, default=None,
                        help="flat buffer length for the 8-bit steps (default: 100M on a GPU, "
                             "8M on the CPU; odd)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--save", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.adam_params < 1:
        parser.error(f"--adam-params must be >= 1, got {args.adam_params}")
    if args.state8_params is not None and args.state8_params < 1:
        parser.error(f"--state8-params must be >= 1, got {args.state8_params}")
    device = torch.device(args.device)
    state8_params = args.state8_params or (100_000_007 if device.type == "cuda" else 8_000_011)
    backend = memkern.backend.select(device)
    copy_bw = common.copy_bandwidth(device)
    print(f"memkern backend on {device}: {backend}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; measured copy bandwidth {copy_bw / 1e9:.1f} GB/s")

    adam = bench_adamw(args.adam_params, device)
    print(f"\nAdamW step, bf16 grads/params + fp32 master/m/v, unscale+clip+inf check, "
          f"{adam['params'] / 1e6:.1f}M params")
    print(f"  torch composition  {adam['torch_s'] * 1e3:9.2f} ms")
    print(f"  memkern fused      {adam['memkern_s'] * 1e3:9.2f} ms   "
          f"speed-up {adam['speedup']:.2f}x   "
          f"{adam['memkern_bytes_per_s'] / copy_bw:.0%} of copy bandwidth "
          f"(norm pass + step, 30 B/param; target >= {STEP_TARGET:.0%} on a GPU)")
    print(f"  adamw_step_ alone  {adam['kernel_s'] * 1e3:9.2f} ms   "
          f"{adam['kernel_bytes_per_s'] / copy_bw:.0%} of copy bandwidth (28 B/param)")

    state8 = bench_state8(state8_params, device)
    print(f"\n8-bit / 32-bit optimizer state, {state8_params / 1e6:.1f}M elements, "
          f"backend {backend} (target <= {RATIO_TARGET}x)")
    for name, row in state8.items():
        print(f"  {name:<22} 32-bit {row['state32_s'] * 1e3:8.3f} ms "
              f"({row['state32_bytes_per_s'] / copy_bw:.0%} of copy)   8-bit "
              f"{row['state8_s'] * 1e3:8.3f} ms ({row['state8_bytes_per_s'] / copy_bw:.0%})   "
              f"{row['ratio']:.2f}x")

    unscale = [bench_unscale(dtype, device) for dtype in (torch.float32, torch.bfloat16)]
    for row in unscale:
        print(f"\nGPT-2 small gradients ({row['params'] / 1e6:.1f}M in {row['tensors']} tensors), "
              f"{row['dtype']}")
        print(f"  unscale+check: torch ({row['unscale_torch_path']}) "
              f"{row['unscale_torch_s'] * 1e3:8.2f} ms, "
              f"memkern flat {row['unscale_memkern_s'] * 1e3:8.2f} ms   "
              f"speed-up {row['unscale_speedup']:.2f}x   "
              f"{row['unscale_memkern_bytes_per_s'] / copy_bw:.0%} of copy bandwidth")
        print(f"  L2 norm:       torch foreach {row['norm_torch_s'] * 1e3:8.2f} ms, "
              f"memkern flat {row['norm_memkern_s'] * 1e3:8.2f} ms   "
              f"speed-up {row['norm_speedup']:.2f}x   "
              f"{row['norm_memkern_bytes_per_s'] / copy_bw:.0%} of copy bandwidth")
    if args.save:
        common.save(args.save, {"backend": backend, "copy_bytes_per_s": copy_bw,
                                "adamw": adam, "state8": state8, "unscale_and_norm": unscale})
    return 0


if __name__ == "__main__":
    sys.exit(main())
