"""The rows of the XLM-R fine-tuning table (``plan_xlmr_table.py``), timed: each row's training
step time over AMP's, on the CPU at a small size.

Each row is built as the planner builds it (``hf_workload``: sequence classification, float32
parameters, the configs' dropout, XLM-R's 250,002-token vocabulary), its weights drawn from
N(0, 0.02), and trained on one fixed batch; AMP on the CPU is ``torch.autocast("cpu",
dtype=torch.bfloat16)`` (the GPU table's float16 has no fast CPU kernels). The rows take turns
step by step, in an order rotated every repetition (``common.interleaved_times``), and each
row's time is reported as the median of its per-repetition ratios to AMP's. On a shared CPU,
the process CPU time ratio (also printed) is the steadier measure of the work.

    python benchmarks/time_xlmr_table.py [--rows amp,amp+ckpt,...] [--reps 3] [--save PATH]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
from memkern.profile.workloads import hf_config, hf_workload  # noqa: E402
from plan_xlmr_table import ROWS  # noqa: E402

SMALL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
             vocab_size=250002, max_position_embeddings=514, num_labels=2)
BATCH, SEQ = 8, 128
BASELINE = "amp"


def build(row: str):
    options = {"optimizer": "adamw", **ROWS[row]}
    if options.get("autocast") is not None:
        options["autocast"] = torch.bfloat16
    if options["optimizer"] == "adamw-fused":
        options["optimizer"] = "adamw"
    setup = hf_workload(hf_config("xlm-roberta", SMALL), batch=BATCH, seq=SEQ,
                        dtype=torch.float32, task="sequence-classification", **options)()
    with torch.no_grad():
        for p in setup.model.parameters():
            p.normal_(0.0, 0.02)
    return setup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(r for r in ROWS if r != "fp32"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--save", help="write the figures as JSON")
    args = ap.parse_args()
    rows = args.rows.split(",")
    if BASELINE not in rows:
        rows.insert(0, BASELINE)
    torch.manual_seed(0)
    setups = {row: build(row) for row in rows}
    cpu: dict[str, list[float]] = {}
    times = common.interleaved_times({r: (common.nothing, s.step) for r, s in setups.items()},
                                     warmup=1, reps=args.reps, device=torch.device("cpu"),
                                     cpu_times=cpu)
    results = {}
    print(f"{'row':<20} {'step s':>7} {'vs AMP':>7} {'CPU time vs AMP':>16}")
    for row in rows:
        wall = common.ratio(times, row, BASELINE)
        work = common.ratio(cpu, row, BASELINE)
        results[row] = dict(step_seconds=times[row], cpu_seconds=cpu[row], vs_amp=wall,
                            cpu_time_vs_amp=work, description=setups[row].description)
        print(f"{row:<20} {sorted(times[row])[len(times[row]) // 2]:>7.2f} "
              f"{wall['median']:>6.2f}x {work['median']:>15.2f}x", flush=True)
    if args.save:
        common.save(args.save, {"batch": BATCH, "seq": SEQ,
                                "config": SMALL, "amp_dtype": "bfloat16", "rows": results})


if __name__ == "__main__":
    main()
