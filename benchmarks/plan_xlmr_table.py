"""The XLM-RoBERTa fine-tuning table of the "Training large model with your GPU" write-up,
planned: a GPU's peak memory for XLM-R Base and Large, sequence classification, AdamW.

Rows (each a :func:`memkern.profile.plan_training_step` of ``hf_workload(task=
"sequence-classification")``, float32 parameters, the configs' dropout):

* ``fp32``: plain transformers, torch AdamW (fused);
* ``amp``: the forward under ``torch.autocast(dtype=float16)``;
* ``amp+ckpt``: and transformers' gradient checkpointing (``gradient_checkpointing_enable()``);
* ``amp+patch``: ``memkern.patch(model)`` instead of checkpointing;
* ``amp+patch+8bit``: and memkern's FusedAdamW with 8-bit state;
* ``amp+patch-full+8bit``: and ``memkern.patch(model, recompute="full")``;
* ``amp+ckpt+patch+8bit``: transformers' gradient checkpointing, ``memkern.patch`` and the
  8-bit state together.

Columns: the peak a GPU's ``torch.cuda.max_memory_allocated()`` would report, and what the
caching allocator reserved by the end (what ``nvidia-smi`` shows, less the CUDA context's few
hundred MiB). The write-up measured XLM-R Base at batch 8: 12.28 GB (float32), 10.95 GB (AMP);
Large: out of memory on 24 GB (float32), 23.5 GB (AMP), 11.8 GB (AMP + checkpointing); it does
not say its sequence length: 256 and 512 are planned.

    python benchmarks/plan_xlmr_table.py [--sizes base,large] [--seqs 256,512] [--batch 8]
                                         [--device cuda] [--save PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from memkern.profile import plan_training_step  # noqa: E402
from memkern.profile.workloads import hf_config, hf_workload  # noqa: E402

SIZES = {
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072),
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                  intermediate_size=4096),
}
# row -> hf_workload options besides the model and batch
ROWS = {
    "fp32": dict(),
    "amp": dict(autocast=torch.float16),
    "amp+ckpt": dict(autocast=torch.float16, gradient_checkpointing=True),
    "amp+patch": dict(autocast=torch.float16, patch={}),
    "amp+patch+8bit": dict(autocast=torch.float16, patch={}, optimizer="memkern-adamw-8bit"),
    "amp+patch-full+8bit": dict(autocast=torch.float16, patch={"recompute": "full"},
                                optimizer="memkern-adamw-8bit"),
    "amp+ckpt+patch+8bit": dict(autocast=torch.float16, gradient_checkpointing=True, patch={},
                                optimizer="memkern-adamw-8bit"),
}
GIB = 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="base,large")
    ap.add_argument("--seqs", default="256,512")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--device", default="cuda", help="the planned device (default: cuda, Hopper)")
    ap.add_argument("--save", help="write the figures as JSON")
    args = ap.parse_args()
    results = []
    print(f"{'model':<12} {'seq':>4} {'row':<20} {'peak GiB':>9} {'reserved GiB':>13}")
    for size in args.sizes.split(","):
        cfg = hf_config("xlm-roberta", {**SIZES[size], "vocab_size": 250002,
                                        "max_position_embeddings": 514, "num_labels": 2})
        for seq in map(int, args.seqs.split(",")):
            for row in args.rows.split(","):
                options = {"optimizer": "adamw-fused", **ROWS[row]}
                plan = plan_training_step(hf_workload(
                    cfg, batch=args.batch, seq=seq, dtype=torch.float32,
                    task="sequence-classification", **options), device=args.device)
                results.append(dict(model=f"xlm-r-{size}", seq=seq, row=row,
                                    peak=plan.run_peak, reserved=plan.reserved,
                                    description=plan.description))
                print(f"{'xlm-r-' + size:<12} {seq:>4} {row:<20} {plan.run_peak / GIB:>9.2f} "
                      f"{plan.reserved / GIB:>13.2f}", flush=True)
    if args.save:
        with open(args.save, "w") as fh:
            json.dump({"device": args.device, "batch": args.batch, "torch": torch.__version__,
                       "results": results}, fh, indent=2)
            fh.write("\n")


if __name__ == "__main__":
    main()
