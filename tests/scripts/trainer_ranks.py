"""Run by tests/test_integrations_trainer_ranks.py, in one process or under ``torchrun`` /
``accelerate launch``: trains test_integrations_transformers.py's tiny Llama on its token
sequences with ``MemkernTrainer`` (or plain ``Trainer``), a global batch of ``--global-batch``
sequences split over the ranks, and writes what it logged to ``--result`` (rank 0): the loss
of every optimizer step this run took (a resumed run: from its checkpoint on), and per rank
the model's wrapper and the optimizer state it holds. ``--late-rank``: the last rank lingers
after writing its own files of the first checkpoint and reports whether that checkpoint was
marked complete meanwhile (it must not be: the marker says every rank's files are written).

    torchrun --standalone --nproc-per-node 2 tests/scripts/trainer_ranks.py --out DIR ...
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from transformers import Trainer, TrainerCallback  # noqa: E402

from clean_exit import DTENSOR_CACHES, end_finished_rank  # noqa: E402
from memkern.integrations.transformers import MemkernTrainer, last_complete_checkpoint  # noqa: E402
from test_integrations_transformers import Sequences, arguments, tiny_llama  # noqa: E402

SEQUENCES = 40
"""Per epoch: 5 micro-batches of 8 sequences, windows of 2, 2 and 1 (the epoch's end)."""


LATE_S = 3.0
"""``--late-rank``: how long the last rank lingers after writing its files of the first
checkpoint, watching for the checkpoint to be marked complete."""


def linger_after_own_files(trainer: Trainer, output_dir: str) -> dict[str, bool]:
    """Makes this rank linger for LATE_S after writing its own files of the first checkpoint
    in ``output_dir`` (an empty folder: a complete checkpoint there is that one). Its RNG state
    is the last file Trainer writes per rank; the returned dict says, once saved, whether the
    checkpoint was marked complete before this rank was done."""
    seen: dict[str, bool] = {}
    save_rng_state = trainer._save_rng_state

    def late(checkpoint_dir: str) -> None:
        save_rng_state(checkpoint_dir)
        if seen:
            return
        deadline = time.monotonic() + LATE_S
        while last_complete_checkpoint(output_dir) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        seen["marked_before_this_rank_was_done"] = last_complete_checkpoint(output_dir) is not None

    trainer._save_rng_state = late
    return seen


class Losses(TrainerCallback):
    """The loss of each step logged in this run, by step."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]


def main(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", choices=("memkern", "plain"), default="memkern")
    parser.add_argument("--zero-stage", type=int, default=1)
    parser.add_argument("--fsdp2", action="store_true", help="MemkernTrainer(fsdp2=True)")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--save-steps", type=int)
    parser.add_argument("--resume")
    parser.add_argument("--result", required=True)
    parser.add_argument("--late-rank", action="store_true",
                        help="the last rank lingers after its files of the first checkpoint")
    args = parser.parse_args(argv)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(args.seed + int(os.environ.get("RANK", "0")))  # ranks start unequal:
    model = tiny_llama()  # the optimizer broadcasts rank 0's weights, as DDP would
    saving = dict(save_strategy="steps", save_steps=args.save_steps) if args.save_steps else {}
    training = arguments(args.out, steps=args.steps, batch=args.global_batch // world,
                         seed=args.seed, logging_steps=1, learning_rate=3e-3, **saving)
    losses = Losses()
    common = dict(model=model, args=training, train_dataset=Sequences(SEQUENCES, args.seed),
                  callbacks=[losses])
    if args.trainer == "memkern":
        trainer = MemkernTrainer(**common, fsdp2=True) if args.fsdp2 else \
            MemkernTrainer(**common, zero_stage=args.zero_stage)
    else:
        trainer = Trainer(**common)
    late = None
    if args.late_rank and int(os.environ.get("RANK", "0")) == world - 1:
        late = linger_after_own_files(trainer, args.out)
    trainer.train(resume_from_checkpoint=args.resume)

    opt = getattr(trainer, "memkern_optimizer", None)
    if args.fsdp2:  # the moments' local shards
        held = sum(t.to_local().numel() for state in opt.state.values()
                   for t in state.values() if isinstance(t, DTensor))
    else:
        held = None if opt is None else sum(t.numel() for seg in opt._segments
                                            for t in seg.state.values())
    mine = {"wrapper": type(trainer.model_wrapped).__name__, "state_elements": held,
            "world": world, "zero_stage": getattr(opt, "zero_stage", None),
            "optimizer": type(opt).__name__, "late": late}
    ranks = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(ranks, mine)
    else:
        ranks = [mine]
    if trainer.args.process_index == 0:
        with open(args.result, "w") as fh:
            json.dump({"losses": losses.losses, "ranks": ranks,
                       "parameters": sum(p.numel() for p in model.parameters())}, fh)
    return args


if __name__ == "__main__":
    torch.set_num_threads(1)  # the ranks share the machine's cores
    args = main()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        end_finished_rank(DTENSOR_CACHES if args.fsdp2 else None)
