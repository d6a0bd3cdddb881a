"""Memory and speed of the memkern.nn layers against torch.

Saved-for-backward bytes (memkern.profile.saved_bytes) of the MLP, a GPT-2 block and the
norms/dropout against their torch.nn counterparts; the time of the norms and MLPs at real
shapes (bf16 on CUDA, forward + backward, against the torch module; on CUDA also the host/GPU
split of memkern.bench.host_device; issue 23's targets: RMSNorm 768 and the GELU MLP
768→3072 ≤ 1.0× torch); the linear cross-entropy's peak allocation and time (``bench_lce.py``:
against the unfused ``F.cross_entropy(x @ W.T, t)``, torch's own ``F.linear_cross_entropy``
and its chunked path where this torch has them, and Liger-Kernel on a GPU when it imports;
4096 x 32000 x 512 float32 on the CPU, 16384 x 50304 x 768 and 4096 x 128256 x 4096 bfloat16
on a GPU), all measured in this process (times: median of ``--reps`` after one warm-up run,
interleaved; on the CPU also process CPU time — on a shared machine the stable measure of the
work done).

    python benchmarks/bench_modules.py [--device cpu|cuda] [--reps 3] [--save PATH]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_lce  # noqa: E402
import common  # noqa: E402
import memkern as mk  # noqa: E402
from memkern.bench import host_device  # noqa: E402
from memkern.bench.block import GPT2Block  # noqa: E402
from memkern.profile import saved_bytes  # noqa: E402


def saved_ratios(device, dtype):
    out = {}
    x = torch.randn(4, 256, 512, device=device, dtype=dtype, requires_grad=True)
    plain_mlp = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))
    base = saved_bytes(plain_mlp.to(device, dtype), x)
    for rc in ("none", "activation", "full"):
        mlp = mk.nn.MLP(512, 2048, recompute=rc).to(device, dtype)
        out[f"mlp_{rc}"] = saved_bytes(mlp, x) / base
    base = saved_bytes(GPT2Block(512, 8, 0.1, False).to(device, dtype), x)
    for rc in ("activation", "full"):
        block = GPT2Block(512, 8, 0.1, True, rc).to(device, dtype)
        out[f"gpt2_block_{rc}"] = saved_bytes(block, x) / base
    out["layer_norm_bytes_per_input_byte"] = (
        saved_bytes(mk.nn.LayerNorm(512).to(device, dtype), x) / (x.numel() * x.element_size()))
    out["dropout_bytes"] = saved_bytes(mk.nn.Dropout(0.1), x)
    out["torch_dropout_bytes"] = saved_bytes(nn.Dropout(0.1), x)
    return out


# Layers at real shapes: name -> (tokens, torch module, memkern module, target ratio or None).
LAYER_TARGET = 1.0  # issue 23: memkern's time / torch's, forward + backward, bf16 on CUDA


def real_shape_layers() -> dict[str, tuple[int, nn.Module, nn.Module, float | None]]:
    gelu_mlp = nn.Sequential(nn.Linear(768, 3072), nn.GELU(approximate="tanh"),
                             nn.Linear(3072, 768))
    layers = {
        "LayerNorm 768": (16384, nn.LayerNorm(768), mk.nn.LayerNorm(768), None),
        "RMSNorm 768": (16384, nn.RMSNorm(768), mk.nn.RMSNorm(768), LAYER_TARGET),
        "LayerNorm 4096": (16384, nn.LayerNorm(4096), mk.nn.LayerNorm(4096), None),
        "RMSNorm 4096": (16384, nn.RMSNorm(4096), mk.nn.RMSNorm(4096), None),
    }
    recomputes = ("none", "activation", "full")
    for rc in recomputes:
        layers[f"GELU MLP 768→3072 ({rc})"] = (
            8192, gelu_mlp, mk.nn.MLP(768, 3072, activation="gelu_tanh", recompute=rc),
            LAYER_TARGET)
    for rc in recomputes:
        layers[f"SwiGLU MLP 2048→5632 ({rc})"] = (
            8192, common.TorchSwiGLU(2048, 5632), mk.nn.SwiGLU(2048, 5632, recompute=rc), None)
    return layers


def layer_times(device: torch.device, reps: int) -> dict[str, dict]:
    """Forward + backward of each layer at real shapes against its torch module: median wall
    time of ``reps`` interleaved repetitions (bf16 on CUDA; float32 and 1/32 of the tokens on
    the CPU), and on CUDA the host/GPU split of each."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = {}
    print(f"\nlayers at real shapes, forward + backward, {str(dtype).removeprefix('torch.')} on "
          f"{device.type} (target: memkern ≤ {LAYER_TARGET:.1f}× torch where given)")
    for name, (tokens, theirs, ours, target) in real_shape_layers().items():
        tokens = tokens if device.type == "cuda" else tokens // 32
        theirs, ours = theirs.to(device, dtype), ours.to(device, dtype)
        width = next(m for m in theirs.modules() if hasattr(m, "weight")).weight.shape[-1]
        x = torch.randn(tokens, width, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn_like(x)
        calls = {"torch": lambda m=theirs, x=x, grad=grad: m(x).backward(grad),
                 "memkern": lambda m=ours, x=x, grad=grad: m(x).backward(grad)}
        times = common.interleaved_times({k: (common.nothing, f) for k, f in calls.items()},
                                         warmup=3, reps=reps, device=device)
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"tokens": tokens, "torch_ms": med["torch"] * 1e3, "memkern_ms": med["memkern"] * 1e3,
               "ratio": med["memkern"] / med["torch"], "target": target}
        line = (f"  {name:<30} torch {row['torch_ms']:8.3f} ms  memkern {row['memkern_ms']:8.3f} ms"
                f"  {row['ratio']:5.2f}×" + (f" (target ≤ {target:.1f}×)" if target else ""))
        if device.type == "cuda":
            for who, fn in calls.items():
                split = host_device.measure(fn, reps=3)
                row[f"{who}_host_ms"] = split.host_seconds * 1e3
                row[f"{who}_gpu_ms"] = split.gpu_seconds * 1e3
                line += f"  {who}: {host_device.describe(split)}"
        print(line)
        out[name] = row
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
               "layers_at_real_shapes": layer_times(device, args.reps),
               "linear_cross_entropy": bench_lce.run(device, args.reps)}
    for k, v in results.items():
        print(k, v)
    out = args.save or os.path.join(os.path.dirname(__file__), "results",
                                    f"{device.type}-modules.json")
    common.save(out, results)


if __name__ == "__main__":
    main()
