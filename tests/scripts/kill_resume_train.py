"""A 2-rank training run that survives SIGKILL: run under ``torchrun --max-restarts``, it
checkpoints every ``--every`` windows and, started again, resumes from the last complete
checkpoint. Used by ``tests/test_optim_kill_resume.py`` (seeded kill points) and
``scripts/kill_resume.py`` (kills at random moments).

    torchrun --standalone --nproc-per-node 2 --max-restarts 9 \\
        tests/scripts/kill_resume_train.py --dir DIR \\
        --modes zero2,offload-8bit,streamed-8bit,offload-1proc

For each mode, in ``DIR/<mode>/``: ``reference/`` (an uninterrupted run, made first) and
``resumed/`` (the run that is killed and restarted); each ends with ``final.pt`` (rank 0's
parameters and the full optimizer state dict). Modes already finished are skipped, so a
restart goes on where it was. Each rank writes its pid to ``DIR/pids/<rank>`` at start (for a
driver that kills it) and appends ``<mode> start <window>`` / ``<mode> done <window>`` to
``DIR/log.<rank>`` (``<mode> <reference|resumed> start|done <window>``).

Kill points (``MEMKERN_KILL_AT``, comma-separated ``<mode>:<point>:<window>:<rank>``; each
fires once: ``DIR/fired.<rank>`` lists those that did): the process SIGKILLs itself at
``backward`` (inside the backward pass, from a parameter's gradient hook), ``step`` (inside
the optimizer's update, after its first segment: the fused step, or the host step with
offload), ``marked`` (a checkpoint written and marked complete, not yet renamed into place)
and ``renamed`` (the previous checkpoint moved aside, the new one not yet in its place).
The hooks live here, not in memkern.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import memkern as mk
from memkern.optim import checkpoint
from memkern.optim.fused_adamw import AdamW

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from clean_exit import end_finished_rank  # noqa: E402  (tests/)

ACCUMULATION, BATCH = 2, 8
POISONED = (5, 1)  # (window, micro-batch) whose loss is inf on rank 1: a skipped window
MODES = {
    "zero2": dict(zero_stage=2),
    "offload-8bit": dict(zero_stage=2, offload="cpu", state_precision="8bit"),
    "streamed-8bit": dict(zero_stage=2, gradients="host", state_precision="8bit"),
    "offload-1proc": dict(offload="cpu"),
}
ONE_PROCESS = {"offload-1proc"}
"""Modes in which each rank trains alone (an optimizer over a process group of its own rank,
the same data on every rank): one process's offload, whose host steps start during backward
on host copies of the weights, and whose checkpoints each rank writes and reads itself."""


class Net(torch.nn.Module):
    """fc1.weight has 13 x 400 = 5200 elements: 8-bit state where asked."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(13, 400)
        self.fc2 = torch.nn.Linear(400, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Killer:
    """SIGKILLs this process when an armed point is reached: ``mode`` and ``window`` say where
    the run is (mode None: a reference run, never killed)."""

    def __init__(self, directory: str, rank: int) -> None:
        self.fired = os.path.join(directory, f"fired.{rank}")
        done = set(open(self.fired).read().split()) if os.path.exists(self.fired) else set()
        self.armed = {}
        for spec in filter(None, os.environ.get("MEMKERN_KILL_AT", "").split(",")):
            mode, point, window, r = spec.split(":")
            if int(r) == rank and spec not in done:
                self.armed[mode, point, int(window)] = spec
        self.mode: str | None = None
        self.window = -1

    def at(self, point: str) -> None:
        spec = self.armed.get((self.mode, point, self.window))
        if spec is not None:
            with open(self.fired, "a") as fh:  # each kill point fires once
                fh.write(spec + "\n")
            os.kill(os.getpid(), signal.SIGKILL)

    def install(self) -> None:
        """The optimizer's update and the checkpoint's publishing steps, hooked (the backward
        pass is hooked per model: :meth:`watch`)."""
        update = AdamW.update
        self.updates = 0

        def counted(*args, **kwargs):
            update(*args, **kwargs)
            self.updates += 1
            if self.updates == 1:  # the window's first segment is stepped, the others not
                self.at("step")

        AdamW.update = staticmethod(counted)
        finish, rename = checkpoint._finish_publish, os.rename

        def finish_publish(staging: str, path: str) -> None:
            self.at("marked")
            finish(staging, path)

        def renamed(src, dst, *args, **kwargs):
            rename(src, dst, *args, **kwargs)
            if str(dst).endswith(checkpoint.OLD):
                self.at("renamed")

        checkpoint._finish_publish = finish_publish
        checkpoint.os.rename = renamed

    def watch(self, parameter: torch.nn.Parameter) -> None:
        """Arms ``backward`` on ``parameter``'s gradient (once it is accumulated)."""
        parameter.register_post_accumulate_grad_hook(lambda p: self.at("backward"))


def batch(seed: int, window: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + window * ACCUMULATION + micro)
    x, y = torch.randn(BATCH, 13, generator=g), torch.randn(BATCH, 5, generator=g)
    rows = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    return x[rows], y[rows]


def log(directory: str, rank: int, line: str) -> None:
    with open(os.path.join(directory, f"log.{rank}"), "a") as fh:
        fh.write(line + "\n")


def save_model(model: Net, path: str) -> None:
    torch.save(model.state_dict(), path + ".tmp")
    os.replace(path + ".tmp", path)


def save_final(model: torch.nn.Module, opt: mk.optim.ShardedOptimizer, final: str,
               rank: int) -> None:
    """Writes the run's result to ``final`` (rank 0): the parameters and the full optimizer
    state (collective: every rank calls this)."""
    state = opt.state_dict()
    if rank == 0:
        torch.save({"params": [p.detach().clone() for p in model.parameters()],
                    "state": state, "loss_scale": opt.loss_scale,
                    "skipped": opt.skipped_steps}, final + ".tmp")
        os.replace(final + ".tmp", final)
    dist.barrier()


def run(mode: str, where: str, args: argparse.Namespace, rank: int, killer: Killer) -> None:
    """Trains ``mode`` in ``where``, resuming from its checkpoint; writes ``final.pt``."""
    os.makedirs(where, exist_ok=True)
    final = os.path.join(where, "final.pt")
    if os.path.exists(final):
        return
    alone = mode in ONE_PROCESS
    own_group = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    tag = f".{rank}" if alone else ""  # the files this rank writes and reads alone
    torch.manual_seed(args.seed)
    model = Net()
    opt = mk.optim.ShardedOptimizer(
        model.parameters(), "adamw", lr=3e-3, eps=1e-3, accumulation_steps=ACCUMULATION,
        max_grad_norm=0.5, bucket_size_mb=1e-2, process_group=own_group if alone else None,
        loss_scale=mk.LossScaler(init_scale=2.0**10, growth_interval=3), **MODES[mode])
    ckpt = os.path.join(where, "ckpt" + tag)
    start = 0
    if checkpoint.is_complete(ckpt):
        # The optimizer's state first, then the model's weights (which the optimizer must
        # take, not overwrite with stale copies: issue 45)
        opt.load_sharded(ckpt)
        state = opt.state_dict()["state"]
        start = int(state[0]["step"]) + opt.skipped_steps  # windows done (all closed)
        model.load_state_dict(torch.load(os.path.join(where, f"model-{start}{tag}.pt")))
    killer.watch(model.fc1.weight)
    log(args.dir, rank, f"{mode} {os.path.basename(where)} start {start}")
    for window in range(start, args.windows):
        killer.window = window
        killer.updates = 0
        time.sleep(args.slow)
        for micro in range(ACCUMULATION):
            x, y = batch(args.seed, window, micro, 0 if alone else rank)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if (window, micro) == POISONED and (rank == 1 or alone):
                loss = loss * float("inf")
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
        log(args.dir, rank, f"{mode} {os.path.basename(where)} done {window}")
        if (window + 1) % args.every == 0 and window + 1 < args.windows:
            done = window + 1
            if rank == 0 or alone:
                save_model(model, os.path.join(where, f"model-{done}{tag}.pt"))
            dist.barrier()
            opt.save_sharded(ckpt)
            if rank == 0 or alone:  # the model files of older checkpoints are no longer needed
                for name in os.listdir(where):
                    if (name.startswith("model-") and name.endswith(f"{tag}.pt")
                            and name != f"model-{done}{tag}.pt"):
                        os.remove(os.path.join(where, name))
    save_final(model, opt, final, rank)


def start_rank(directory: str) -> int:
    """Joins the gloo process group of this torchrun incarnation and writes this rank's pid to
    ``directory/pids/<rank>``; returns the rank."""
    # The agent's store, under a prefix of this incarnation's own: gloo's addresses from an
    # incarnation that was killed must not be read by the next one.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.PrefixStore(
        f"incarnation-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
        dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False,
                      timeout=timedelta(seconds=60)))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    os.makedirs(os.path.join(directory, "pids"), exist_ok=True)
    with open(os.path.join(directory, "pids", str(rank)), "w") as fh:
        fh.write(str(os.getpid()))
    return rank


@contextlib.contextmanager
def killable_rank(directory: str):
    """This rank, one thread, in the process group, with its :class:`Killer` armed: yields
    ``(rank, killer)``; after the runs, the group destroyed and the rank ended
    (tests/clean_exit.py)."""
    torch.set_num_threads(1)
    rank = start_rank(directory)
    killer = Killer(directory, rank)
    killer.install()
    try:
        yield rank, killer
    finally:
        dist.destroy_process_group()
    end_finished_rank()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--phases", default="reference,resumed",
                        help="which runs: the uninterrupted reference, the resumed one")
    parser.add_argument("--windows", type=int, default=12)
    parser.add_argument("--every", type=int, default=4, help="checkpoint every k windows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slow", type=float, default=0.0,
                        help="seconds of sleep per window (more moments for random kills)")
    args = parser.parse_args()
    with killable_rank(args.dir) as (rank, killer):
        for mode in args.modes.split(","):
            for phase in args.phases.split(","):
                killer.mode = mode if phase == "resumed" else None
                run(mode, os.path.join(args.dir, mode, phase), args, rank, killer)


if __name__ == "__main__":
    main()
