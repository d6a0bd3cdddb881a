"""Linear cross-entropy, forward + backward: memkern against torch (the unfused
``F.cross_entropy(x @ W.T, t)``; ``F.linear_cross_entropy`` and its chunked path where this torch
has them) and Liger-Kernel's ``LigerFusedLinearCrossEntropyFunction`` (when ``liger_kernel``
imports), all in this process: median time (interleaved repetitions after a warm-up), peak
allocation above the inputs, and each one's loss and gradients against the unfused ones.

    python benchmarks/bench_lce.py [--device cpu|cuda] [--shapes 16384x50304x768:bfloat16,...]
                                   [--variants 960:768,1920:768,...] [--reps 10] [--save PATH]

Defaults. CPU: 4096 x 32000 x 512 float32, whose target (issue 24) is memkern <= torch's chunked
``F.linear_cross_entropy`` in peak and time. GPU: 16384 x 50304 x 768 bfloat16 (memkern <= 0.8x
Liger's time and <= 0.6x its peak) and 4096 x 128256 x 4096 bfloat16 (<= 1.0x both). Each
``--variants`` entry ``chunk:vocab`` adds memkern with those tokens per forward chunk and classes
per backward block (0: the default); on a GPU the default sweep is the default sizes with the
chunk or the block doubled or halved. On a GPU the run also times the four GEMMs of memkern's
loops alone at the shape and sizes used (their share of memkern's time) and a copy (the
bandwidth the row kernels have).
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import memkern as mk  # noqa: E402
from memkern.nn.linear_cross_entropy import splits  # noqa: E402
from memkern.ops.linear_cross_entropy import block_sizes  # noqa: E402
from memkern.profile import allocation_stats  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_SHAPES = "4096x32000x512:float32"
GPU_SHAPES = "16384x50304x768:bfloat16,4096x128256x4096:bfloat16"
TARGETS = {  # (baseline name, time ratio, peak ratio): memkern's default against the baseline
    (16384, 50304, 768): ("liger", 0.8, 0.6),
    (4096, 128256, 4096): ("liger", 1.0, 1.0),
    (4096, 32000, 512): ("torch chunked", 1.0, 1.0),
}
UNFUSED, TORCH, TORCH_CHUNKED, LIGER, MEMKERN = (
    "unfused", "torch", "torch chunked", "liger", "memkern")


def parse_shapes(text: str) -> list[tuple[int, int, int, torch.dtype]]:
    shapes = []
    for item in filter(None, text.split(",")):
        dims, _, dtype = item.partition(":")
        n, v, h = (int(d) for d in dims.split("x"))
        shapes.append((n, v, h, DTYPES[dtype or "bfloat16"]))
    return shapes


def parse_variants(text: str) -> list[tuple[int, int]]:
    return [tuple(int(s) for s in item.split(":")) for item in filter(None, text.split(","))]


def liger_function():
    """Liger's fused linear cross-entropy as ``f(x, w, t) -> loss``, or None without it."""
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    except ImportError:
        return None

    def run(x, w, t):
        out = LigerFusedLinearCrossEntropyFunction.apply(x, w, t)
        return out[0] if isinstance(out, tuple) else out  # later versions also return metrics
    return run


def default_sizes(n, v, h, dtype):
    return block_sizes(n, v, h, torch.empty((), dtype=dtype).element_size(), True,
                       splits("mean", dtype))


def candidates(n, v, h, dtype, device, variants):
    """name -> f(x, w, t) -> loss, and the names that are memkern's."""
    cases = {UNFUSED: (lambda x, w, t: F.cross_entropy(F.linear(x, w).float(), t))}
    lacks = []
    if hasattr(F, "linear_cross_entropy"):
        cases[TORCH] = lambda x, w, t: F.linear_cross_entropy(x, w, t)
        if hasattr(torch.nn, "LinearCrossEntropyOptions"):
            options = torch.nn.LinearCrossEntropyOptions()
            cases[TORCH_CHUNKED] = lambda x, w, t: F.linear_cross_entropy(x, w, t, options=options)
        else:
            lacks.append("torch.nn.LinearCrossEntropyOptions")
    else:
        lacks.append("torch.nn.functional.linear_cross_entropy")
    liger = liger_function() if device.type == "cuda" else None
    if liger is not None:
        cases[LIGER] = liger
    elif device.type == "cuda":
        lacks.append("liger_kernel")
    chunk, vocab = default_sizes(n, v, h, dtype)
    cases[MEMKERN] = lambda x, w, t: mk.nn.functional.linear_cross_entropy(x, w, t)
    ours = [MEMKERN]
    for c, b in variants:
        c, b = min(c or chunk, n), min(b or vocab, v)  # sizes past N or V are N or V
        if (c, b) == (chunk, vocab) or f"memkern chunk={c} vocab={b}" in cases:
            continue
        name = f"memkern chunk={c} vocab={b}"
        cases[name] = functools.partial(mk.nn.functional.linear_cross_entropy, chunk_size=c,
                                        vocab_block=b)
        ours.append(name)
    return cases, ours, lacks, (chunk, vocab)


def peak_above_inputs(fn, device):
    """Peak bytes allocated above the inputs while ``fn()`` runs (its gradients included)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    return allocation_stats(fn).peak


def gemm_probe(n, v, h, dtype, device, chunk, vocab, reps):
    """Seconds of the four GEMMs of memkern's split loops at these sizes, each alone, and what
    they add up to over the loops; a full [N, V] GEMM's throughput for scale."""
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(n, h, device=device, dtype=dtype, generator=gen)
    w = torch.randn(v, h, device=device, dtype=dtype, generator=gen)
    z_fwd = torch.empty(min(chunk, n), v, device=device, dtype=dtype)
    z_bwd = torch.empty(n, min(vocab, v), device=device, dtype=dtype)
    dx = torch.empty(min(chunk, n), h, device=device, dtype=dtype)
    dw = torch.empty(min(vocab, v), h, device=device, dtype=dtype)
    xc, wb = x[: min(chunk, n)], w[: min(vocab, v)]
    gemms = {
        "forward logits [chunk,H]x[H,V]": lambda: torch.mm(xc, w.t(), out=z_fwd),
        "forward dx [chunk,V]x[V,H]": lambda: torch.mm(z_fwd, w, out=dx),
        "backward logits [N,H]x[H,block]": lambda: torch.mm(x, wb.t(), out=z_bwd),
        "backward dW [block,N]x[N,H]": lambda: torch.mm(z_bwd.t(), x, out=dw),
    }
    out = {}
    for name, fn in gemms.items():
        seconds = common.median_seconds(fn, reps=reps, device=device)
        m = 2 * z_fwd.shape[0] * v * h if name.startswith("forward") else 2 * n * z_bwd.shape[1] * h
        out[name] = {"seconds": seconds, "tflops": m / seconds / 1e12}
    loops = (math.ceil(n / z_fwd.shape[0]) * (out["forward logits [chunk,H]x[H,V]"]["seconds"]
                                              + out["forward dx [chunk,V]x[V,H]"]["seconds"])
             + math.ceil(v / z_bwd.shape[1]) * (out["backward logits [N,H]x[H,block]"]["seconds"]
                                                + out["backward dW [block,N]x[N,H]"]["seconds"]))
    if n * v * dtype.itemsize <= 4 << 30:  # a full [N, V] GEMM when its output fits easily
        full = torch.empty(n, v, device=device, dtype=dtype)
        seconds = common.median_seconds(lambda: torch.mm(x, w.t(), out=full), reps=reps,
                                        device=device)
        out["full [N,H]x[H,V]"] = {"seconds": seconds, "tflops": 2 * n * v * h / seconds / 1e12}
        del full
    out["four GEMMs over the loops (seconds)"] = loops
    return out


def run_shape(n, v, h, dtype, device, reps, variants):
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, h, device=device, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(v, h, device=device, generator=gen) * 0.02).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), device=device, generator=gen)
    cases, ours, lacks, sizes = candidates(n, v, h, dtype, device, variants)
    for name in lacks:
        print(f"  no {name} here: not compared with it")

    def step(fn):
        return lambda: fn(x, w, t).backward()

    def clear():
        x.grad = w.grad = None

    peaks, grads, losses = {}, {}, {}
    for name, fn in cases.items():
        clear()
        loss_box = []

        def forward_backward(fn=fn, loss_box=loss_box):
            loss_box.append(fn(x, w, t))
            loss_box[0].backward()
        peaks[name] = peak_above_inputs(forward_backward, device)
        losses[name] = float(loss_box[0].detach().float())
        grads[name] = (x.grad.detach().clone(), w.grad.detach().clone())
    ref = grads[UNFUSED]
    grad_err = {name: max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                          for a, b in zip(g, ref)) for name, g in grads.items()}
    del grads
    clear()
    cpu_times: dict[str, list[float]] = {}
    times = common.interleaved_times({name: (clear, step(fn)) for name, fn in cases.items()},
                                     warmup=1, reps=reps, device=device,
                                     cpu_times=cpu_times if device.type == "cpu" else None)
    med = {k: statistics.median(s) for k, s in times.items()}
    result = {
        "shape": {"N": n, "V": v, "H": h, "dtype": str(dtype).removeprefix("torch.")},
        "memkern_default_sizes": {"chunk_size": sizes[0], "vocab_block": sizes[1]},
        "lacks": lacks, "median_seconds": med, "all_seconds": times, "peak_bytes": peaks,
        "loss": losses, "grad_rel_err_vs_unfused": grad_err,
    }
    if cpu_times:
        result["median_cpu_seconds"] = {k: statistics.median(s) for k, s in cpu_times.items()}
    if device.type == "cuda":
        result["gemm_probe"] = gemm_probe(n, v, h, dtype, device, *sizes, reps)
    baseline, time_target, peak_target = TARGETS.get((n, v, h), (None, None, None))
    print(f"\nlinear cross-entropy {n} x {v} x {h} {result['shape']['dtype']} on {device}; memkern "
          f"default chunk_size={sizes[0]}, vocab_block={sizes[1]}")
    print(f"  {'':38s} {'time ms':>9s} {'peak MiB':>9s} {'loss':>10s} {'grad err':>9s}")
    for name in cases:
        print(f"  {name:38s} {med[name] * 1e3:9.2f} {peaks[name] / 2**20:9.1f} "
              f"{losses[name]:10.5f} {grad_err[name]:9.2e}")
    if baseline in cases:
        ratios = {name: (med[name] / med[baseline], peaks[name] / peaks[baseline]) for name in ours}
        result["memkern_over_" + baseline.replace(" ", "_")] = ratios
        for name, (rt, rp) in ratios.items():
            verdict = "meets" if rt <= time_target and rp <= peak_target else "misses"
            print(f"  {name} / {baseline}: time {rt:.3f}x (target <= {time_target}), "
                  f"peak {rp:.3f}x (target <= {peak_target}): {verdict}")
        result["targets"] = {"baseline": baseline, "time": time_target, "peak": peak_target}
    elif baseline is not None:
        print(f"  no {baseline} in this run: the targets (<= {time_target}x time, "
              f"<= {peak_target}x peak) are not checked")
    if "gemm_probe" in result:
        probe = result["gemm_probe"]
        for name, r in probe.items():
            if isinstance(r, dict):
                print(f"  GEMM {name:34s} {r['seconds'] * 1e3:8.3f} ms {r['tflops']:7.1f} TFLOP/s")
        loops = probe["four GEMMs over the loops (seconds)"]
        print(f"  the four GEMMs over memkern's default loops: {loops * 1e3:.2f} ms of its "
              f"{med[MEMKERN] * 1e3:.2f} ms")
    return result


def run(device, reps, shapes=None, variants=None):
    """The comparison at each shape; returns the results (one dict per shape)."""
    gpu = device.type == "cuda"
    shapes = parse_shapes(shapes or (GPU_SHAPES if gpu else CPU_SHAPES))
    if variants is None:
        variants = "0:0" if not gpu else None
    results = {}
    for n, v, h, dtype in shapes:
        if variants is None:  # the GPU sweep around the default sizes
            chunk, vocab = default_sizes(n, v, h, dtype)
            sweep = [(2 * chunk, 0), (max(1, chunk // 2), 0), (0, 2 * vocab),
                     (0, max(1, vocab // 2))]
        else:
            sweep = parse_variants(variants)
        results[f"{n}x{v}x{h}:{str(dtype).removeprefix('torch.')}"] = run_shape(
            n, v, h, dtype, device, reps, sweep)
        if gpu:
            torch.cuda.empty_cache()
    if gpu:
        results["copy_bandwidth_bytes_per_s"] = common.copy_bandwidth(device)
        print(f"\ncopy bandwidth {results['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s")
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default=None, help="NxVxH:dtype,... (default: per device)")
    ap.add_argument("--variants", default=None,
                    help="chunk:vocab,... memkern sizes to add (0: default; GPU default: a sweep)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (CPU 3, GPU 10)")
    ap.add_argument("--save", metavar="PATH", default=None, help="also write the results as JSON")
    args = ap.parse_args()
    device = torch.device(args.device)
    reps = args.reps or (10 if device.type == "cuda" else 3)
    results = {"device": str(device), "linear_cross_entropy": run(device, reps, args.shapes,
                                                                  args.variants)}
    out = args.save or os.path.join(os.path.dirname(__file__), "results",
                                    f"{device.type}-lce.json")
    common.save(out, results)


if __name__ == "__main__":
    main()
