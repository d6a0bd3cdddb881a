"""Training across W gloo ranks on the CPU, the compositions side by side: per-rank held and
peak memory and step time of DistributedDataParallel + torch AdamW, memkern's ShardedOptimizer
(ZeRO-2), FSDP2 + torch AdamW, FSDP2 + memkern FusedAdamW (32-bit and 8-bit state), each on
the plain transformers model and on the memkern-patched one, in one run.

The work, on every rank: one training step of a small Llama (transformers, built from a
config: width 256, 2 layers, 4 heads (2 KV), MLP 704, vocab 32000, float32; the shape of
``bench_hf.py``'s CPU section) on its own batch: forward, backward, the gradients averaged
across ranks, AdamW (lr 1e-4, weight decay 0.01), zero the gradients. FSDP2 shards each decoder
layer, then the model (:func:`memkern.profile.hf_workload`'s ``sharding="fsdp2"``).

Per rank, reported for rank 0 (the ranks hold equal shards, rank 0 the largest): **held**,
the parameters, gradients and optimizer state alive when a step starts (each storage once, a
DTensor by its local shard: ``memkern.profile.memory_breakdown``); **peak**, held plus the
step's peak allocation above it (the profiler's allocation trace). Time: the slowest rank's
step, median over the repetitions, the cases taking turns within each; the ratio is to DDP +
torch AdamW on the plain model.

Usage: python benchmarks/bench_distributed.py [--world 2] [--batch 2] [--seq 256] [--reps 5]
                                              [--warmup 2] [--save PATH]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
from memkern.profile import (  # noqa: E402
    TrainingSetup,
    allocation_stats,
    hf_config,
    hf_workload,
    memory_breakdown,
)

CONFIG = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=704, vocab_size=32000, attn_implementation="sdpa")
COMPOSITIONS = {  # name -> hf_workload's (optimizer, sharding); "ddp" is built here
    "DDP + torch AdamW": ("adamw", "ddp"),
    "ShardedOptimizer ZeRO-2": ("sharded", "zero2"),
    "FSDP2 + torch AdamW": ("adamw", "fsdp2"),
    "FSDP2 + memkern FusedAdamW": ("memkern-adamw", "fsdp2"),
    "FSDP2 + memkern FusedAdamW 8-bit": ("memkern-adamw-8bit", "fsdp2"),
}
BASELINE = "DDP + torch AdamW, plain"


def ddp_setup(config, batch: int, seq: int, patch: dict | None) -> TrainingSetup:
    """DistributedDataParallel over the transformers model (memkern-patched or not) with
    ``torch.optim.AdamW(foreach=True)``; the step as hf_workload's."""
    import transformers

    import memkern

    model = transformers.AutoModelForCausalLM.from_config(config).train()
    if patch is not None:
        memkern.patch(model, **patch)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)
    ids = torch.randint(1, config.vocab_size, (batch, seq))

    def step() -> None:
        ddp(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return TrainingSetup(model, opt, step, "DDP")


def setups(args) -> dict[str, TrainingSetup]:
    config = hf_config("llama", dict(CONFIG, max_position_embeddings=args.seq))
    out = {}
    for patched, patch in (("plain", None), ("memkern.patch", {})):
        for name, (optimizer, sharding) in COMPOSITIONS.items():
            torch.manual_seed(0)
            if sharding == "ddp":
                setup = ddp_setup(config, args.batch, args.seq, patch)
            else:
                setup = hf_workload(config, batch=args.batch, seq=args.seq, dtype=torch.float32,
                                    patch=patch, optimizer=optimizer, sharding=sharding)()
            out[f"{name}, {patched}"] = setup
    return out


def run(rank: int, world: int, args) -> dict | None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cases = setups(args)
    memory = {}
    for name, setup in cases.items():
        setup.step()  # the optimizer's state exists from here on
        held = memory_breakdown(setup.model, setup.optimizer).total
        memory[name] = {"held_bytes": held, "peak_bytes": held + allocation_stats(setup.step).peak}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(args.warmup + args.reps):
        for name, setup in cases.items():
            dist.barrier()
            start = time.perf_counter()
            setup.step()
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's step
            if i >= args.warmup:
                times[name].append(elapsed.item())
    if rank != 0:
        return None
    median = {name: statistics.median(t) for name, t in times.items()}
    params = sum(p.numel() for p in hf_workload(
        hf_config("llama", dict(CONFIG, max_position_embeddings=args.seq)), batch=1, seq=1,
        dtype=torch.float32)().model.parameters())
    return {
        "command": common.command_line(), "machine": common.machine(), "world_size": world,
        "model": f"Llama ({params} parameters), float32", "batch_per_rank": [args.batch, args.seq],
        "rank0": {name: {**memory[name], "median_step_seconds": median[name],
                         "time_ratio_to_ddp_plain": median[name] / median[BASELINE]}
                  for name in cases},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--save", help="write the results as JSON here")
    args = parser.parse_args()
    common.print_and_save(common.on_gloo_ranks(run, args.world, args), args.save)

if __name__ == "__main__":
    main()
