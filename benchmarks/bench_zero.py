"""ZeRO training steps across W processes: memkern's ShardedOptimizer (stage 1, stage 2)
against DistributedDataParallel + torch.optim.AdamW(fused=True) and against
DistributedDataParallel + ZeroRedundancyOptimizer(AdamW, fused=True), in one run.

The work, on every rank: one training step of the default small GPT (memkern.bench, float32)
on its own batch: forward, backward, gradient averaging across ranks, clipping to a total
norm of 1.0, AdamW, zero the gradients. The cases take turns within every repetition; a
repetition's time is the slowest rank's; reported is the median after warm-up, and the
ratio to the DDP + fused AdamW time.

Memory: bytes per parameter each rank holds after backward, when every case's gradients
exist (every storage reachable from the model and the optimizer, through ``p.grad`` for
DDP's gradient buckets: memkern.profile.reachable_bytes), for these float32
cases and for memkern with bfloat16 parameters, next to the formulas.

On a GPU (``--device cuda``, one process), the step of ``ShardedOptimizer(offload="cpu")``
against fused AdamW on the GPU.

Usage: python benchmarks/bench_zero.py [--world 2] [--batch 4] [--reps 5] [--warmup 2]
                                       [--bucket-mb 25] [--device cpu|cuda] [--save PATH]
       (or under torchrun --nproc-per-node N, which sets the world size)
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import memkern as mk  # noqa: E402
from memkern.bench.data import Batches, stdlib_corpus  # noqa: E402
from memkern.bench.model import GPT, SIZES  # noqa: E402
from memkern.profile import reachable_bytes  # noqa: E402

LR, WEIGHT_DECAY, MAX_NORM = 1e-3, 0.01, 1.0


def torch_step(model, opt):
    """``step(x, y, after_backward)``: forward, backward (DDP reduces), clip, update, zero."""
    def step(x, y, after_backward=lambda: None):
        model(x, y).backward()
        after_backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def memkern_step(model, opt):
    def step(x, y, after_backward=lambda: None):
        opt.backward(model(x, y))
        after_backward()
        opt.step()
        opt.zero_grad()
    return step


def cases(base: GPT, args) -> dict:
    """name -> (step, objects that hold the case's memory)."""
    out = {}
    model = copy.deepcopy(base)
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    out["ddp+adamw(fused)"] = (torch_step(ddp, opt), (model, opt))
    model = copy.deepcopy(base)
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR,
                                  weight_decay=WEIGHT_DECAY, fused=True)
    out["ddp+ZeroRedundancyOptimizer"] = (torch_step(ddp, opt), (model, opt))
    for stage in (1, 2):
        model = copy.deepcopy(base)
        opt = mk.optim.ShardedOptimizer(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                        zero_stage=stage, max_grad_norm=MAX_NORM,
                                        bucket_size_mb=args.bucket_mb)
        out[f"memkern zero_stage={stage}"] = (memkern_step(model, opt), (model, opt))
    return out


def bf16_bytes(base: GPT, batches: Batches, args) -> dict[str, float]:
    """memkern with bfloat16 parameters: bytes per parameter held after the second step's
    backward."""
    kept = {}
    for stage in (1, 2):
        model = copy.deepcopy(base).to(torch.bfloat16)
        opt = mk.optim.ShardedOptimizer(model.parameters(), lr=LR, zero_stage=stage,
                                        loss_scale="dynamic", max_grad_norm=MAX_NORM,
                                        bucket_size_mb=args.bucket_mb)
        step = memkern_step(model, opt)
        step(*batches.next())
        key = f"memkern zero_stage={stage} bf16"
        step(*batches.next(), after_backward=lambda key=key, model=model, opt=opt: (
            kept.__setitem__(key, reachable_bytes(model, opt) / numel(model))))
    return kept


def numel(model: GPT) -> int:
    return sum(p.numel() for p in model.parameters())


def run(rank: int, world: int, args) -> dict | None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cfg = SIZES["small"]
    torch.manual_seed(0)
    base = GPT(cfg)
    batches = Batches(stdlib_corpus(), args.batch, cfg.seq, seed=rank)
    todo = cases(base, args)
    times: dict[str, list[float]] = {name: [] for name in todo}
    x, y = batches.next()
    for i in range(args.warmup + args.reps):
        for name, (step, _) in todo.items():
            dist.barrier()
            start = time.perf_counter()
            step(x, y)
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's step
            if i >= args.warmup:
                times[name].append(elapsed.item())
    n = numel(base)
    kept = {}
    for name, (step, objs) in todo.items():
        step(x, y, after_backward=lambda name=name, objs=objs: kept.__setitem__(
            name, reachable_bytes(*objs) / n))
    kept.update(bf16_bytes(base, batches, args))
    per_rank = [None] * world
    dist.all_gather_object(per_rank, kept)
    if rank != 0:
        return None
    median = {name: statistics.median(t) for name, t in times.items()}
    baseline = median["ddp+adamw(fused)"]
    w = world
    formulas = {"ddp+adamw(fused)": 16, "ddp+ZeroRedundancyOptimizer": 8 + 8 / w,
                "memkern zero_stage=1": 8 + 8 / w, "memkern zero_stage=2": 4 + 12 / w,
                "memkern zero_stage=1 bf16": 4 + 12 / w, "memkern zero_stage=2 bf16": 2 + 14 / w}
    return {
        "command": common.command_line(),
        "machine": common.machine(),
        "world_size": world, "model": f"GPT small ({n} parameters), float32",
        "batch_per_rank": [args.batch, cfg.seq], "bucket_size_mb": args.bucket_mb,
        "median_step_seconds": median,
        "ratio_to_ddp_fused_adamw": {k: v / baseline for k, v in median.items()},
        "bytes_per_param": {name: {"formula": formulas[name],
                                   "measured_per_rank": [r[name] for r in per_rank]}
                            for name in formulas},
    }


def gpu_offload(args) -> dict:
    """One GPU: a training step with memkern's offload="cpu" (masters and state in host
    memory, the CPU kernel) against one with fused AdamW on the GPU; small GPT, float32."""
    cfg = SIZES["small"]
    torch.manual_seed(0)
    base = GPT(cfg).cuda()
    batches = Batches(stdlib_corpus(), args.batch, cfg.seq, device="cuda")
    x, y = batches.next()
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    torch_case = torch_step(model, opt)
    model = copy.deepcopy(base)
    opt = mk.optim.ShardedOptimizer(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                    offload="cpu", max_grad_norm=MAX_NORM)
    memkern_case = memkern_step(model, opt)
    device = torch.device("cuda")
    median = {
        "torch AdamW(fused=True), GPU": common.median_seconds(
            lambda: torch_case(x, y), warmup=args.warmup, reps=args.reps, device=device),
        "memkern offload='cpu'": common.median_seconds(
            lambda: memkern_case(x, y), warmup=args.warmup, reps=args.reps, device=device),
    }
    return {"command": common.command_line(), "machine": common.machine(),
            "median_step_seconds": median,
            "ratio": median["memkern offload='cpu'"] / median["torch AdamW(fused=True), GPU"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=25)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--save", help="write the results as JSON here")
    args = parser.parse_args()
    if args.device == "cuda":
        result = gpu_offload(args)
    elif "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo", timeout=timedelta(seconds=300))
        result = run(dist.get_rank(), dist.get_world_size(), args)
        dist.destroy_process_group()
        if result is None:
            return
    else:
        result = common.on_gloo_ranks(run, args.world, args, timeout=300)
    common.print_and_save(result, args.save)

if __name__ == "__main__":
    main()
