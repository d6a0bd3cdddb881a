"""The block size of the 8-bit optimizer state (``QBLOCK``, memkern/kernels/state8bit.py), from
measurement: what blocks of 64, 128 and 256 elements cost in accuracy, next to what their
float32 absmax costs in bytes (2 moments x 4 bytes / block per parameter).

1. Quantization error on real Adam state: the bench model (``torch-fp32``: float32 weights,
   torch's AdamW) trained ``--state-steps`` steps; its moments of the parameters the 8-bit
   optimizer quantizes (>= MIN_8BIT_NUMEL elements, each padded to whole blocks as the flat
   layout pads it) read back through memkern's map (the reference
   ``memkern.ops.adamw8bit.quantize``/``dequantize``, in float64) at each block size: relative
   error of ``m``, ``v`` and the update direction ``m / (sqrt(v) + eps)`` per element (median,
   99th percentile) and over the whole update (``|du| / |u|``).
2. Effect on training: the same model and data, ``--steps`` steps, with torch's AdamW whose
   moments are replaced after every step by their read-back through the map (in float32) at
   each block size (the quantized algorithm: the step uses the exact new moments, the stored state
   is quantized), against the float32-state run: largest and mean relative loss gap after 20
   warm-up steps.

Usage: python benchmarks/bench_8bit_block.py [--steps 200] [--state-steps 100] [--save PATH]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from memkern.bench.configs import build  # noqa: E402
from memkern.bench.data import Batches, stdlib_corpus  # noqa: E402
from memkern.bench.model import SIZES, GPTConfig  # noqa: E402
from memkern.ops import adamw8bit  # noqa: E402
from memkern.optim.fused_adamw import MIN_8BIT_NUMEL  # noqa: E402

BLOCKS = (64, 128, 256)
WARMUP = 20
EPS = 1e-8  # torch's and memkern's AdamW default, the bench's


def read_back(x: torch.Tensor, key: str, block: int, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (one parameter's moment ``key``) quantized and dequantized by memkern's map,
    computed in ``dtype``, padded to whole blocks as the flat layout pads a parameter."""
    flat = x.detach().reshape(-1).to(dtype)
    codes = torch.empty(flat.numel(), dtype=torch.int8 if key == "exp_avg" else torch.uint8)
    absmax = torch.empty(-(-flat.numel() // block), dtype=dtype)
    adamw8bit.quantize(flat, codes, absmax, block=block)
    return adamw8bit.dequantize(codes, absmax, dtype, block=block).view_as(x)


def _quantized_states(optimizer: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    return [s for p, s in optimizer.state.items() if p.numel() >= MIN_8BIT_NUMEL]


def _cfg(device: torch.device) -> GPTConfig:
    small = SIZES["small"]
    return GPTConfig(small.layers, small.width, small.heads,
                     seq=min(small.seq, 128) if device.type == "cpu" else small.seq,
                     vocab=small.vocab)


def train(device: torch.device, steps: int, block: int | None,
          keep_state_at: int | None = None) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Loss curve of ``steps`` steps of the bench model (float32 state when ``block`` is None,
    else the moments read back at ``block`` after every step), and a copy of the quantized
    parameters' moments after ``keep_state_at`` steps."""
    cfg = _cfg(device)
    setup = build("torch-fp32", cfg, device, seed=0)
    if block is not None:
        def requantize(opt, args, kwargs):
            with torch.no_grad():
                for state in _quantized_states(opt):
                    for key in ("exp_avg", "exp_avg_sq"):
                        state[key].copy_(read_back(state[key], key, block, torch.float32))
        setup.optimizer.register_step_post_hook(requantize)
    batches = Batches(stdlib_corpus(), 4, cfg.seq, device=device, seed=0)
    losses, kept = [], []
    for i in range(steps):
        losses.append(setup.train_step(*batches.next()).item())
        if keep_state_at is not None and i + 1 == keep_state_at:
            kept = [{k: s[k].detach().clone() for k in ("exp_avg", "exp_avg_sq")}
                    for s in _quantized_states(setup.optimizer)]
    return losses, kept


def state_errors(states: list[dict[str, torch.Tensor]], block: int) -> dict[str, float]:
    m = torch.cat([s["exp_avg"].reshape(-1) for s in states]).double()
    v = torch.cat([s["exp_avg_sq"].reshape(-1) for s in states]).double()
    m_q = torch.cat([read_back(s["exp_avg"], "exp_avg", block, torch.float64).reshape(-1)
                     for s in states])
    v_q = torch.cat([read_back(s["exp_avg_sq"], "exp_avg_sq", block, torch.float64).reshape(-1)
                     for s in states])
    u, u_q = m / (v.sqrt() + EPS), m_q / (v_q.sqrt() + EPS)
    out = {}
    for name, exact, approx in (("m", m, m_q), ("v", v, v_q), ("update", u, u_q)):
        nonzero = exact != 0
        rel = ((approx - exact).abs() / exact.abs())[nonzero]
        out[f"{name} rel. error median"] = rel.median().item()
        out[f"{name} rel. error p99"] = rel.kthvalue(max(1, int(0.99 * rel.numel()))).values.item()
        out[f"{name} |error| / |exact|"] = ((approx - exact).norm() / exact.norm()).item()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=200, help="steps of the loss curves")
    parser.add_argument("--state-steps", type=int, default=100,
                        help="steps before the moments of part 1 are taken")
    parser.add_argument("--save", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    results: dict[str, object] = {"blocks": BLOCKS, "steps": args.steps,
                                  "state_steps": args.state_steps}

    base, states = train(device, args.steps, None, keep_state_at=args.state_steps)
    n = sum(s["exp_avg"].numel() for s in states)
    print(f"part 1: moments of {len(states)} parameters ({n} elements) after "
          f"{args.state_steps} float32 steps")
    errors = results["state_errors"] = {}
    for block in BLOCKS:
        errors[block] = e = state_errors(states, block)
        print(f"block {block:4d} ({8 / block:.4f} B/param of scales): " + ", ".join(
            f"{k} {v:.2e}" for k, v in e.items()))

    curves = results["loss_curves"] = {"32bit": base}
    gaps = results["loss_gaps"] = {}
    a = torch.tensor(base)
    for block in BLOCKS:
        curves[block], _ = train(device, args.steps, block)
        gap = ((torch.tensor(curves[block]) - a).abs() / a)[WARMUP:]
        gaps[block] = {"max": gap.max().item(), "mean": gap.mean().item(),
                       "final_loss": curves[block][-1]}
        print(f"block {block:4d}: loss within {gap.max().item():.3%} of float32 state after "
              f"{WARMUP} steps (mean {gap.mean().item():.3%}); final {curves[block][-1]:.4f} "
              f"vs {base[-1]:.4f}")
    if args.save:
        common.save(args.save, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
