"""Fine-tuning an encoder for sequence classification with memkern, end to end: an XLM-RoBERTa
built from a config (nothing downloaded, a small size), ``memkern.patch`` (its MLPs fused, the
layers saving less for backward), AMP through ``ShardedOptimizer`` on a GPU, and the planner's
figure for the same step at the write-up's size.

    python examples/finetune_encoder.py [--steps 60] [--plan]

The task: is token 7 in the sequence? The loss printed every 20 steps goes down. ``--plan``
also prints what ``memkern plan`` says XLM-R Large needs at batch 8 x 256 on a GPU.
"""
import argparse

import torch
import transformers

import memkern as mk

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=60)
ap.add_argument("--plan", action="store_true")
args = ap.parse_args()

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
config = transformers.XLMRobertaConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, intermediate_size=256,
                                       max_position_embeddings=66, num_labels=2)
model = transformers.XLMRobertaForSequenceClassification(config).to(device).train()
mk.patch(model)                                   # fused MLPs, memkern Linear/LayerNorm/Dropout
opt = mk.optim.ShardedOptimizer(model.parameters(), "adamw", lr=1e-3, max_grad_norm=1.0,
                                loss_scale="dynamic" if device == "cuda" else None)


def batch(n: int = 16, seq: int = 32):
    ids = torch.randint(8, config.vocab_size, (n, seq))
    labels = torch.randint(0, 2, (n,))
    ids[labels == 1, torch.randint(1, seq, (int(labels.sum()),))] = 7  # the answer
    return ids.to(device), labels.to(device)


for step in range(1, args.steps + 1):
    ids, labels = batch()
    with torch.autocast(device, dtype=torch.float16 if device == "cuda" else torch.bfloat16):
        loss = model(input_ids=ids, labels=labels).loss
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    if step % 20 == 0:
        print(f"step {step:3d}  loss {loss.item():.3f}")

if args.plan:
    from memkern.profile import hf_config, hf_workload, plan_training_step

    large = hf_config("xlm-roberta", dict(hidden_size=1024, num_hidden_layers=24,
                                          num_attention_heads=16, intermediate_size=4096))
    plan = plan_training_step(hf_workload(
        large, batch=8, seq=256, dtype=torch.float32, task="sequence-classification",
        autocast=torch.float16, patch={}, optimizer="memkern-adamw-8bit"), device="cuda")
    print(f"XLM-R Large, batch 8 x 256, AMP + memkern.patch + 8-bit AdamW state: "
          f"{plan.run_peak / 2**30:.2f} GiB planned on a GPU")
