"""Memory and speed of the memkern.nn layers against torch.

Saved-for-backward bytes (memkern.profile.saved_bytes) of the MLP, a GPT-2 block and the
norms/dropout against their torch.nn counterparts; the linear cross-entropy's peak allocation
and time (``bench_lce.py``: against the unfused ``F.cross_entropy(x @ W.T, t)``, torch's own
``F.linear_cross_entropy`` and its chunked path where this torch has them, and Liger-Kernel on
a GPU when it imports; 4096 x 32000 x 512 float32 on the CPU, 16384 x 50304 x 768 and
4096 x 128256 x 4096 bfloat16 on a GPU), all measured in this process (times: median of
``--reps`` after one warm-up run, interleaved; on the CPU also process CPU time — on a shared
machine the stable measure of the work done).

    python benchmarks/bench_modules.py [--device cpu|cuda] [--reps 3] [--save PATH]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_lce  # noqa: E402
import common  # noqa: E402

import memkern as mk  # noqa: E402
from memkern.bench.block import GPT2Block  # noqa: E402
from memkern.profile import saved_bytes  # noqa: E402


def saved_ratios(device, dtype):
    out = {}
    x = torch.randn(4, 256, 512, device=device, dtype=dtype, requires_grad=True)
    base = saved_bytes(nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)).to(device, dtype), x)
    for rc in ("none", "activation", "full"):
        out[f"mlp_{rc}"] = saved_bytes(mk.nn.MLP(512, 2048, recompute=rc).to(device, dtype), x) / base
    base = saved_bytes(GPT2Block(512, 8, 0.1, False).to(device, dtype), x)
    for rc in ("activation", "full"):
        out[f"gpt2_block_{rc}"] = saved_bytes(GPT2Block(512, 8, 0.1, True, rc).to(device, dtype), x) / base
    out["layer_norm_bytes_per_input_byte"] = saved_bytes(mk.nn.LayerNorm(512).to(device, dtype), x) / (
        x.numel() * x.element_size())
    out["dropout_bytes"] = saved_bytes(mk.nn.Dropout(0.1), x)
    out["torch_dropout_bytes"] = saved_bytes(nn.Dropout(0.1), x)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--save", metavar="PATH", default=None, help="also write the results as JSON")
    args = ap.parse_args()
    device = torch.device(args.device)
    results = {"device": str(device),
               "saved_bytes_ratio_float32": saved_ratios(device, torch.float32),
               "saved_bytes_ratio_bfloat16": saved_ratios(device, torch.bfloat16),
               "linear_cross_entropy": bench_lce.run(device, args.reps)}
    for k, v in results.items():
        print(k, v)
    out = args.save or os.path.join(os.path.dirname(__file__), "results", f"{device.type}-modules.json")
    common.save(out, results)


if __name__ == "__main__":
    main()
