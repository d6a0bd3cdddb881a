"""One GPU's ceiling: a 1-3B Llama trained with its optimizer on the GPU and on the host, each
step's measured peak against its plan, and the step time of each against the GPU optimizer's.

The model is TinyLlama's shape by default (1.1B: hidden 2048, 22 layers, 32 heads, 4 key/value
heads, MLP 5632, vocabulary 32000), bf16 weights, ``memkern.patch``-ed, every decoder layer
``memkern.checkpoint(..., "full")``, batch 2 x 2048, trained with ``memkern plan``'s default
optimizer (``ShardedOptimizer``'s AdamW, float32 masters, clipping at 1.0, dynamic loss scale:
:data:`memkern.profile.workloads.OPTIMIZERS`) and these options added:

==================  =================================================================
gpu                 none: masters, moments and the gradient buffer on the GPU
host                ``offload="cpu"``: masters and moments on the host, stepped there
host-8bit           ``offload="cpu", state_precision="8bit"``
host-streamed       ``gradients="host"`` (no gradient buffer on the GPU), where the
                    installed memkern has that option
==================  =================================================================

For each: the plan of the same step (:func:`memkern.profile.plan_training_step` on fake tensors,
the "cuda" target), then the model built on the GPU, ``--warmup`` steps, and ``--steps`` timed
steps (wall time, synchronised), the peak of the last step (``torch.cuda.max_memory_allocated``
after ``reset_peak_memory_stats`` at its start, plus what was allocated then: the process's
peak during that step) against the plan's peak, the peak of the set-up and warm-up (the
optimizer's construction included) against the plan's run peak, and the pinned host memory
(``torch.cuda.host_memory_stats()``, where torch has it) against the plan's.

Usage: python benchmarks/bench_one_gpu.py [--hidden 2048 --layers 22 ...] [--configs gpu,host]
                                          [--save PATH]
"""
from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import memkern as mk  # noqa: E402
from memkern.profile import hf_config, hf_workload, plan_training_step  # noqa: E402
from memkern.profile.blocks import repeated_blocks  # noqa: E402
from memkern.profile.workloads import OPTIMIZERS  # noqa: E402

CONFIGS = {"gpu": {}, "host": {"offload": "cpu"},
           "host-8bit": {"offload": "cpu", "state_precision": "8bit"},
           "host-streamed": {"gradients": "host"}}
MIB = 1 << 20


def _supported(options: dict) -> bool:
    return set(options) <= set(inspect.signature(mk.optim.ShardedOptimizer).parameters)


def _pinned_bytes() -> int | None:
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return None
    return int(stats().get("allocated_bytes.current", 0))


def run_config(cfg, options: dict, batch: int, seq: int, warmup: int, steps: int) -> dict:
    import transformers

    plan = plan_training_step(hf_workload(cfg, batch=batch, seq=seq, patch={},
                                          optimizer="sharded", optimizer_options=options,
                                          checkpoint="full"), device="cuda")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    pinned_before = _pinned_bytes()
    # built on the host and moved, as the plan's set-up is (hf_workload)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to("cuda", torch.bfloat16).train()
    mk.patch(model)
    for _, block in repeated_blocks(model):
        mk.checkpoint(block, "full")
    opt = OPTIMIZERS["sharded"].with_options(**options)(model.parameters())
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")

    def step(model=model, opt=opt) -> None:
        opt.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    run_peak = torch.cuda.max_memory_allocated()  # set-up and warm-up: the plan's run peak
    times = []
    for i in range(steps):
        if i == steps - 1:
            start_level = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    measured = torch.cuda.max_memory_allocated()
    pinned = _pinned_bytes()
    result = {"options": options, "parameters": sum(p.numel() for p in model.parameters()),
              "step_s": statistics.median(times), "times_s": times,
              "measured_peak": measured, "planned_peak": plan.peak_bytes,
              "measured_over_planned": measured / plan.peak_bytes,
              "step_start": start_level, "planned_step_start": plan.step_start,
              "measured_run_peak": run_peak, "planned_run_peak": plan.run_peak,
              "planned_host_peak": plan.host_peak, "planned_host_pinned": plan.host_pinned,
              "planned_host_by_category": plan.host_by_category,
              "measured_pinned": None if pinned is None else pinned - (pinned_before or 0)}
    del step, model, opt
    torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--save", metavar="PATH")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_one_gpu.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    cfg = hf_config("llama", dict(hidden_size=args.hidden, num_hidden_layers=args.layers,
                                  num_attention_heads=args.heads,
                                  num_key_value_heads=args.kv_heads,
                                  intermediate_size=args.intermediate, vocab_size=args.vocab,
                                  max_position_embeddings=max(2048, args.seq)))
    results, skipped = {}, {}
    for name in args.configs.split(","):
        options = CONFIGS[name]
        if not _supported(options):
            skipped[name] = f"ShardedOptimizer has no {', '.join(options)} option here"
            print(f"{name}: skipped, {skipped[name]}")
            continue
        results[name] = run_config(cfg, options, args.batch, args.seq, args.warmup, args.steps)
        r = results[name]
        print(f"{name}: step {r['step_s'] * 1e3:.0f} ms; peak measured "
              f"{r['measured_peak'] / MIB:.0f} MiB, planned {r['planned_peak'] / MIB:.0f} MiB "
              f"({r['measured_over_planned']:.3f}x); "
              f"host planned {r['planned_host_peak'] / MIB:.0f} MiB (pinned "
              f"{r['planned_host_pinned'] / MIB:.0f}, measured pinned "
              f"{'n/a' if r['measured_pinned'] is None else round(r['measured_pinned'] / MIB)})",
              flush=True)
    if "gpu" in results:
        for name, r in results.items():
            r["step_over_gpu"] = r["step_s"] / results["gpu"]["step_s"]
            print(f"{name}: step time {r['step_over_gpu']:.2f}x the GPU optimizer's")
    if args.save:
        common.save(args.save, {"config": vars(args), "results": results, "skipped": skipped})
    return 0


if __name__ == "__main__":
    sys.exit(main())
