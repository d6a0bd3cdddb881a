"""A ZeRO-2 run on 2 gloo ranks written as users write it: memkern imported at the top,
``torch.multiprocessing.spawn``, ``ShardedOptimizer``, a few steps,
``destroy_process_group()``, return. No ``os._exit``: the process must end with exit status 0
by itself (docs/reliability.md, "A finished run does not die at exit";
``scripts/crash_loop.py`` runs it again and again under load, beside its plain-torch twin
``tests/scripts/zero_exit_torch.py``).

    python tests/scripts/zero_exit.py [--steps N]
"""
import argparse

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import memkern as mk
from zero_exit_torch import WORLD, batch, make_model, store_path


def run(rank: int, store: str, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD)
    model = make_model()
    opt = mk.optim.ShardedOptimizer(model.parameters(), "adamw", lr=1e-3, zero_stage=2,
                                    bucket_size_mb=0.02)
    for step in range(steps):
        opt.backward(model(batch(step, rank)).square().mean())
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    mp.spawn(run, args=(store_path(), args.steps), nprocs=WORLD)
