"""Train the small GPT of ``memkern bench`` with ZeRO across processes.

    torchrun --nproc-per-node 2 examples/train_gpt_zero.py                 # CPU: gloo
    torchrun --nproc-per-node 8 examples/train_gpt_zero.py --stage 2 --bf16   # GPUs: nccl
    torchrun --nproc-per-node 2 examples/train_gpt_zero.py --offload       # state on the CPU

Without torchrun it trains on one process (the same optimizer, nothing sharded). Every rank
trains on its own random windows of the standard library's sources; the
gradient of a step is the mean over all ranks' micro-batches. ``--save DIR`` writes a sharded
checkpoint (model weights from rank 0, optimizer state from every rank) at the end and
``--resume DIR`` continues from one, at any number of processes.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import memkern as mk
from memkern.bench.data import Batches, stdlib_corpus
from memkern.bench.model import GPT, SIZES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--stage", type=int, choices=(1, 2), default=1, help="ZeRO stage")
    parser.add_argument("--offload", action="store_true", help="optimizer state on the CPU")
    parser.add_argument("--bf16", action="store_true",
                        help="bfloat16 weights and gradients (float32 masters)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--save", help="write a checkpoint to this directory at the end")
    parser.add_argument("--resume", help="continue from a checkpoint directory")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    distributed = "RANK" in os.environ  # set by torchrun
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
        print("train_gpt_zero.py: not under torchrun, training on one process (shard across N "
              "with: torchrun --nproc-per-node N examples/train_gpt_zero.py)", flush=True)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda")
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    cfg = SIZES[args.size]
    torch.manual_seed(0)  # the optimizer broadcasts rank 0's weights anyway
    model = GPT(cfg).to(device, torch.bfloat16 if args.bf16 else torch.float32)
    if args.resume:
        model.load_state_dict(torch.load(os.path.join(args.resume, "model.pt"),
                                         map_location=device))
    opt = mk.optim.ShardedOptimizer(
        model.parameters(), "adamw", lr=args.lr, weight_decay=0.01,
        zero_stage=args.stage, offload="cpu" if args.offload else None,
        accumulation_steps=args.accumulation, max_grad_norm=1.0,
        loss_scale="dynamic" if args.bf16 else None)
    first = 0
    if args.resume:
        opt.load_sharded(os.path.join(args.resume, "optimizer"))
        first = torch.load(os.path.join(args.resume, "progress.pt"))["steps"]
    batches = Batches(stdlib_corpus(), args.batch, cfg.seq, seed=1000 * first + rank,
                      device=device)

    for step in range(first, first + args.steps):
        total = torch.zeros((), device=device)
        for _ in range(args.accumulation):
            loss = model(*batches.next())
            opt.backward(loss)
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        if step % 10 == 0 or step == first + args.steps - 1:
            if distributed:
                dist.all_reduce(total)  # only for printing: a host read every 10 steps
            if rank == 0:
                print(f"step {step:4d}  loss {total.item() / (world * args.accumulation):.4f}  "
                      f"grad norm {opt.grad_norm:.3f}  skipped {opt.skipped_steps}", flush=True)

    if args.save:
        opt.save_sharded(os.path.join(args.save, "optimizer"))  # collective
        if rank == 0:
            torch.save(model.state_dict(), os.path.join(args.save, "model.pt"))
            torch.save({"steps": first + args.steps}, os.path.join(args.save, "progress.pt"))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
