"""Flat-buffer kernels against the strongest plain-torch composition of the same work.

1. The mixed-precision AdamW step: bf16 grads in; fp32 master, exp_avg, exp_avg_sq; bf16 params
   out; unscale, clip coefficient and inf check inside. memkern: one read-only norm pass
   (``l2_norm``, whose non-finiteness is the inf check) + one fused ``adamw_step_`` pass.
   torch: grads to fp32, ``_amp_foreach_non_finite_check_and_unscale_``, ``clip_grad_norm_``,
   ``AdamW(fused=True)`` on the fp32 master given ``found_inf`` as GradScaler does (no host
   sync), copy back to bf16 — all on one flat buffer, torch's fastest layout.
2. Unscale + inf check of one flat buffer against torch's foreach kernel over the same data cut
   into GPT-2-small's parameter shapes.
3. The L2 norm of one flat buffer against ``clip_grad_norm_``'s foreach norm over that list.

Usage: python benchmarks/bench_kernels.py [--adam-params N] [--device cpu|cuda] [--save PATH]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import memkern  # noqa: E402

BETAS, LR, EPS, WD, MAX_NORM = (0.9, 0.999), 1e-4, 1e-8, 0.01, 1.0


def gpt2_small_shapes(vocab: int = 50257, ctx: int = 1024, width: int = 768, layers: int = 12):
    """The parameter shapes of GPT-2 small (124M parameters), in model order."""
    shapes = [(vocab, width), (ctx, width)]
    for _ in range(layers):
        shapes += [(width,), (width,), (width, 3 * width), (3 * width,), (width, width), (width,),
                   (width,), (width,), (width, 4 * width), (4 * width,), (4 * width, width), (width,)]
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

    t_memkern = common.median_seconds(memkern_step, device=device)
    t_torch = common.median_seconds(torch_step, device=device)
    bytes_moved = n * (2 + 2 + 3 * 4 + 3 * 4 + 2)  # norm read; step reads g,w,m,v, writes w,m,v,p
    return {"params": n, "memkern_s": t_memkern, "torch_s": t_torch,
            "speedup": t_torch / t_memkern, "memkern_bytes_per_s": bytes_moved / t_memkern}


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
            # a 0-dim tensor: the one-element scale the memkern op reads is refused as a
            # "scalar tensor" with 1 dimension (torch 2.11 on CUDA)
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

    t_memkern = common.median_seconds(lambda: memkern.ops.unscale_(flat, found_inf, next_scale()),
                                      device=device)
    torch_unscale, torch_path = _torch_unscale(views, found_inf)
    t_torch = common.median_seconds(lambda: torch_unscale(next_scale()), device=device)
    t_norm_memkern = common.median_seconds(lambda: memkern.ops.l2_norm(flat), device=device)
    t_norm_torch = common.median_seconds(
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
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--save", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.adam_params < 1:
        parser.error(f"--adam-params must be >= 1, got {args.adam_params}")
    device = torch.device(args.device)
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
          f"{adam['memkern_bytes_per_s'] / copy_bw:.0%} of copy bandwidth")

    unscale = [bench_unscale(dtype, device) for dtype in (torch.float32, torch.bfloat16)]
    for row in unscale:
        print(f"\nGPT-2 small gradients ({row['params'] / 1e6:.1f}M in {row['tensors']} tensors), "
              f"{row['dtype']}")
        print(f"  unscale+check: torch ({row['unscale_torch_path']}) {row['unscale_torch_s'] * 1e3:8.2f} ms, "
              f"memkern flat {row['unscale_memkern_s'] * 1e3:8.2f} ms   "
              f"speed-up {row['unscale_speedup']:.2f}x   "
              f"{row['unscale_memkern_bytes_per_s'] / copy_bw:.0%} of copy bandwidth")
        print(f"  L2 norm:       torch foreach {row['norm_torch_s'] * 1e3:8.2f} ms, "
              f"memkern flat {row['norm_memkern_s'] * 1e3:8.2f} ms   "
              f"speed-up {row['norm_speedup']:.2f}x   "
              f"{row['norm_memkern_bytes_per_s'] / copy_bw:.0%} of copy bandwidth")
    if args.save:
        common.save(args.save, {"backend": backend, "copy_bytes_per_s": copy_bw,
                                "adamw": adam, "unscale_and_norm": unscale})
    return 0


if __name__ == "__main__":
    sys.exit(main())
