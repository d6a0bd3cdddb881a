"""Saved-for-backward bytes of a LoRA fine-tune: plain PEFT against ``memkern.patch`` before and
after ``peft.get_peft_model`` (the same model, adapters and batch), on a config-built Llama
(nothing downloaded), float32, CPU.

    python benchmarks/saved_lora.py [--hidden 256 --intermediate 688 --layers 4 --heads 8
        --kv-heads 4 --vocab 4096 --batch 4 --seq 512 --r 16 --dropout 0.0 --qlora]

LoRA (``peft.LoraConfig(r, lora_alpha=2r, lora_dropout)``) on all seven projections (q, k, v,
o, gate, up, down); with ``--qlora`` those projections are bitsandbytes 4-bit layers (NF4,
float32 compute: needs bitsandbytes, whose 4-bit layers run on the CPU from 0.50). Prints each
variant's saved bytes (memkern.profile's recorder: each storage once, parameters excluded) and
its ratio to plain PEFT, then what the saved tensors are, by shape and dtype. (Not by module:
hooks on the adapters' layers would make memkern's LoRA layers run PEFT's own forward, which
calls them.)
"""
from __future__ import annotations

import argparse
import collections
import copy

import peft
import torch
import transformers

import memkern as mk
from memkern.profile import SavedTensorsRecorder

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def four_bit(model: torch.nn.Module) -> None:
    """``model``'s projections as bitsandbytes 4-bit layers, quantized from their weights."""
    import bitsandbytes

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, old in list(parent.named_children()):
                if name in PROJECTIONS:
                    new = bitsandbytes.nn.Linear4bit(old.in_features, old.out_features,
                                                     bias=False, compute_dtype=torch.float32,
                                                     quant_type="nf4")
                    new.load_state_dict(old.state_dict())
                    setattr(parent, name, new.to("cpu"))  # quantized as it is moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, default in (("hidden", 256), ("intermediate", 688), ("layers", 4), ("heads", 8),
                          ("kv-heads", 4), ("vocab", 4096), ("batch", 4), ("seq", 512),
                          ("r", 16)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--qlora", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        max_position_embeddings=args.seq, attn_implementation="sdpa")).train()
    if args.qlora:
        four_bit(base)
    config = peft.LoraConfig(r=args.r, lora_alpha=2 * args.r, lora_dropout=args.dropout,
                             target_modules=PROJECTIONS)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    variants = {
        "plain PEFT": lambda: peft.get_peft_model(copy.deepcopy(base), config),
        "patch, then get_peft_model": lambda: peft.get_peft_model(mk.patch(copy.deepcopy(base)),
                                                                  config),
        "get_peft_model, then patch": lambda: mk.patch(peft.get_peft_model(copy.deepcopy(base),
                                                                           config)),
    }
    print(("QLoRA: " if args.qlora else "") + f"Llama hidden {args.hidden}, intermediate "
          f"{args.intermediate}, {args.layers} layers, "
          f"vocab {args.vocab}; LoRA r={args.r} on {', '.join(PROJECTIONS)}, dropout "
          f"{args.dropout}; batch {args.batch} x {args.seq}, float32")
    plain = None
    for name, make in variants.items():
        model = make()
        with SavedTensorsRecorder() as recorder:
            model(input_ids=ids, labels=ids)
        plain = plain or recorder.bytes
        print(f"{name:28s} {recorder.bytes / 2**20:8.1f} MiB  {recorder.bytes / plain:.3f}x "
              "plain PEFT")
        by_shape = collections.Counter()
        for entry in recorder.entries.values():
            by_shape[tuple(entry.shape), str(entry.dtype).removeprefix("torch.")] += entry.nbytes
        for (shape, dtype), n in by_shape.most_common():
            print(f"    {n / 2**20:8.2f}  {list(shape)} {dtype}")

if __name__ == "__main__":
    main()
