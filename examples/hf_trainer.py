"""Hugging Face ``Trainer`` with memkern: ``MemkernTrainer`` in place of ``Trainer``.

    python examples/hf_trainer.py                     # a tiny GPT-2 built from a config
    python examples/hf_trainer.py --bf16 --steps 60   # bf16 weights, float32 masters
    python examples/hf_trainer.py --resume            # continue from the last checkpoint
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --zero-stage 2
                                                      # 2 processes, ZeRO-2 (docs/distributed.md)
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --fsdp2
                                                      # 2 processes, FSDP2 + FusedAdamW

The model is built from a config (nothing is downloaded) and learns arithmetic token
sequences. Checkpoints go to ``--out``, by default a folder in the system's temporary
directory (``DEFAULT_OUT``), so running the example leaves nothing in the checkout. Gradient
accumulation, clipping, the LR schedule and checkpoints are ``Trainer``'s own ``TrainingArguments``;
memkern's optimizer takes them over (see docs/integrations.md).
"""
import argparse
import os
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from memkern.integrations.transformers import MemkernTrainer

VOCAB, SEQ = 256, 64
DEFAULT_OUT = os.path.join(tempfile.gettempdir(), "memkern-examples", "hf_trainer")


class Sequences(torch.utils.data.Dataset):
    """``start, start + k, start + 2k, ...`` modulo the vocabulary: learnable next tokens."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 5, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--bf16", action="store_true", help="bf16 weights, float32 masters")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help=f"checkpoint directory (default: {DEFAULT_OUT})")
    parser.add_argument("--resume", action="store_true", help="resume from --out's last "
                        "checkpoint")
    parser.add_argument("--zero-stage", type=int, default=1, choices=(1, 2),
                        help="across processes: the optimizer state (1) and the gradients too "
                        "(2) split over the ranks")
    parser.add_argument("--fsdp2", action="store_true", help="under torchrun: shard the "
                        "parameters with FSDP2, stepped by memkern's FusedAdamW")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB,
                                       n_positions=SEQ, bos_token_id=0, eos_token_id=0))
    training = TrainingArguments(
        args.out, max_steps=args.steps, per_device_train_batch_size=8,
        gradient_accumulation_steps=2, learning_rate=3e-3, weight_decay=0.01,
        max_grad_norm=1.0, lr_scheduler_type="cosine", warmup_steps=3, bf16=args.bf16,
        logging_steps=min(10, args.steps), save_steps=max(1, args.steps // 2), report_to=[],
        use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    sharding = dict(fsdp2=True) if args.fsdp2 else dict(zero_stage=args.zero_stage)
    trainer = MemkernTrainer(model=model, args=training, train_dataset=Sequences(512),
                             **sharding)
    result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    if not trainer.is_world_process_zero():
        return
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    last = (f"last logged loss {logs[-1]['loss']:.3f}, grad norm {logs[-1]['grad_norm']:.3f}"
            if logs else "no loss logged yet")
    print(f"trained {trainer.state.global_step} steps, {last} (mean over the run "
          f"{result.training_loss:.3f}); checkpoints in {args.out}; {training.world_size} "
          f"process(es), {'FSDP2' if args.fsdp2 else f'ZeRO-{args.zero_stage}'}")


if __name__ == "__main__":
    main()
    # Under torchrun / accelerate launch: free the process group before the interpreter ends,
    # else gloo's threads run into its finalization, where one can end a finished rank with
    # SIGABRT (docs/reliability.md, "A finished run does not die at exit")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
