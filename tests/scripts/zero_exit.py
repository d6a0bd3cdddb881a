"""A ZeRO-2 run on 2 gloo ranks written as users write it: ``torch.multiprocessing.spawn``,
``ShardedOptimizer``, a few steps, ``destroy_process_group()``, return. No ``os._exit``: the
process must end with exit status 0 by itself (docs/reliability.md, "A finished run does not
die at exit").

    python tests/scripts/zero_exit.py [--plain] [--steps N]

``--plain``: the same run without memkern (memkern is never imported), plain torch issuing the
collectives ZeRO-2 issues: per parameter bucket an asynchronous reduce-scatter of a staging
buffer filled by post-accumulate-grad hooks during backward, at most two in flight; after the
step, asynchronous all-gathers of the updated weights. The twin tells whether a death at exit
is memkern's or torch's.
"""
import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
# torch 2.13 renamed the tensor collectives and deprecated the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(67, 129), torch.nn.GELU(),
                               torch.nn.Linear(129, 129), torch.nn.GELU(),
                               torch.nn.Linear(129, 3))


def train_memkern(model: torch.nn.Module, steps: int, rank: int) -> None:
    import memkern as mk

    opt = mk.optim.ShardedOptimizer(model.parameters(), "adamw", lr=1e-3, zero_stage=2,
                                    bucket_size_mb=0.02)
    for step in range(steps):
        x = torch.randn(8, 67, generator=torch.Generator().manual_seed(step * WORLD + rank))
        opt.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad()


def train_plain(model: torch.nn.Module, steps: int, rank: int, torch_optimizer: bool) -> None:
    """ZeRO-2 in plain torch: a bucket per parameter, reduce-scattered asynchronously from the
    hook that fills it, two in flight; this rank's float32 slices stepped by
    ``torch.optim.AdamW`` (``torch_optimizer``) or by a hand-written SGD step; the weights
    all-gathered asynchronously."""
    params = list(model.parameters())
    pad = [-(-p.numel() // WORLD) * WORLD for p in params]
    mine = [slice(rank * n // WORLD, (rank + 1) * n // WORLD) for n in pad]
    masters = []
    for p, n, s in zip(params, pad, mine):
        full = torch.zeros(n)
        full[:p.numel()] = p.detach().reshape(-1)
        masters.append(torch.nn.Parameter(full[s].clone()))
        masters[-1].grad = torch.zeros_like(masters[-1])
    opt = torch.optim.AdamW(masters, lr=1e-3) if torch_optimizer else None
    in_flight = []

    def launch(work, finish) -> None:
        in_flight.append((work, finish))
        while len(in_flight) > 2:
            finish_oldest()

    def finish_oldest() -> None:
        work, finish = in_flight.pop(0)
        work.wait()
        finish()

    def reducer(i: int):
        def reduce(p: torch.Tensor) -> None:
            staging = torch.zeros(pad[i])
            staging[:p.numel()] = p.grad.reshape(-1)
            p.grad = None
            reduced = torch.empty(pad[i] // WORLD)
            launch(_reduce_scatter(reduced, staging, async_op=True),
                   lambda: masters[i].grad.add_(reduced))
        return reduce

    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(reducer(i))
    for step in range(steps):
        x = torch.randn(8, 67, generator=torch.Generator().manual_seed(step * WORLD + rank))
        model(x).square().mean().backward()
        while in_flight:
            finish_oldest()
        with torch.no_grad():
            if opt is not None:
                opt.step()
            else:
                for master in masters:
                    master.sub_(master.grad, alpha=1e-3)
            for p, n, master in zip(params, pad, masters):
                master.grad.zero_()
                full = torch.empty(n)
                launch(_all_gather(full, master.detach().clone(), async_op=True),
                       lambda p=p, full=full: p.copy_(full[:p.numel()].view_as(p)))
            while in_flight:
                finish_oldest()


def run(rank: int, store: str, plain: bool, torch_optimizer: bool, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD)
    model = make_model()
    if plain:
        train_plain(model, steps, rank, torch_optimizer)
    else:
        train_memkern(model, steps, rank)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plain", action="store_true", help="without memkern")
    parser.add_argument("--hand-step", action="store_true",
                        help="with --plain: step by hand rather than with torch.optim.AdamW")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    store = os.path.join(tempfile.mkdtemp(prefix="zero-exit-"), "store")
    mp.spawn(run, args=(store, args.plain, not args.hand_step, args.steps), nprocs=WORLD)


if __name__ == "__main__":
    main()
