"""The per-token log-probability head trl's trainers run, against memkern's linear
cross-entropy loops on the same shapes: forward + backward of ``sum(g * log p(target))`` with
a random upstream gradient ``g`` per token (what trl's losses hand back), no ``[N, V]``
logits held by either.

* ``trl``: ``trl.kernels.ChunkedLogProbFunction`` as ``add_fused_lm_head`` calls it (vocab
  tiles of 32768, token tiles of 4096), log-probabilities only (the reference models' call);
* ``trl sft``: the same with SFTTrainer's outputs (log-probabilities, entropy and is-top-1 for
  its metrics, the entropy without gradient);
* ``memkern``: ``memkern.nn.functional.linear_cross_entropy(reduction="none")``, negated (its
  loops compute the log-probabilities and their gradients, not the entropy);
* ``unfused``: ``-F.cross_entropy(x @ W.T, t, reduction="none")``, the plain torch composition.

CPU (measured): median time over interleaved repetitions, the peak allocation above the inputs
(the profiler's CPU allocation trace) and each one's log-probabilities and gradients against a
float64 unfused reference.

``--plan``: the GPU peak (Hopper) from ``memkern.profile.plan_training_step`` on fake tensors.
trl's GPU path folds each tile with Triton kernels that write in place and allocate nothing;
the planner runs the CPU stand-in, so its torch tile folds are replaced while planning by
in-place stand-ins that allocate nothing either (the tiles, accumulators and outputs are trl's
own). No GPU time: this machine has none.

    python benchmarks/bench_logprob_head.py [--shapes 4096x32000x512:float32,...] [--reps 3]
    python benchmarks/bench_logprob_head.py --plan [--shapes 8192x128256x4096:bfloat16,...]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trl.kernels import ChunkedLogProbFunction, chunked_logprob  # noqa: E402

import common  # noqa: E402
import memkern as mk  # noqa: E402
from memkern.profile import allocation_stats  # noqa: E402
from memkern.profile.plan import TrainingSetup, plan_training_step  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CPU_SHAPES = "4096x32000x512:float32,1024x128256x512:float32"
GPU_SHAPES = "8192x128256x4096:bfloat16,16384x151936x3584:bfloat16"
TRL_VOCAB_TILE = 32768
"""``trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE``: the vocabulary tile add_fused_lm_head uses."""
SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")


def heads() -> dict[str, object]:
    """name -> f(x, w, t) -> per-token log-probabilities ``[N]``."""
    def trl(outputs):
        return lambda x, w, t: ChunkedLogProbFunction.apply(
            x, w, None, t, 1.0, TRL_VOCAB_TILE, None, 1.0, outputs)[0]
    return {
        "unfused": lambda x, w, t: -F.cross_entropy(F.linear(x, w).float(), t, reduction="none"),
        "trl": trl(("log_probs",)),
        "trl sft": trl(SFT_OUTPUTS),
        "memkern": lambda x, w, t: -mk.nn.functional.linear_cross_entropy(x, w, t,
                                                                           reduction="none"),
    }


def inputs(n, v, h, dtype, device="cpu"):
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, h, device=device, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(v, h, device=device, generator=gen) * 0.02).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), device=device, generator=gen)
    g = torch.randn(n, device=device, generator=gen)
    return x, w, t, g


def measure(n, v, h, dtype, reps):
    x, w, t, g = inputs(n, v, h, dtype)
    x64, w64 = (a.detach().double().requires_grad_() for a in (x, w))
    want = -F.cross_entropy(x64 @ w64.T, t, reduction="none")
    (want * g.double()).sum().backward()
    want = (want.detach(), x64.grad, w64.grad)
    cases, peaks, errors = heads(), {}, {}

    def clear():
        x.grad = w.grad = None

    for name, head in cases.items():
        clear()
        got = []
        peaks[name] = allocation_stats(
            lambda head=head, got=got: (got.append(head(x, w, t)),
                                        (got[0] * g).sum().backward())).peak
        errors[name] = {what: ((a.double() - b).abs().max() / b.abs().max()).item()
                        for what, a, b in zip(("log_probs", "grad_input", "grad_weight"),
                                              (got[0].detach(), x.grad, w.grad), want)}
    del want, x64, w64
    cpu_times: dict[str, list[float]] = {}
    times = common.interleaved_times(
        {name: (clear, lambda head=head: (head(x, w, t) * g).sum().backward())
         for name, head in cases.items()}, warmup=1, reps=reps, device=torch.device("cpu"),
        cpu_times=cpu_times)
    medians = {name: statistics.median(s) for name, s in times.items()}
    cpu = {name: statistics.median(s) for name, s in cpu_times.items()}
    result = {"shape": {"N": n, "V": v, "H": h, "dtype": str(dtype).removeprefix("torch.")},
              "median_seconds": medians, "all_seconds": times, "median_cpu_seconds": cpu,
              "all_cpu_seconds": cpu_times, "peak_bytes": peaks, "rel_err_vs_float64": errors}
    for base in ("trl", "trl sft"):
        result["memkern_over_" + base.replace(" ", "_")] = {
            "time": common.ratio(times, "memkern", base),
            "cpu_time": common.ratio(cpu_times, "memkern", base),
            "peak": peaks["memkern"] / peaks[base]}
    print(f"\nper-token log-prob head {n} x {v} x {h} {result['shape']['dtype']}, CPU")
    print(f"  {'':10s} {'time ms':>9s} {'cpu ms':>9s} {'peak MiB':>9s} {'logp err':>9s} "
          f"{'dx err':>9s} {'dW err':>9s}")
    for name in cases:
        e = errors[name]
        print(f"  {name:10s} {medians[name] * 1e3:9.1f} {cpu[name] * 1e3:9.1f} "
              f"{peaks[name] / 2**20:9.1f} {e['log_probs']:9.1e} {e['grad_input']:9.1e} "
              f"{e['grad_weight']:9.1e}")
    for base in ("trl", "trl_sft"):
        r = result[f"memkern_over_{base}"]
        print(f"  memkern / {base.replace('_', ' ')}: time {r['time']['median']:.3f}x "
              f"(quartiles {r['time']['first_quartile']:.3f}-{r['time']['third_quartile']:.3f}),"
              f" CPU time {r['cpu_time']['median']:.3f}x, peak {r['peak']:.4f}x")
    return result


def _fold_in_place(tile, *args, **kwargs):
    """A Triton fold's memory on the planner's fake tensors: it rewrites the tile in place."""
    tile.mul_(1)


def plan(n, v, h, dtype):
    """Hopper peak of one forward + backward of each head (fake tensors; bytes)."""
    peaks = {}
    for name, head in heads().items():
        if name == "unfused":
            continue
        triton_like = (mock.patch.multiple(chunked_logprob, _forward_tile=_fold_in_place,
                                           _backward_tile=_fold_in_place)
                       if name.startswith("trl") else contextlib.nullcontext())

        def build(head=head, name=name):
            x, w, t, g = inputs(n, v, h, dtype)
            module = torch.nn.Module()
            module.weight = torch.nn.Parameter(w.detach())

            def step():
                module.weight.grad = x.grad = None
                (head(x, module.weight, t) * g).sum().backward()
            return TrainingSetup(module, None, step, f"{name} {n}x{v}x{h}")
        with triton_like:
            result = plan_training_step(build, device="cuda", warmup_steps=0)
        peaks[name] = result.step_peak_above_start
    print(f"\nper-token log-prob head {n} x {v} x {h} {str(dtype).removeprefix('torch.')}, "
          "planned for Hopper (peak above the inputs)")
    for name, peak in peaks.items():
        print(f"  {name:10s} {peak / 2**20:9.1f} MiB")
    return {"shape": {"N": n, "V": v, "H": h, "dtype": str(dtype).removeprefix("torch.")},
            "planned_peak_bytes": peaks,
            "memkern_over_trl": peaks["memkern"] / peaks["trl"],
            "memkern_over_trl_sft": peaks["memkern"] / peaks["trl sft"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", action="store_true", help="plan the GPU peaks instead of measuring")
    ap.add_argument("--shapes", default=None, help="NxVxH:dtype,...")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (CPU)")
    ap.add_argument("--save", metavar="PATH", default=None, help="the JSON results' path")
    args = ap.parse_args()
    shapes = []
    for item in (args.shapes or (GPU_SHAPES if args.plan else CPU_SHAPES)).split(","):
        dims, _, dtype = item.partition(":")
        shapes.append((*(int(d) for d in dims.split("x")), DTYPES[dtype or "float32"]))
    results = {f"{n}x{v}x{h}:{str(d).removeprefix('torch.')}":
               plan(n, v, h, d) if args.plan else measure(n, v, h, d, args.reps)
               for n, v, h, d in shapes}
    name = "plan-hopper-logprob-head.json" if args.plan else "cpu-logprob-head.json"
    common.save(args.save or os.path.join(os.path.dirname(__file__), "results", name),
                {"logprob_head": results})


if __name__ == "__main__":
    main()
