"""A 2-rank ``MemkernTrainer`` run that survives SIGKILL: run under ``torchrun --max-restarts``,
it saves a checkpoint every ``--every`` steps (``save_steps``, ``save_total_limit=2``) and,
started again, resumes from the last complete one (``last_complete_checkpoint``). Used by
``tests/test_optim_kill_resume.py`` (seeded kill points) and ``scripts/kill_resume.py``
(``--trainer``: kills at random moments).

    torchrun --standalone --nproc-per-node 2 --max-restarts 9 \\
        tests/scripts/kill_resume_trainer.py --dir DIR

The model is test_integrations_transformers.py's tiny Llama in float16, with dynamic loss
scaling started at 2**20 (the first steps overflow and are skipped, so a checkpoint holds
skipped steps), ZeRO-2, windows of 2 micro-batches, clipping, a warm-up schedule. As in
``kill_resume_train.py`` (whose ``Killer``, pid files and log lines this script shares; mode
``trainer``): ``DIR/trainer/reference/`` is an uninterrupted run, ``DIR/trainer/resumed/`` the
run that is killed, each ending with ``final.pt`` (rank 0's parameters and the full optimizer
state dict). Kill points (``MEMKERN_KILL_AT``, ``trainer:<point>:<step>:<rank>``): ``backward``,
``step`` (inside the fused step) and ``saved`` (the checkpoint's optimizer and scheduler
written, its RNG states, trainer state and completion marker not yet); ``<step>`` counts the
optimizer steps done before it.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from transformers import TrainerCallback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from kill_resume_train import Killer, killable_rank, log, save_final  # noqa: E402
from memkern.integrations.transformers import MemkernTrainer, last_complete_checkpoint  # noqa: E402
from test_integrations_transformers import Sequences, arguments, tiny_llama  # noqa: E402

MODE = "trainer"
PER_RANK_BATCH, SEQUENCES = 2, 16  # 4 micro-batches per rank and epoch: 2 steps an epoch
INITIAL_SCALE = 2.0**15


class Progress(TrainerCallback):
    """Tells the killer where the run is, logs each start and finished step, and slows the
    steps down (more moments for a random kill)."""

    def __init__(self, directory: str, phase: str, rank: int, killer: Killer,
                 slow: float) -> None:
        self.directory, self.phase, self.rank = directory, phase, rank
        self.killer, self.slow = killer, slow

    def _log(self, what: str, step: int) -> None:
        log(self.directory, self.rank, f"{MODE} {self.phase} {what} {step}")

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        self._log("start", state.global_step)

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self.killer.window = state.global_step
        self.killer.updates = 0
        time.sleep(self.slow)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self._log("done", state.global_step - 1)


def run(phase: str, args: argparse.Namespace, rank: int, killer: Killer) -> None:
    """Trains (or resumes) the ``phase`` run; writes its ``final.pt``."""
    where = os.path.join(args.dir, MODE, phase)
    final = os.path.join(where, "final.pt")
    if os.path.exists(final):
        return
    killer.mode = MODE if phase == "resumed" else None
    torch.manual_seed(args.seed)
    model = tiny_llama()
    training = arguments(where, steps=args.steps, batch=PER_RANK_BATCH, seed=args.seed,
                         fp16=True, save_strategy="steps", save_steps=args.every,
                         save_total_limit=2, logging_steps=1)
    trainer = MemkernTrainer(model=model, args=training, zero_stage=2,
                             train_dataset=Sequences(SEQUENCES, args.seed),
                             callbacks=[Progress(args.dir, phase, rank, killer, args.slow)])
    opt = trainer.create_optimizer()
    opt.scaler.load_state_dict({**opt.scaler.state_dict(), "scale": INITIAL_SCALE})
    killer.watch(model.model.layers[0].mlp.up_proj.weight)
    save = trainer._save_optimizer_and_scheduler

    def saved(output_dir: str) -> None:
        save(output_dir)
        killer.at("saved")

    trainer._save_optimizer_and_scheduler = saved
    trainer.train(resume_from_checkpoint=last_complete_checkpoint(where))
    save_final(model, opt, final, rank)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--phases", default="reference,resumed")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2, help="checkpoint every k steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slow", type=float, default=0.0, help="seconds of sleep per step")
    args = parser.parse_args()
    with killable_rank(args.dir) as (rank, killer):
        for phase in args.phases.split(","):
            run(phase, args, rank, killer)


if __name__ == "__main__":
    main()
