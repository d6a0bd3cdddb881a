"""8-bit optimizer state (``state_precision="8bit"``) against the float32-state fused step.

1. Step time: ``adamw8bit_step_`` against ``adamw_step_``, and ``sgd8bit_step_`` against
   ``sgd_step_`` (momentum 0.9), interleaved, wall and CPU time, on the same flat buffers
   (fp32 params; bf16 grads and params with an fp32 master), on the default backend of the
   device and, on a GPU where the CUDA kernels are built, on the Triton fallback too; the
   bytes each moves per element and the fraction of the measured copy bandwidth (targets:
   8-bit <= 1.1x the 32-bit step on the CPU; >= 80% of copy on a GPU).
2. Optimizer-side bytes per parameter (gradients + fp32 master + state), measured from the
   storages: ``memkern-full`` and ``memkern-full-8bit`` on the bench model, and a model of
   large layers only (target: <= 8.1 at W=1).
3. The quantization map and block size, on real Adam state (the moments after 100 steps of
   the bench model in float32): error of the update direction ``m / sqrt(v)`` read back from
   the codes, for a linear map and the power map, blocks of 64 to 2048.
4. Quality (``quality``): the embedded ``memkern bench`` model trained 200 steps with 32-bit
   state, 8-bit state and the 32-bit step in another rounding order (the noise floor), in
   bfloat16 and float32 parameters; per-step and 10-step-window loss gaps after 20 warm-up
   steps (target: every step within 1%); then fine-tuning from the 32-bit weights at lr 1e-4
   on text the model has not seen. ``ci``: the CI test's statistics over several seeds.
5. Peers, when importable: torchao's and bitsandbytes' AdamW8bit and torch's fused AdamW,
   state bytes from the storages and step times in interleaved rounds, next to memkern's
   8-bit and 32-bit steps (skipped with a message otherwise).

Usage: python benchmarks/bench_8bit_state.py [--device cpu|cuda] [--sections LIST]
       [--params N] [--steps S] [--seq L] [--dtypes LIST] [--save PATH] (see --help;
       benchmarks/NOTES.md has the commands behind the saved results)
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import memkern  # noqa: E402
from memkern import backend  # noqa: E402
from memkern.bench.configs import LR, build  # noqa: E402
from memkern.bench.data import Batches, stdlib_corpus  # noqa: E402
from memkern.bench.model import SIZES, GPTConfig  # noqa: E402
from memkern.kernels.state8bit import QBLOCK, num_blocks  # noqa: E402
from memkern.ops import adamw8bit  # noqa: E402
from memkern.profile import memory_breakdown  # noqa: E402

HYPER = (1e-4, 0.9, 0.999, 1e-8, 0.01)
SGD_HYPER = (1e-3, 0.9, 0.0, 0.01, False)


PARAM_DTYPES = (("fp32 params", torch.float32), ("bf16 params, fp32 master", torch.bfloat16))
"""The step benchmarks' cases: float32 parameters (the master is the parameter), and bfloat16
grads and parameters with a float32 master."""


def adamw_steps(n: int, device: torch.device, dtype: torch.dtype):
    """``adamw_step_`` and ``adamw8bit_step_`` over ``n`` elements of their own state, as two
    callables: ``dtype`` grads (and params, unless float32: then the master is the param)."""
    grads, master, params = _step_buffers(n, device, dtype)
    m, v = torch.randn(n, device=device) * 1e-3, torch.rand(n, device=device) * 1e-6
    codes = [torch.empty(n, dtype=torch.int8, device=device),
             torch.empty(num_blocks(n), device=device),
             torch.empty(n, dtype=torch.uint8, device=device),
             torch.empty(num_blocks(n), device=device)]
    adamw8bit.quantize(m, codes[0], codes[1])
    adamw8bit.quantize(v, codes[2], codes[3])
    step32, step8 = torch.zeros(1, device=device), torch.zeros(1, device=device)
    master8 = master.clone()
    return (lambda: memkern.ops.adamw_step_(master, m, v, grads, params, step32, None, None,
                                            *HYPER),
            lambda: memkern.ops.adamw8bit_step_(master8, *codes, grads, params, step8, None,
                                                None, *HYPER))


def sgd_steps(n: int, device: torch.device, dtype: torch.dtype):
    """``sgd_step_`` and ``sgd8bit_step_`` (momentum 0.9) as ``adamw_steps``."""
    grads, master, params = _step_buffers(n, device, dtype)
    buf = torch.randn(n, device=device) * 1e-3
    codes = [torch.empty(n, dtype=torch.int8, device=device),
             torch.empty(num_blocks(n), device=device)]
    adamw8bit.quantize(buf, *codes)
    step32, step8 = torch.ones(1, device=device), torch.ones(1, device=device)
    master8 = master.clone()
    return (lambda: memkern.ops.sgd_step_(master, buf, grads, params, step32, None, None,
                                          *SGD_HYPER),
            lambda: memkern.ops.sgd8bit_step_(master8, *codes, grads, params, step8, None,
                                              None, *SGD_HYPER))


ADAMW_STATE_BYTES = (16, 4 + 16 / QBLOCK)
"""State bytes per element read and written by a step: m and v 4 + 4 each (32-bit), or 1 + 1
each plus 2 x (4 + 4) / QBLOCK of absmax (8-bit)."""
SGD_STATE_BYTES = (8, 2 + 8 / QBLOCK)
"""The momentum buffer 4 + 4 (32-bit), or 1 + 1 plus (4 + 4) / QBLOCK of absmax (8-bit)."""


def step_bytes(dtype: torch.dtype) -> int:
    """Bytes per element a step moves besides its state: grads, the master 4 + 4, params."""
    return dtype.itemsize * (2 if dtype != torch.float32 else 1) + 8


def bench_step(n: int, device: torch.device) -> dict[str, object]:
    """``adamw8bit_step_`` against ``adamw_step_`` over the same ``n`` elements."""
    return _compare_steps(n, device, lambda dtype: adamw_steps(n, device, dtype),
                          *ADAMW_STATE_BYTES)


def bench_sgd_step(n: int, device: torch.device) -> dict[str, object]:
    """``sgd8bit_step_`` against ``sgd_step_`` (momentum 0.9) over the same ``n`` elements."""
    return _compare_steps(n, device, lambda dtype: sgd_steps(n, device, dtype),
                          *SGD_STATE_BYTES)


def _step_buffers(n: int, device: torch.device, dtype: torch.dtype):
    """grads of ``dtype``, a float32 master, and a ``dtype`` parameter copy (None for
    float32: the master is the parameter)."""
    master = torch.randn(n, device=device)
    return (torch.randn(n, device=device).to(dtype), master,
            master.to(dtype) if dtype != torch.float32 else None)


def _compare_steps(n, device, steps, state32: float, state8: float,
                   reps: int = 41) -> dict[str, object]:
    """Per case of PARAM_DTYPES, ``steps(dtype)``'s 32-bit and 8-bit step alternating within
    every repetition (after 3 warm-up ones, so that load from other processes on a shared
    machine falls on both alike): medians of the wall time and of the process's CPU time,
    the median of the per-repetition wall-time ratios (``common.ratio``), the CPU times' ratio, the
    ratio of each step's fastest repetition (what the work itself costs: load from other processes
    only ever adds time), and each step's fraction of the copy bandwidth counting the bytes it moves
    per element (grads and params, master 4 + 4, and ``state32``/``state8`` of state)."""
    copy_bw = common.copy_bandwidth(device)
    out: dict[str, object] = {"elements": n, "target_ratio": 1.1, "repetitions": reps,
                              "copy_bandwidth_GBps": copy_bw / 1e9}
    for name, dtype in PARAM_DTYPES:
        fp32_state, int8_state = steps(dtype)
        cpu: dict[str, list[float]] = {}
        wall = common.interleaved_times(
            {"32bit": (common.nothing, fp32_state), "8bit": (common.nothing, int8_state)},
            warmup=3, reps=reps, device=device, cpu_times=cpu)
        t32, t8 = statistics.median(wall["32bit"]), statistics.median(wall["8bit"])
        cpu32, cpu8 = statistics.median(cpu["32bit"]), statistics.median(cpu["8bit"])
        moved = step_bytes(dtype)
        ratio = common.ratio(wall, "8bit", "32bit")
        out[name] = {"fp32_state_ms": t32 * 1e3, "int8_state_ms": t8 * 1e3,
                     "ratio_8bit_to_32bit": ratio["median"],
                     "ratio_fastest_8bit_to_32bit": min(wall["8bit"]) / min(wall["32bit"]),
                     # CPU seconds of all threads: the work itself, less the waiting for a
                     # core that a machine shared with other processes adds to wall time
                     "cpu_time_fp32_state_ms": cpu32 * 1e3, "cpu_time_int8_state_ms": cpu8 * 1e3,
                     "cpu_time_ratio_8bit_to_32bit": cpu8 / cpu32,
                     "ratio_per_repetition_min_median_max":
                         [ratio["min"], ratio["median"], ratio["max"]],
                     "fp32_state_fraction_of_copy": (moved + state32) * n / t32 / copy_bw,
                     "int8_state_fraction_of_copy": (moved + state8) * n / t8 / copy_bw}
    return out


def step_backends(device: torch.device) -> list[str]:
    """The backends whose steps are timed: the device's default one first; on a GPU with the
    CUDA kernels built also Triton, the fallback that runs where they are not."""
    default = backend.select(device)
    others = ["triton"] if device.type == "cuda" and default != "triton" else []
    return [default] + [b for b in others if backend.runs_on(b, device)]


def _print_step(what: str, n: int, results: dict[str, object]) -> None:
    for name, _ in PARAM_DTYPES:
        r = results[name]
        low, _, high = r["ratio_per_repetition_min_median_max"]
        print(f"{what} over {n} elements, {name}: 32-bit state {r['fp32_state_ms']:.2f} "
              f"ms, 8-bit {r['int8_state_ms']:.2f} ms = {r['ratio_8bit_to_32bit']:.2f}x "
              f"(target <= 1.1x; per repetition {low:.2f} to {high:.2f}; fastest "
              f"{r['ratio_fastest_8bit_to_32bit']:.2f}x); CPU time "
              f"{r['cpu_time_ratio_8bit_to_32bit']:.2f}x; "
              f"{r['int8_state_fraction_of_copy']:.0%} of copy bandwidth "
              f"({results['copy_bandwidth_GBps']:.1f} GB/s) counting the bytes it moves")


def bytes_per_param(cfg: GPTConfig, device: torch.device) -> dict[str, float]:
    out = {}
    x, y = Batches(stdlib_corpus(), 2, cfg.seq, device=device).next()
    for name in ("memkern-full", "memkern-full-8bit"):
        setup = build(name, cfg, device)
        setup.train_step(x, y)
        breakdown = memory_breakdown(setup.model, setup.optimizer)
        out[f"{name} (bench model)"] = breakdown.optimizer_side_per_param
    for precision in ("32bit", "8bit"):
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(4)])
        model = model.to(device, torch.bfloat16)
        opt = memkern.optim.ShardedOptimizer(model.parameters(), lr=1e-3, state_precision=precision)
        opt.backward(model(torch.randn(4, 1024, device=device, dtype=torch.bfloat16)).float().sum())
        opt.step()
        out[f"{precision} state (4 x Linear(1024, 1024))"] = (
            memory_breakdown(model, opt).optimizer_side_per_param)
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
            out[f"{name} map, block {block}: p99"] = (
                rel.quantile(0.99).item() if rel.numel() < 2**24 else float("nan"))
    return out


QUALITY_VARIANTS = {"32bit": ("32bit", False), "32bit rounding twin": ("32bit", True),
                    "8bit": ("8bit", False)}
"""name: (state_precision, optimizer step on the reference backend). The rounding twin is the
32-bit algorithm in plain torch ops instead of the C++ kernel: the same float32 arithmetic
rounded in another order (a quarter of the master weights differ by an ulp after one step), so
its gap to "32bit" is the noise floor that any change of rounding meets."""
WARMUP, WINDOW = 20, 10
FINETUNE_LR = 1e-4


def _memkern_run(cfg: GPTConfig, device: torch.device, seed: int, dtype: torch.dtype,
                 precision: str, weights: dict[str, torch.Tensor] | None = None):
    """memkern-full's model and optimizer (memkern layers, ShardedOptimizer with dynamic loss
    scale and clipping) with ``dtype`` parameters (memkern-full: bfloat16) and
    ``precision`` state; ``weights``: a state_dict loaded before the first step (which makes
    the float32 masters from the weights)."""
    setup = build("memkern-full-8bit" if precision == "8bit" else "memkern-full", cfg, device,
                  seed, param_dtype=dtype)
    if weights is not None:
        setup.model.load_state_dict(weights)
    return setup.model, setup.optimizer


def _train(model, opt, batches: Batches, steps: int, reference_step: bool) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = model(*batches.next())
        opt.backward(loss)
        with backend.force("reference") if reference_step else contextlib.nullcontext():
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _gap(curve: list[float], reference: list[float], warmup: int) -> dict[str, float]:
    """Relative loss gaps ``|curve - reference| / reference`` after ``warmup`` steps: per step
    and of the means of 10-step windows."""
    a, b = torch.tensor(curve, dtype=torch.float64), torch.tensor(reference, dtype=torch.float64)
    rel = ((a - b).abs() / b)[warmup:]
    n = (a.numel() - warmup) // WINDOW * WINDOW
    wa, wb = (t[warmup:warmup + n].view(-1, WINDOW).mean(1) for t in (a, b))
    return {"max_step": rel.max().item(), "median_step": rel.median().item(),
            "steps_over_1pct": int((rel > 0.01).sum()), "steps_compared": rel.numel(),
            "max_window": ((wa - wb).abs() / wb).max().item()}


def _variant(cfg: GPTConfig, device: torch.device, seed: int, dtype: torch.dtype, name: str,
             batch: int, steps: int, lr: float, shifted: bool,
             weights: dict[str, torch.Tensor] | None = None):
    """One variant's loss curve over ``steps`` steps at ``lr`` and its final weights. Data:
    windows of the corpus' first 4 MiB (the ``memkern bench`` corpus), or with ``shifted``
    of its next 4 MiB (other modules of the standard library: text the model has not seen)."""
    precision, reference_step = QUALITY_VARIANTS[name]
    model, opt = _memkern_run(cfg, device, seed, dtype, precision, weights)
    for group in opt.param_groups:
        group["lr"] = lr
    corpus = stdlib_corpus(8 << 20)
    corpus = corpus[4 << 20:] if shifted else corpus[:4 << 20]
    losses = _train(model, opt, Batches(corpus, batch, cfg.seq, seed=seed, device=device), steps,
                    reference_step)
    return losses, {k: t.detach().cpu() for k, t in model.state_dict().items()}


def quality(cfg: GPTConfig, device: torch.device, dtype: torch.dtype, steps: int,
            finetune_steps: int, seed: int, batch: int) -> dict[str, object]:
    """The three variants trained ``steps`` steps from the seeded model; then fine-tuning:
    from the 32-bit run's final weights, ``finetune_steps`` steps at lr 1e-4 on shifted text,
    fresh optimizer state, the three variants again (none when ``finetune_steps`` is 0). The
    variants of each phase run side by side in processes of their own (start with
    OMP_NUM_THREADS=1 on a small CPU)."""
    curves, finetune = {}, {}
    with ProcessPoolExecutor(len(QUALITY_VARIANTS), mp_context=get_context("spawn")) as pool:
        jobs = {name: pool.submit(_variant, cfg, device, seed, dtype, name, batch, steps, LR,
                                  False) for name in QUALITY_VARIANTS}
        for name, job in jobs.items():
            curves[name], weights = job.result()
            print(f"  {name}: final loss {curves[name][-1]:.4f}", flush=True)
            if name == "32bit":
                pretrained = weights
        jobs = {name: pool.submit(_variant, cfg, device, seed, dtype, name, batch, finetune_steps,
                                  FINETUNE_LR, True, pretrained)
                for name in QUALITY_VARIANTS if finetune_steps > 0}
        for name, job in jobs.items():
            finetune[name] = job.result()[0]
            print(f"  fine-tuned {name}: final loss {finetune[name][-1]:.4f}", flush=True)
    out: dict[str, object] = {"dtype": str(dtype).removeprefix("torch."), "seed": seed,
                              "steps": steps, "finetune_steps": finetune_steps, "seq": cfg.seq,
                              "batch": batch, "warmup": WARMUP, "target": 0.01}
    for label, runs in (("pretrain", curves), ("finetune", finetune)):
        if not runs:
            continue
        out[label] = {"curves": runs,
                      "8bit vs 32bit": _gap(runs["8bit"], runs["32bit"], WARMUP),
                      "rounding twin vs 32bit": _gap(runs["32bit rounding twin"], runs["32bit"],
                                                     WARMUP)}
    return out


def ci_distribution(cfg: GPTConfig, device: torch.device, dtype: torch.dtype, seeds: list[int],
                    steps: int, batch: int) -> dict[str, object]:
    """The CI test's runs (tests/test_cli.py::test_8bit_state_loss_curve_follows_32bit:
    memkern-full's model and optimizer with ``dtype`` parameters, ``steps`` steps, model and
    data seeded alike) for several seeds: the statistics it asserts (10-step windows from
    step 0, and single steps) of 8-bit state and of the rounding twin against 32-bit state."""
    per_seed = []
    for seed in seeds:
        runs = {}
        for name in QUALITY_VARIANTS:
            runs[name] = _variant(cfg, device, seed, dtype, name, batch, steps, LR, False)[0]
        row = {"seed": seed, "curves": runs}
        for name in ("8bit", "32bit rounding twin"):
            row[f"{name} vs 32bit"] = _gap(runs[name], runs["32bit"], 0)
        per_seed.append(row)
        print(f"CI run, {dtype} parameters, seed {seed}: " + "; ".join(
            f"{k}: largest window gap {row[k]['max_window']:.3%}, step gap "
            f"{row[k]['max_step']:.3%}" for k in ("8bit vs 32bit", "32bit rounding twin vs 32bit")),
            flush=True)
    return {"dtype": str(dtype).removeprefix("torch."), "steps": steps, "seq": cfg.seq,
            "batch": batch, "per_seed": per_seed}


def _peer_optimizers() -> dict[str, object]:
    """name: a constructor of the optimizer from a parameter list, for the importable peers
    (a line says why for each one skipped)."""
    makers = {
        "memkern FusedAdamW 32bit": lambda ps: memkern.optim.FusedAdamW(ps, lr=1e-3),
        "memkern FusedAdamW 8bit": lambda ps: memkern.optim.FusedAdamW(ps, lr=1e-3,
                                                                      state_precision="8bit"),
        "torch AdamW(fused=True)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    }
    try:
        from torchao.optim import AdamW8bit as TorchaoAdamW8bit
    except ImportError as e:
        print(f"skipping torchao's AdamW8bit: {e} (pip install torchao)")
    else:
        makers["torchao AdamW8bit"] = lambda ps: TorchaoAdamW8bit(ps, lr=1e-3)
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        print(f"skipping bitsandbytes' AdamW8bit: {e} (pip install bitsandbytes)")
    else:
        makers["bitsandbytes AdamW8bit"] = lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3)
    return makers


def peers(device: torch.device, n: int, reps: int) -> dict[str, object]:
    """Each optimizer on its own float32 parameter of ``n`` elements (``[n / 1024, 1024]``,
    the same values for all): state bytes from the storages after two steps, then ``reps``
    rounds that time one step of each in turn (interleaved, so a busy machine slows all
    alike); median step time and its ratio to memkern's 32-bit step."""
    shape = (n // 1024, 1024)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    opts, out = {}, {}
    for name, make in _peer_optimizers().items():
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(shape, device=device))
        p.grad = torch.randn_like(p)
        try:
            opt = make([p])
            for _ in range(2):  # the first step creates the state (and compiles torchao's)
                opt.step()
        except Exception as e:  # a peer without a kernel for this device
            print(f"skipping {name}: {type(e).__name__}: {str(e).splitlines()[0]}")
            continue
        opts[name] = opt
        state_bytes = sum(_nbytes(t) for t in _state_tensors(opt))
        out[name] = {"state_bytes_per_param": state_bytes / p.numel()}
    times = {name: [] for name in opts}
    for _ in range(reps):
        for name, opt in opts.items():
            sync()
            start = time.perf_counter()
            opt.step()
            sync()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["memkern FusedAdamW 32bit"])
    for name, t in times.items():
        out[name].update(step_ms=statistics.median(t) * 1e3, step_ms_min=min(t) * 1e3,
                         step_ms_max=max(t) * 1e3,
                         ratio_to_memkern_32bit=statistics.median(t) / base)
    return {"elements": shape[0] * shape[1], "reps": reps, "optimizers": out}


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


SECTIONS = ("step", "bytes", "ablation", "quality", "ci", "peers")


def _print_gaps(label: str, result: dict[str, object]) -> None:
    for name in ("8bit vs 32bit", "rounding twin vs 32bit"):
        g = result[name]
        print(f"  {label}, {name}: largest step gap {g['max_step']:.2%} (median "
              f"{g['median_step']:.2%}, {g['steps_over_1pct']}/{g['steps_compared']} steps over "
              f"1%), largest 10-step window gap {g['max_window']:.2%}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, from {', '.join(SECTIONS)} (default: all)")
    parser.add_argument("--params", type=int, default=None,
                        help="elements of the step benchmark (default: 8M on CPU, 100M on GPU)")
    parser.add_argument("--steps", type=int, default=200, help="steps of the loss curves")
    parser.add_argument("--finetune-steps", type=int, default=100,
                        help="steps of the fine-tuning curves (0: no fine-tuning phase)")
    parser.add_argument("--seq", type=int, default=None,
                        help="sequence length of the loss curves (default: 128 on CPU, the "
                             "model's 256 on GPU)")
    parser.add_argument("--batch", type=int, default=4, help="batch of the loss curves")
    parser.add_argument("--dtypes", default="bfloat16,float32",
                        help="parameter dtypes of the quality runs (bfloat16: memkern-full)")
    parser.add_argument("--seeds", default="0", help="seeds of the quality runs")
    parser.add_argument("--ci-seeds", default="0,1,2,3,4,5,6,7",
                        help="seeds of the CI test's run (60 steps, seq 32; the test's own: 0)")
    parser.add_argument("--ci-dtype", default="float32",
                        help="parameter dtype of the CI test's run")
    parser.add_argument("--peer-reps", type=int, default=21,
                        help="interleaved rounds of the peers' step times")
    parser.add_argument("--save", default=None)
    args = parser.parse_args(argv)
    sections = args.sections.split(",")
    if unknown := set(sections) - set(SECTIONS):
        parser.error(f"argument --sections: unknown {sorted(unknown)}; choose from {SECTIONS}")
    device = torch.device(args.device)
    n = args.params or (8_000_011 if device.type == "cpu" else 100_000_007)
    small = SIZES["small"]
    seq = args.seq or (min(small.seq, 128) if device.type == "cpu" else small.seq)
    cfg = GPTConfig(small.layers, small.width, small.heads, seq=seq, vocab=small.vocab)
    results = {}

    if "step" in sections:
        default, *others = step_backends(device)
        for name in (default, *others):
            suffix = "" if name == default else f"_{name}"  # the default keeps the plain keys
            with backend.force(name) if suffix else contextlib.nullcontext():
                results["step" + suffix] = bench_step(n, device)
                results["sgd_step" + suffix] = bench_sgd_step(n, device)
            for key, what in (("step", "AdamW step"), ("sgd_step", "SGD momentum step")):
                if suffix:
                    what = f"{what} ({name} backend)"
                _print_step(what, n, results[key + suffix])

    if "bytes" in sections:
        results["bytes_per_param"] = bpp = bytes_per_param(cfg, device)
        for name, value in bpp.items():
            print(f"optimizer-side bytes/param, {name}: {value:.3f}")

    if "ablation" in sections:
        results["map_ablation"] = ablation = map_ablation(cfg, device)
        for name, value in ablation.items():
            print(f"update-direction error, {name}: {value:.3e}")

    if "quality" in sections:
        results["quality"] = runs = []
        for dtype in args.dtypes.split(","):
            for seed in (int(x) for x in args.seeds.split(",")):
                runs.append(r := quality(cfg, device, getattr(torch, dtype), args.steps,
                                         args.finetune_steps, seed, args.batch))
                print(f"{dtype} parameters, seed {seed}, seq {cfg.seq}, batch {args.batch}: "
                      f"{args.steps} steps after {WARMUP} warm-up steps, then fine-tuning "
                      f"{args.finetune_steps} steps at lr {FINETUNE_LR} (target: every step within "
                      "1%)", flush=True)
                _print_gaps("training", r["pretrain"])
                if "finetune" in r:
                    _print_gaps("fine-tuning", r["finetune"])

    if "ci" in sections:
        ci_cfg = GPTConfig(small.layers, small.width, small.heads, seq=32, vocab=small.vocab)
        results["ci"] = ci_distribution(ci_cfg, device, getattr(torch, args.ci_dtype),
                                        [int(x) for x in args.ci_seeds.split(",")], 60, 4)

    if "peers" in sections:
        results["peers"] = peer = peers(device, min(n, 4_194_304), args.peer_reps)
        print(f"AdamW on one float32 parameter of {peer['elements']} elements, {peer['reps']} "
              "interleaved rounds:")
        for name, r in peer["optimizers"].items():
            print(f"  {name}: {r['state_bytes_per_param']:.3f} state bytes/param, "
                  f"{r['step_ms']:.1f} ms per step (median; min {r['step_ms_min']:.1f}, max "
                  f"{r['step_ms_max']:.1f}) = {r['ratio_to_memkern_32bit']:.2f}x memkern's "
                  "32-bit step")
    if args.save:
        common.save(args.save, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
