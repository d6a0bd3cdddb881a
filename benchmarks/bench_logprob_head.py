"""The per-token log-probability head trl's trainers run, against memkern's (its linear
cross-entropy loops with the per-token statistics, :mod:`memkern.integrations.trl`) on the
same shapes and the same outputs: forward + backward of ``sum(g * log p(target))`` (plus
``sum(g2 * entropy)`` where the entropy is differentiated) with random upstream gradients per
token (what trl's losses hand back), no ``[N, V]`` logits held by either.

Three sets of outputs, each run by trl's ``ChunkedLogProbFunction`` as ``add_fused_lm_head``
calls it (vocab tiles of 32768, token tiles of 4096) and by memkern's head
(``memkern.integrations.trl.MemkernLogProbHead``, what ``use_memkern_head`` puts in its place):

* ``trl`` / ``memkern``: log-probabilities only (the reference models' call);
* ``trl sft`` / ``memkern sft``: SFTTrainer's outputs (log-probabilities, entropy and is-top-1
  for its metrics, the entropy without gradient);
* ``trl grpo`` / ``memkern grpo``: GRPOTrainer's with an entropy bonus (log-probabilities and
  entropy, both differentiated);
* ``unfused``: ``-F.cross_entropy(x @ W.T, t, reduction="none")``, the plain torch composition
  of the log-probabilities.

CPU (measured): median time over interleaved repetitions, the peak allocation above the inputs
(the profiler's CPU allocation trace) and each one's outputs and gradients against a float64
unfused reference.

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
from memkern.integrations.trl import MemkernLogProbHead  # noqa: E402
from memkern.profile import allocation_stats  # noqa: E402
from memkern.profile.plan import TrainingSetup, plan_training_step  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CPU_SHAPES = "4096x32000x512:float32,1024x128256x512:float32"
GPU_SHAPES = "8192x128256x4096:bfloat16,16384x151936x3584:bfloat16"
TRL_VOCAB_TILE = 32768
"""``trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE``: the vocabulary tile add_fused_lm_head uses."""
OUTPUTS = {"": ("log_probs",), " sft": ("log_probs", "entropy", "is_top1"),
           " grpo": ("log_probs", "entropy")}
"""Each set of outputs a trainer asks for, by the suffix of its cases' names."""
PAIRS = [("memkern" + suffix, "trl" + suffix) for suffix in OUTPUTS]


def heads() -> dict[str, tuple[object, bool]]:
    """name -> (f(x, w, t) -> (log-probabilities [N], entropy [N] or None), whether the
    entropy is differentiated)."""
    def fused(head, outputs):
        return lambda x, w, t: head.apply(x, w, None, t, 1.0, TRL_VOCAB_TILE, None, 1.0,
                                          outputs)[:2]
    cases = {"unfused": (lambda x, w, t: (-F.cross_entropy(F.linear(x, w).float(), t,
                                                            reduction="none"), None), False)}
    for suffix, outputs in OUTPUTS.items():
        for name, head in (("trl", ChunkedLogProbFunction), ("memkern", MemkernLogProbHead)):
            cases[name + suffix] = (fused(head, outputs), suffix == " grpo")
    return cases


def loss(head, x, w, t, g, g2):
    """What a trainer's loss hands back to the head: g * log-probabilities (+ g2 * entropy)."""
    f, entropy_grad = head
    log_probs, entropy = f(x, w, t)
    total = (log_probs * g).sum()
    return (total + (entropy * g2).sum() if entropy_grad else total), log_probs, entropy


def inputs(n, v, h, dtype, device="cpu"):
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, h, device=device, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(v, h, device=device, generator=gen) * 0.02).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), device=device, generator=gen)
    g = torch.randn(n, device=device, generator=gen)
    g2 = torch.randn(n, device=device, generator=gen)
    return x, w, t, g, g2


def measure(n, v, h, dtype, reps):
    x, w, t, g, g2 = inputs(n, v, h, dtype)
    x64, w64 = (a.detach().double().requires_grad_() for a in (x, w))
    z64 = x64 @ w64.T
    log_probs64 = -F.cross_entropy(z64, t, reduction="none")
    entropy64 = -(torch.softmax(z64, 1) * torch.log_softmax(z64, 1)).sum(1)
    want = {}
    for entropy_grad in (False, True):
        total = (log_probs64 * g.double()).sum()
        if entropy_grad:
            total = total + (entropy64 * g2.double()).sum()
        want[entropy_grad] = torch.autograd.grad(total, (x64, w64), retain_graph=True)
    want_out = (log_probs64.detach(), entropy64.detach())
    del z64, log_probs64, entropy64
    cases, peaks, errors = heads(), {}, {}

    def clear():
        x.grad = w.grad = None

    def rel(a, b):
        return ((a.double() - b).abs().max() / b.abs().max()).item()

    for name, head in cases.items():
        clear()
        got = []
        peaks[name] = allocation_stats(
            lambda head=head, got=got: (got.append(loss(head, x, w, t, g, g2)),
                                        got[0][0].backward())).peak
        _, log_probs, entropy = got[0]
        grads = want[head[1]]
        errors[name] = {"log_probs": rel(log_probs.detach(), want_out[0]),
                        "grad_input": rel(x.grad, grads[0]),
                        "grad_weight": rel(w.grad, grads[1])}
        if entropy is not None:
            errors[name]["entropy"] = rel(entropy.detach(), want_out[1])
    del want, want_out, x64, w64
    cpu_times: dict[str, list[float]] = {}
    times = common.interleaved_times(
        {name: (clear, lambda head=head: loss(head, x, w, t, g, g2)[0].backward())
         for name, head in cases.items()}, warmup=1, reps=reps, device=torch.device("cpu"),
        cpu_times=cpu_times)
    medians = {name: statistics.median(s) for name, s in times.items()}
    cpu = {name: statistics.median(s) for name, s in cpu_times.items()}
    result = {"shape": {"N": n, "V": v, "H": h, "dtype": str(dtype).removeprefix("torch.")},
              "median_seconds": medians, "all_seconds": times, "median_cpu_seconds": cpu,
              "all_cpu_seconds": cpu_times, "peak_bytes": peaks, "rel_err_vs_float64": errors}
    for ours, base in PAIRS + [("memkern", "unfused")]:
        result[f"{ours}_over_{base}".replace(" ", "_")] = {
            "time": common.ratio(times, ours, base),
            "cpu_time": common.ratio(cpu_times, ours, base),
            "peak": peaks[ours] / peaks[base]}
    print(f"\nper-token log-prob head {n} x {v} x {h} {result['shape']['dtype']}, CPU")
    print(f"  {'':13s} {'time ms':>9s} {'cpu ms':>9s} {'peak MiB':>9s} {'logp err':>9s} "
          f"{'H err':>9s} {'dx err':>9s} {'dW err':>9s}")
    for name in cases:
        e = errors[name]
        print(f"  {name:13s} {medians[name] * 1e3:9.1f} {cpu[name] * 1e3:9.1f} "
              f"{peaks[name] / 2**20:9.1f} {e['log_probs']:9.1e} {e.get('entropy', 0.0):9.1e} "
              f"{e['grad_input']:9.1e} {e['grad_weight']:9.1e}")
    for ours, base in PAIRS + [("memkern", "unfused")]:
        r = result[f"{ours}_over_{base}".replace(" ", "_")]
        print(f"  {ours} / {base}: time {r['time']['median']:.3f}x "
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
            x, w, t, g, g2 = inputs(n, v, h, dtype)
            module = torch.nn.Module()
            module.weight = torch.nn.Parameter(w.detach())

            def step():
                module.weight.grad = x.grad = None
                loss(head, x, module.weight, t, g, g2)[0].backward()
            return TrainingSetup(module, None, step, f"{name} {n}x{v}x{h}")
        with triton_like:
            result = plan_training_step(build, device="cuda", warmup_steps=0)
        peaks[name] = result.step_peak_above_start
    print(f"\nper-token log-prob head {n} x {v} x {h} {str(dtype).removeprefix('torch.')}, "
          "planned for Hopper (peak above the inputs)")
    for name, peak in peaks.items():
        print(f"  {name:13s} {peak / 2**20:9.1f} MiB")
    return {"shape": {"N": n, "V": v, "H": h, "dtype": str(dtype).removeprefix("torch.")},
            "planned_peak_bytes": peaks,
            **{f"{ours}_over_{base}".replace(" ", "_"): peaks[ours] / peaks[base]
               for ours, base in PAIRS}}


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
