"""Host time per layer call and per tiny train step: memkern against torch (issue 12).

On tiny tensors the device work is negligible, so what is timed is the host path — Python,
autograd, the dispatcher, and on a GPU the kernel launches. Three parts, one process run:

* **layers**: forward + backward of each memkern layer on an ``[8, 64]`` input against its
  torch counterpart (median per call of ``--reps`` interleaved batches of ``--calls`` calls,
  single-threaded: ``torch.set_num_threads(1)``), and of a norm followed by Linear / MLP /
  SwiGLU (a transformer block's common case: the layer's input is the norm's output). Targets
  (issue 12): every layer ≤ 1.2× torch's, Linear / LayerNorm / RMSNorm / Dropout (and
  LayerNorm→Linear) ≤ 1.0×.
* **launches**: per layer call, the kernel launches of the GPU path, counted from the code
  path so that it runs on the CPU too: a child process runs each layer with the Triton backend
  (``MEMKERN_BACKEND=triton``, ``TRITON_INTERPRET=1`` without a GPU) and counts every Triton
  launch plus every ATen op that runs a kernel (views, ``empty*`` and metadata ops run none)
  and every memkern kernel op a layer's C++ autograd calls through the dispatcher;
  torch's layer is counted the same way (one per ATen op — on CUDA a few ATen ops launch more
  than one kernel, e.g. LayerNorm's backward, so torch's count is a lower bound).
* **steps**: one train step (forward, backward, clip, optimizer, zero grads) of a 2-layer
  width-64 GPT at seq 16, batch 8, under every ``memkern bench`` configuration. Target:
  memkern-full ≤ 1.0× torch-amp.
* **on CUDA, host and GPU time** (:mod:`memkern.bench.host_device`): per layer call and per
  step, the time to issue the work and its kernels' summed time, so the run shows which one
  bounds each. Target (issue 23): every layer's host time ≤ 1.1× torch's, fp32 and bf16.

    python benchmarks/bench_overhead.py [--device cpu|cuda] [--dtype float32|bfloat16]
        [--reps 9] [--calls 200] [--save benchmarks/results/cpu-overhead.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import memkern as mk  # noqa: E402
from memkern.bench import host_device  # noqa: E402
from memkern.bench.configs import DEFAULT_CONFIGS, build  # noqa: E402
from memkern.bench.model import GPTConfig  # noqa: E402

ROWS, WIDTH, CLASSES = 8, 64, 1000
TARGETS = {"Linear": 1.0, "LayerNorm": 1.0, "RMSNorm": 1.0, "Dropout": 1.0, "MLP": 1.2,
           "SwiGLU": 1.2, "LinearCrossEntropy": 1.2, "LayerNorm→Linear": 1.0,
           "LayerNorm→MLP": 1.2, "RMSNorm→SwiGLU": 1.2}
TINY = GPTConfig(layers=2, width=WIDTH, heads=2, seq=16)
TINY_BATCH = 8
STEP_TARGET = ("memkern-full", "torch-amp", 1.0)
HOST_TARGET_CUDA = 1.1  # memkern's host time per layer call / torch's, on CUDA (issue 23)
SPLIT_REPS = 3  # repetitions of --calls calls for the host/GPU split on CUDA


def layer_pairs(device: torch.device, dtype: torch.dtype) -> dict[str, tuple[Callable, Callable]]:
    """name -> (torch call, memkern call), each one forward + backward of the layer."""
    torch.manual_seed(0)
    x = torch.randn(ROWS, WIDTH, device=device, dtype=dtype, requires_grad=True)
    target = torch.randint(0, CLASSES, (ROWS,), device=device)

    def modules(a: nn.Module, b: nn.Module) -> tuple[Callable, Callable]:
        a, b = a.to(device, dtype), b.to(device, dtype)
        return (lambda: a(x).sum().backward()), (lambda: b(x).sum().backward())

    lin_t, lin_m = nn.Linear(WIDTH, CLASSES, bias=False), mk.nn.LinearCrossEntropy(WIDTH, CLASSES)
    lin_t, lin_m = lin_t.to(device, dtype), lin_m.to(device, dtype)
    return {
        "Linear": modules(nn.Linear(WIDTH, WIDTH), mk.nn.Linear(WIDTH, WIDTH)),
        "LayerNorm": modules(nn.LayerNorm(WIDTH), mk.nn.LayerNorm(WIDTH)),
        "RMSNorm": modules(nn.RMSNorm(WIDTH), mk.nn.RMSNorm(WIDTH)),
        "Dropout": modules(nn.Dropout(0.1), mk.nn.Dropout(0.1)),
        "MLP": modules(
            nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(approximate="tanh"),
                          nn.Linear(4 * WIDTH, WIDTH)),
            mk.nn.MLP(WIDTH, 4 * WIDTH, activation="gelu_tanh")),
        "SwiGLU": modules(common.TorchSwiGLU(WIDTH, 4 * WIDTH), mk.nn.SwiGLU(WIDTH, 4 * WIDTH)),
        # the common case in a transformer block: the layer's input is a norm's output (memkern's
        # layer saves the norm's input and rebuilds the output in backward)
        "LayerNorm→Linear": modules(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 3 * WIDTH)),
            nn.Sequential(mk.nn.LayerNorm(WIDTH), mk.nn.Linear(WIDTH, 3 * WIDTH))),
        "LayerNorm→MLP": modules(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH),
                          nn.GELU(approximate="tanh"), nn.Linear(4 * WIDTH, WIDTH)),
            nn.Sequential(mk.nn.LayerNorm(WIDTH),
                          mk.nn.MLP(WIDTH, 4 * WIDTH, activation="gelu_tanh"))),
        "RMSNorm→SwiGLU": modules(
            nn.Sequential(nn.RMSNorm(WIDTH), common.TorchSwiGLU(WIDTH, 4 * WIDTH)),
            nn.Sequential(mk.nn.RMSNorm(WIDTH), mk.nn.SwiGLU(WIDTH, 4 * WIDTH))),
        "LinearCrossEntropy": (
            lambda: F.cross_entropy(lin_t(x).float(), target).backward(),
            lambda: lin_m(x, target).backward()),
    }


def per_call_seconds(fns: list[Callable], *, reps: int, calls: int, device: torch.device
                     ) -> list[float]:
    """Median seconds per call of each fn, batches of ``calls`` interleaved over ``reps``, in
    turn first and last (whichever runs first in a round can find caches and the allocator in
    another state). On the CPU the clock is this thread's CPU time, which the other processes
    of a shared machine do not inflate (wall time counts the slices they take); on a GPU it is
    wall time, synchronised."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock = time.perf_counter if device.type == "cuda" else time.thread_time
    for fn in fns:
        for _ in range(max(10, calls // 10)):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for rep in range(reps):
        order = list(zip(fns, times))
        for fn, out in order if rep % 2 == 0 else reversed(order):
            sync()
            start = clock()
            for _ in range(calls):
                fn()
            sync()
            out.append((clock() - start) / calls)
    return [statistics.median(t) for t in times]


def tiny_steps(device: torch.device) -> dict[str, Callable]:
    """One tiny-GPT train step of every ``memkern bench`` configuration, by name."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, TINY.vocab, (TINY_BATCH, TINY.seq), generator=gen).to(device)
    y = torch.randint(0, TINY.vocab, (TINY_BATCH, TINY.seq), generator=gen).to(device)
    steps = {}
    for name in DEFAULT_CONFIGS:
        setup = build(name, TINY, device)
        steps[name] = (lambda s=setup: s.train_step(x, y))
    return steps


def step_seconds(steps: dict[str, Callable], device: torch.device, reps: int,
                 calls: int) -> dict[str, float]:
    """Median seconds per tiny-GPT train step of each configuration in ``steps``."""
    secs = per_call_seconds(list(steps.values()), reps=reps, calls=max(1, calls // 10),
                            device=device)
    return dict(zip(steps, secs))


# --- launch counting (runs in a child process: TRITON_INTERPRET must be set before import) --

_NO_KERNEL = {"promote_types", "empty", "empty_like", "empty_strided", "new_empty",
              "new_empty_strided", "lift_fresh", "detach", "_has_compatible_shallow_copy_type",
              "set_", "resize_", "_local_scalar_dense", "is_nonzero", "sym_size", "sym_stride",
              "sym_numel", "sym_storage_offset"}


def _count_launches(fn: Callable) -> dict[str, int]:
    """Kernel launches of one call of ``fn``: Triton launches + ATen ops that run a kernel +
    memkern kernel ops reached through the dispatcher (a layer's C++ autograd calls them so,
    where the forced Triton backend does not reach: each is one kernel on the GPU)."""
    import triton.runtime.jit as jit
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = {"aten": 0, "triton": 0, "memkern": 0, "host_syncs": 0}
    inside_triton = [False]  # the interpreter's own host copies are not launches

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name.split("::")[-1]
            if inside_triton[0]:
                pass
            elif name == "_local_scalar_dense":
                counts["host_syncs"] += 1
            elif func.namespace == "aten" and not func.is_view and name not in _NO_KERNEL:
                counts["aten"] += 1
            elif func.namespace == "memkern" and not name.endswith("_layer"):
                counts["memkern"] += 1
            return func(*args, **(kwargs or {}))

    classes = [jit.JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except ImportError:
        pass
    originals = {cls: cls.run for cls in classes}

    def counting(original):
        def run(self, *args, **kwargs):
            if not kwargs.get("warmup", False):
                counts["triton"] += 1
            inside_triton[0] = True
            try:
                return original(self, *args, **kwargs)
            finally:
                inside_triton[0] = False
        return run

    for cls, original in originals.items():
        cls.run = counting(original)
    try:
        with Count():
            fn()
    finally:
        for cls, original in originals.items():
            cls.run = original
    counts["launches"] = counts["aten"] + counts["triton"] + counts["memkern"]
    return counts


def launch_counts_child(device: str, dtype: str) -> None:
    dev = torch.device(device)
    pairs = layer_pairs(dev, getattr(torch, dtype))
    out = {}
    for name, (torch_fn, mk_fn) in pairs.items():
        for _ in range(2):  # compile and cache first (the second call has .grad to add into)
            torch_fn(), mk_fn()
        out[name] = {"torch": _count_launches(torch_fn), "memkern": _count_launches(mk_fn)}
    print(json.dumps(out))


def launch_counts(device: torch.device, dtype: torch.dtype) -> dict[str, dict]:
    env = dict(os.environ, MEMKERN_BACKEND="triton")
    if device.type == "cpu":
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, os.path.abspath(__file__), "--count-launches-child",
           "--device", device.type, "--dtype", str(dtype).removeprefix("torch.")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--calls", type=int, default=200, help="calls per timed batch")
    parser.add_argument("--save", default=None, help="write the results as JSON here")
    parser.add_argument("--count-launches-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device_name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.count_launches_child:
        launch_counts_child(device_name, args.dtype)
        return 0
    torch.set_num_threads(1)
    device, dtype = torch.device(device_name), getattr(torch, args.dtype)

    launches = launch_counts(device, dtype)
    cuda = device.type == "cuda"
    layers, splits = {}, []
    print(f"host time per forward+backward call, [{ROWS}, {WIDTH}] {args.dtype} on {device_name}, "
          "1 thread (launches: GPU path, counted from the code path)")
    print(f"{'layer':<20}{'torch µs':>10}{'memkern µs':>12}{'ratio':>8}{'target':>8}"
          f"{'launches torch':>16}{'memkern':>9}")
    for name, (torch_fn, mk_fn) in layer_pairs(device, dtype).items():
        t_torch, t_mk = per_call_seconds([torch_fn, mk_fn], reps=args.reps, calls=args.calls,
                                         device=device)
        n = launches[name]
        layers[name] = {"torch_us": t_torch * 1e6, "memkern_us": t_mk * 1e6,
                        "ratio": t_mk / t_torch, "target": TARGETS[name],
                        "launches_torch": n["torch"], "launches_memkern": n["memkern"]}
        print(f"{name:<20}{t_torch * 1e6:>10.1f}{t_mk * 1e6:>12.1f}{t_mk / t_torch:>7.2f}×"
              f"{TARGETS[name]:>7.2f}×{n['torch']['launches']:>16}{n['memkern']['launches']:>9}")
        if cuda:
            split_torch, split_mk = (host_device.measure(fn, reps=SPLIT_REPS, calls=args.calls)
                                     for fn in (torch_fn, mk_fn))
            splits.append((name, split_torch, split_mk))
            layers[name].update(
                host_us_torch=split_torch.host_seconds * 1e6,
                host_us_memkern=split_mk.host_seconds * 1e6,
                gpu_us_torch=split_torch.gpu_seconds * 1e6,
                gpu_us_memkern=split_mk.gpu_seconds * 1e6,
                host_ratio=split_mk.host_seconds / split_torch.host_seconds,
                host_target=HOST_TARGET_CUDA, bound_memkern=split_mk.bound)
    if cuda:
        print(f"\non CUDA, per call: host = issuing it, GPU = its kernels' summed time; "
              f"target: memkern's host time ≤ {HOST_TARGET_CUDA:.1f}× torch's")
        print(f"{'layer':<20}{'host µs torch':>14}{'memkern':>9}{'ratio':>8}{'target':>8}"
              f"{'GPU µs torch':>14}{'memkern':>9}{'memkern is':>12}")
        for name, st, sm in splits:
            print(f"{name:<20}{st.host_seconds * 1e6:>14.1f}{sm.host_seconds * 1e6:>9.1f}"
                  f"{sm.host_seconds / st.host_seconds:>7.2f}×{HOST_TARGET_CUDA:>7.2f}×"
                  f"{st.gpu_seconds * 1e6:>14.1f}{sm.gpu_seconds * 1e6:>9.1f}"
                  f"{sm.bound + '-bound':>12}")

    tiny = tiny_steps(device)
    steps = step_seconds(tiny, device, args.reps, args.calls)
    mk_name, base_name, target = STEP_TARGET
    print(f"\ntiny GPT train step ({TINY.layers} layers, width {TINY.width}, seq {TINY.seq}, "
          f"batch {TINY_BATCH}):")
    for name, secs in steps.items():
        print(f"  {name:<20}{secs * 1e6:>10.0f} µs  {secs / steps[base_name]:.2f}× {base_name}")
    ratio = steps[mk_name] / steps[base_name]
    print(f"{mk_name} / {base_name}: {ratio:.2f}× (target ≤ {target:.2f}×)")
    step_splits = {}
    if cuda:
        step_splits = {name: host_device.measure(fn, reps=SPLIT_REPS,
                                                 calls=max(1, args.calls // 10))
                       for name, fn in tiny.items()}
        print("\ntiny GPT train step on CUDA (host: issuing it; GPU: its kernels' summed time):")
        print("\n".join(host_device.table(list(step_splits.items()), unit="µs")))
    if args.save:
        common.save(args.save, {
            "dtype": args.dtype, "shape": [ROWS, WIDTH], "reps": args.reps, "calls": args.calls,
            "layers": layers,
            "tiny_step_us": {k: v * 1e6 for k, v in steps.items()},
            "tiny_step_ratio": {"configuration": mk_name, "baseline": base_name,
                                "ratio": ratio, "target": target},
            "tiny_step_host_gpu_us": {k: {"host": v.host_seconds * 1e6, "gpu": v.gpu_seconds * 1e6,
                                          "bound": v.bound} for k, v in step_splits.items()},
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
