"""LoRA fine-tuning with trl's ``SFTTrainer``, memkern's layers and memkern's optimizer.

    python examples/lora_sft.py                 # a tiny Llama built from a config, on the CPU
    python examples/lora_sft.py --offload cpu   # the optimizer's state in host memory

``MemkernTrainerMixin`` put before ``SFTTrainer`` gives it what ``MemkernTrainer`` gives
``Trainer``: the model patched with ``memkern.patch`` (before trl wraps it with PEFT from
``peft_config``) and ``memkern.optim.ShardedOptimizer`` stepping the LoRA adapters. trl's own
chunked LM head computes the loss (see docs/integrations.md). Nothing is downloaded: the
model is built from a config and the tokenizer (one token per character) in memory; the
checkpoints go to a folder in the system's temporary directory.
"""
import argparse
import os
import tempfile

import datasets
import tokenizers
import torch
import transformers
from peft import LoraConfig
from trl import SFTConfig, SFTTrainer

from memkern.integrations.transformers import MemkernTrainerMixin

CHARACTERS = "abcdefghijklmnopqrstuvwxyz ."
OUT = os.path.join(tempfile.gettempdir(), "memkern-examples", "lora_sft")


class MemkernSFTTrainer(MemkernTrainerMixin, SFTTrainer):
    """trl's SFTTrainer with memkern's layers and optimizer."""


def character_tokenizer() -> transformers.PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2,
             **{c: i + 3 for i, c in enumerate(CHARACTERS)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                eos_token="<eos>", unk_token="<unk>")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    parser.add_argument("--offload", choices=("cpu",), default=None,
                        help="keep the optimizer's state in host memory")
    args = parser.parse_args()

    torch.manual_seed(0)
    tokenizer = character_tokenizer()
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=1))
    sentences = ["the cat sat on the mat.", "a dog ran in the park.", "we like to read books.",
                 "memkern keeps memory low.", "the sun is warm today."]
    dataset = datasets.Dataset.from_dict({"text": sentences * 20})

    config = SFTConfig(OUT, max_steps=args.steps, per_device_train_batch_size=10,
                       learning_rate=1e-2, lr_scheduler_type="cosine", max_grad_norm=1.0,
                       logging_steps=10, save_strategy="no", report_to=[], seed=0,
                       bf16=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available(),
                       disable_tqdm=True)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
    trainer = MemkernSFTTrainer(model=model, args=config, train_dataset=dataset,
                                processing_class=tokenizer, peft_config=lora,
                                offload=args.offload)
    trainer.train()
    trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    print(f"{type(trainer.memkern_optimizer).__name__} stepped {trained} LoRA parameters")
    for entry in trainer.state.log_history:
        if "loss" in entry:
            print(f"step {entry['step']:4d}  loss {entry['loss']:.4f}")


if __name__ == "__main__":
    main()
