"""8-bit optimizer state (``state_precision="8bit"``) against the float32-state fused step.

1. Step time: ``adamw8bit_step_`` against ``adamw_step_`` on the same flat buffers (bf16
   grads and params, fp32 master), on the default backend of the device; the bytes each moves
   per element and the fraction of the measured copy bandwidth (target: 8-bit <= 1.1x the
   32-bit step).
2. Optimizer-side bytes per parameter (gradients + fp32 master + state), measured from the
   storages: ``memkern-full`` and ``memkern-full-8bit`` on the bench model, and a model of
   large layers only (target: <= 8.1 at W=1).
3. The quantization map and block size, on real Adam state (the moments after 100 steps of
   the bench model in float32): error of the update direction ``m / sqrt(v)`` read back from
   the codes, for a linear map and the power map, blocks of 64 to 2048.
4. Quality: the embedded ``memkern bench`` model trained 200 steps with 32-bit and 8-bit state
   (largest relative loss gap after 20 warm-up steps; target <= 1%), and a fine-tuning-shaped
   run: from the 32-bit run's weights, 100 more steps at lr 1e-4 both ways.
5. Peers, when importable: torchao's and bitsandbytes' AdamW8bit, state bytes and step time
   next to memkern's on one large parameter (skipped with a message otherwise).

Usage: python benchmarks/bench_8bit_state.py [--device cpu|cuda] [--params N] [--steps S]
       [--save PATH]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import memkern  # noqa: E402
from memkern.bench.configs import build  # noqa: E402
from memkern.bench.data import Batches, stdlib_corpus  # noqa: E402
from memkern.bench.model import SIZES, GPTConfig  # noqa: E402
from memkern.kernels.state8bit import num_blocks  # noqa: E402
from memkern.ops import adamw8bit  # noqa: E402
from memkern.profile import memory_breakdown  # noqa: E402

HYPER = (1e-4, 0.9, 0.999, 1e-8, 0.01)


def bench_step(n: int, device: torch.device) -> dict[str, float]:
    grads = torch.randn(n, device=device).to(torch.bfloat16)
    master = torch.randn(n, device=device)
    params = master.to(torch.bfloat16)
    m, v = torch.randn(n, device=device) * 1e-3, torch.rand(n, device=device) * 1e-6
    codes = [torch.empty(n, dtype=torch.int8, device=device), torch.empty(num_blocks(n), device=device),
             torch.empty(n, dtype=torch.uint8, device=device), torch.empty(num_blocks(n), device=device)]
    adamw8bit.quantize(m, codes[0], codes[1])
    adamw8bit.quantize(v, codes[2], codes[3])
    step32, step8 = torch.zeros(1, device=device), torch.zeros(1, device=device)
    master8 = master.clone()

    def fp32_state():
        memkern.ops.adamw_step_(master, m, v, grads, params, step32, None, None, *HYPER)

    def int8_state():
        memkern.ops.adamw8bit_step_(master8, *codes, grads, params, step8, None, None, *HYPER)

    t32 = common.median_seconds(fp32_state, device=device)
    t8 = common.median_seconds(int8_state, device=device)
    copy_bw = common.copy_bandwidth(device)
    # per element: grads 2 read, params 2 written, master 4 + 4, m and v 4 + 4 each (fp32) or
    # 1 + 1 each plus 2 x (4 + 4) / 64 of absmax (8-bit)
    bytes32, bytes8 = 2 + 2 + 8 + 16, 2 + 2 + 8 + 4 + 16 / 64
    return {"elements": n, "fp32_state_ms": t32 * 1e3, "int8_state_ms": t8 * 1e3,
            "ratio_8bit_to_32bit": t8 / t32, "target_ratio": 1.1,
            "copy_bandwidth_GBps": copy_bw / 1e9,
            "fp32_state_fraction_of_copy": bytes32 * n / t32 / copy_bw,
            "int8_state_fraction_of_copy": bytes8 * n / t8 / copy_bw}


def bytes_per_param(cfg: GPTConfig, device: torch.device) -> dict[str, float]:
    out = {}
    x, y = Batches(stdlib_corpus(), 2, cfg.seq, device=device).next()
    for name in ("memkern-full", "memkern-full-8bit"):
        setup = build(name, cfg, device)
        setup.train_step(x, y)
        out[f"{name} (bench model)"] = memory_breakdown(setup.model, setup.optimizer).optimizer_side_per_param
    for precision in ("32bit", "8bit"):
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(4)])
        model = model.to(device, torch.bfloat16)
        opt = memkern.optim.ShardedOptimizer(model.parameters(), lr=1e-3, state_precision=precision)
        opt.backward(model(torch.randn(4, 1024, device=device, dtype=torch.bfloat16)).float().sum())
        opt.step()
        out[f"{precision} state (4 x Linear(1024, 1024))"] = memory_breakdown(model, opt).optimizer_side_per_param
    return out


def _linear_map(x: torch.Tensor, signed: bool, block: int) -> torch.Tensor:
    rows = x.reshape(-1, block)
    scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
    levels = 127 if signed else 255
    return (torch.round(rows / scale * levels) / levels * scale).reshape(-1)


def _power_map(x: torch.Tensor, signed: bool, block: int) -> torch.Tensor:
    """memkern's map (square for m, 4th power for v) at another block size."""
    rows = x.reshape(-1, block)
    scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
    power, levels = (2, 127) if signed else (4, 255)
    c = torch.floor((rows.abs() / scale) ** (1 / power) * levels + 0.5)
    return ((c / levels) ** power * scale * rows.sign()).reshape(-1)


def map_ablation(cfg: GPTConfig, device: torch.device) -> dict[str, float]:
    """Median and 99th-percentile relative error of m / (sqrt(v) + eps) read back from the
    codes, over the large parameters' elements, on Adam state after 100 fp32 steps."""
    torch.manual_seed(0)
    setup = build("torch-fp32", cfg, device)
    batches = Batches(stdlib_corpus(), 4, cfg.seq, device=device, seed=0)
    for _ in range(100):
        setup.train_step(*batches.next())
    states = [s for p, s in setup.optimizer.state.items() if p.numel() >= 4096]
    m = torch.cat([s["exp_avg"].reshape(-1) for s in states])
    v = torch.cat([s["exp_avg_sq"].reshape(-1) for s in states])
    keep = m.numel() // 2048 * 2048
    m, v = m[:keep].double(), v[:keep].double()
    eps = 1e-8
    exact = m / (v.sqrt() + eps)
    out = {}
    for name, fn in (("linear", _linear_map), ("power", _power_map)):
        for block in (64, 128, 256, 2048):
            approx = fn(m, True, block) / (fn(v, False, block).sqrt() + eps)
            rel = ((approx - exact).abs() / exact.abs().clamp_min(1e-12))
            out[f"{name} map, block {block}: median"] = rel.median().item()
            out[f"{name} map, block {block}: p99"] = rel.quantile(0.99).item() if rel.numel() < 2**24 else float("nan")
    return out


def loss_curves(cfg: GPTConfig, device: torch.device, steps: int) -> dict[str, object]:
    curves, finetune = {}, {}
    start = None
    for name in ("memkern-full", "memkern-full-8bit"):
        setup = build(name, cfg, device, seed=0)
        batches = Batches(stdlib_corpus(), 4, cfg.seq, device=device, seed=0)
        curves[name] = [setup.train_step(*batches.next()).item() for _ in range(steps)]
        if name == "memkern-full":
            start = {k: t.detach().clone() for k, t in setup.model.state_dict().items()}
    a, b = (torch.tensor(curves[n]) for n in curves)
    gap = ((b - a).abs() / a)[20:]
    # Fine-tuning: pretrained-like weights (the 32-bit run's), a small learning rate.
    for name in ("memkern-full", "memkern-full-8bit"):
        setup = build(name, cfg, device, seed=0)
        setup.model.load_state_dict(start)
        for group in setup.optimizer.param_groups:
            group["lr"] = 1e-4
        batches = Batches(stdlib_corpus(), 4, cfg.seq, device=device, seed=1)
        finetune[name] = [setup.train_step(*batches.next()).item() for _ in range(steps // 2)]
    fa, fb = (torch.tensor(finetune[n]) for n in finetune)
    fgap = ((fb - fa).abs() / fa)
    return {"steps": steps, "max_rel_gap_after_warmup": gap.max().item(),
            "mean_rel_gap_after_warmup": gap.mean().item(), "target": 0.01,
            "final_loss_32bit": curves["memkern-full"][-1],
            "final_loss_8bit": curves["memkern-full-8bit"][-1],
            "finetune_max_rel_gap": fgap.max().item(),
            "finetune_final_loss_32bit": finetune["memkern-full"][-1],
            "finetune_final_loss_8bit": finetune["memkern-full-8bit"][-1]}


def peers(device: torch.device, n: int) -> dict[str, object]:
    shape = (n // 1024, 1024)
    out = {}

    def run(name, make):
        p = torch.nn.Parameter(torch.randn(shape, device=device))
        opt = make([p])
        p.grad = torch.randn_like(p)
        opt.step()  # the first step creates the state (and compiles torchao's)
        t = common.median_seconds(opt.step, warmup=1, reps=3, device=device)
        state_bytes = sum(_nbytes(t) for t in _state_tensors(opt))
        out[name] = {"step_ms": t * 1e3, "state_bytes_per_param": state_bytes / p.numel()}

    run("memkern FusedAdamW 8bit", lambda ps: memkern.optim.FusedAdamW(ps, lr=1e-3, state_precision="8bit"))
    run("memkern FusedAdamW 32bit", lambda ps: memkern.optim.FusedAdamW(ps, lr=1e-3))
    try:
        from torchao.optim import AdamW8bit as TorchaoAdamW8bit
    except ImportError as e:
        print(f"skipping torchao's AdamW8bit: {e} (pip install torchao)")
    else:
        run("torchao AdamW8bit", lambda ps: TorchaoAdamW8bit(ps, lr=1e-3))
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        print(f"skipping bitsandbytes' AdamW8bit: {e} (pip install bitsandbytes, on a GPU)")
    else:
        if device.type == "cuda":
            run("bitsandbytes AdamW8bit", lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3))
        else:
            print("skipping bitsandbytes' AdamW8bit: needs a CUDA device")
    return out


def _state_tensors(opt) -> list[torch.Tensor]:
    segments = getattr(opt, "segments", None)
    if segments is not None:  # memkern: flat state, 8-bit codes and absmax included
        return [t for seg in segments for t in seg.stored_tensors().values()]
    return [v for state in opt.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    """Bytes of a state tensor, including the codes and scales of a tensor subclass."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_nbytes(getattr(t, k)) for k in names)
    return t.untyped_storage().nbytes()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--params", type=int, default=None,
                        help="elements of the step benchmark (default: 8M on CPU, 100M on GPU)")
    parser.add_argument("--steps", type=int, default=200, help="steps of the loss curves")
    parser.add_argument("--save", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    n = args.params or (8_000_011 if device.type == "cpu" else 100_000_007)
    small = SIZES["small"]
    cfg = GPTConfig(small.layers, small.width, small.heads,
                    seq=min(small.seq, 128) if device.type == "cpu" else small.seq,
                    vocab=small.vocab)
    results = {}

    results["step"] = step = bench_step(n, device)
    print(f"step over {n} elements: 32-bit state {step['fp32_state_ms']:.2f} ms, 8-bit "
          f"{step['int8_state_ms']:.2f} ms = {step['ratio_8bit_to_32bit']:.2f}x (target <= 1.1x); "
          f"{step['int8_state_fraction_of_copy']:.0%} of copy bandwidth "
          f"({step['copy_bandwidth_GBps']:.1f} GB/s) counting the bytes it moves")

    results["bytes_per_param"] = bpp = bytes_per_param(cfg, device)
    for name, value in bpp.items():
        print(f"optimizer-side bytes/param, {name}: {value:.3f}")

    results["map_ablation"] = ablation = map_ablation(cfg, device)
    for name, value in ablation.items():
        print(f"update-direction error, {name}: {value:.3e}")

    results["quality"] = quality = loss_curves(cfg, device, args.steps)
    print(f"{args.steps} steps of the bench model: 8-bit loss within "
          f"{quality['max_rel_gap_after_warmup']:.2%} of 32-bit after 20 warm-up steps (target "
          f"<= 1%); final {quality['final_loss_8bit']:.4f} vs {quality['final_loss_32bit']:.4f}; "
          f"fine-tuning run: within {quality['finetune_max_rel_gap']:.2%}")

    results["peers"] = peer = peers(device, min(n, 4_194_304))
    for name, r in peer.items():
        print(f"{name}: {r['step_ms']:.1f} ms per step, {r['state_bytes_per_param']:.3f} "
              "state bytes/param")
    if args.save:
        common.save(args.save, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
