"""What recomputing attention probabilities costs (``memkern.nn.hf_attention``): one BERT
self-attention call's forward + backward on the CPU with attention dropout, transformers' SDPA
attention against memkern's, which runs it again in backward.

Both take turns call by call, in an order rotated every repetition (``common.
interleaved_times``); the ratio is the median of the per-repetition ratios, wall and process
CPU time. The shape is ``bench_hf.py --size small``'s (batch 4 x 128 tokens, width 256, 4
heads), and a longer sequence (512) where the ``[t, t]`` work weighs more.

    python benchmarks/bench_attention_recompute.py [--reps 31] [--save PATH]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import memkern as mk  # noqa: E402

SHAPES = ((4, 128), (4, 512))
WIDTH, HEADS, DROPOUT = 256, 4, 0.1


def cases(batch: int, seq: int) -> dict:
    import transformers

    cfg = transformers.BertConfig(hidden_size=WIDTH, num_attention_heads=HEADS,
                                  attention_probs_dropout_prob=DROPOUT, num_hidden_layers=1)
    plain = transformers.BertModel(cfg).train()
    patched = mk.patch(copy.deepcopy(plain), linear=False, norm=False, mlp=False, dropout=False)
    x = torch.randn(batch, seq, WIDTH, requires_grad=True)
    out = {}
    for name, model in (("sdpa", plain), ("memkern_sdpa", patched)):
        attention = model.encoder.layer[0].attention.self

        def step(attention=attention):
            attention(x)[0].sum().backward()
        out[name] = (common.nothing, step)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=31)
    ap.add_argument("--save", help="write the figures as JSON")
    args = ap.parse_args()
    torch.manual_seed(0)
    results = {}
    for batch, seq in SHAPES:
        cpu: dict[str, list[float]] = {}
        times = common.interleaved_times(cases(batch, seq), warmup=3, reps=args.reps,
                                         device=torch.device("cpu"), cpu_times=cpu)
        wall = common.ratio(times, "memkern_sdpa", "sdpa")
        work = common.ratio(cpu, "memkern_sdpa", "sdpa")
        results[f"{batch}x{seq}"] = dict(times=times, cpu_times=cpu, wall_ratio=wall,
                                         cpu_time_ratio=work)
        print(f"batch {batch} x {seq}: memkern_sdpa / sdpa, forward + backward: wall "
              f"{wall['median']:.2f}x (quartiles {wall['first_quartile']:.2f}-"
              f"{wall['third_quartile']:.2f}), process CPU time {work['median']:.2f}x", flush=True)
    if args.save:
        common.save(args.save, {"width": WIDTH, "heads": HEADS, "dropout": DROPOUT,
                                "shapes": results})


if __name__ == "__main__":
    main()
