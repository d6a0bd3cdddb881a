"""The plain-torch twin of ``tests/scripts/zero_exit.py``: the same run on 2 gloo ranks
without memkern (it is never imported), plain torch issuing the collectives memkern's ZeRO-2
issues: a bucket per parameter, filled by a post-accumulate-grad hook during backward and
reduce-scattered asynchronously, at most two in flight; this rank's float32 slices stepped by
``torch.optim.AdamW`` (or by hand: ``--hand-step``); the weights all-gathered
asynchronously. ``torch.multiprocessing.spawn``, ``destroy_process_group()``, return: no
``os._exit``. It tells whether a death at exit is memkern's or torch's (docs/reliability.md).

    python tests/scripts/zero_exit_torch.py [--hand-step] [--steps N]
"""
import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
# torch 2.13 renamed the tensor collectives and deprecated the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def make_model() -> torch.nn.Module:
    """The same model on every rank (seeded)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(67, 129), torch.nn.GELU(),
                               torch.nn.Linear(129, 129), torch.nn.GELU(),
                               torch.nn.Linear(129, 3))


def batch(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s inputs of step ``step``."""
    return torch.randn(8, 67, generator=torch.Generator().manual_seed(step * WORLD + rank))


def store_path() -> str:
    """A fresh rendezvous file for ``init_process_group``'s file store."""
    return os.path.join(tempfile.mkdtemp(prefix="zero-exit-"), "store")


def train(model: torch.nn.Module, steps: int, rank: int, hand_step: bool) -> None:
    params = list(model.parameters())
    pad = [-(-p.numel() // WORLD) * WORLD for p in params]
    mine = [slice(rank * n // WORLD, (rank + 1) * n // WORLD) for n in pad]
    masters = []
    for p, n, own in zip(params, pad, mine):
        full = torch.zeros(n)
        full[:p.numel()] = p.detach().reshape(-1)
        masters.append(torch.nn.Parameter(full[own].clone()))
        masters[-1].grad = torch.zeros_like(masters[-1])
    opt = None if hand_step else torch.optim.AdamW(masters, lr=1e-3)
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
        model(batch(step, rank)).square().mean().backward()
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


def run(rank: int, store: str, steps: int, hand_step: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD)
    train(make_model(), steps, rank, hand_step)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hand-step", action="store_true",
                        help="step the shards by hand rather than with torch.optim.AdamW")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    mp.spawn(run, args=(store_path(), args.steps, args.hand_step), nprocs=WORLD)
