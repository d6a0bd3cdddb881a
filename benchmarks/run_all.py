"""The whole benchmark suite: kernels, optimizer front end, modules and the end-to-end
``memkern bench``, each against plain torch measured in the same run. Results go to
``benchmarks/results/<device>-*.json`` (with the command and machine that produced them) and
the end-to-end memory chart to ``benchmarks/results/<device>-bench.png``.

Usage: python benchmarks/run_all.py [--device cpu|cuda] [--quick]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--quick", action="store_true",
                        help="smaller sizes and fewer repetitions (a smoke run; results are "
                             "written to a *-quick.json file)")
    args = parser.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    suffix = "-quick" if args.quick else ""
    results = os.path.join(HERE, "results")
    os.makedirs(results, exist_ok=True)

    def out(name: str, ext: str = "json") -> str:
        return os.path.relpath(os.path.join(results, f"{device}-{name}{suffix}.{ext}"))

    quick_kernels = ["--adam-params", "2000003"] if args.quick else []
    quick_front = ["--params", "4000037", "--reps", "3"] if args.quick else []
    quick_modules = ["--reps", "1"] if args.quick else []
    quick_bench = ["--size", "tiny", "--steps", "4"] if args.quick else []
    quick_overhead = ["--reps", "3", "--calls", "50"] if args.quick else []
    runs = [
        [sys.executable, os.path.join(HERE, "bench_kernels.py"), "--device", device,
         "--save", out("kernels"), *quick_kernels],
        [sys.executable, os.path.join(HERE, "bench_front_end.py"), "--device", device,
         "--save", out("front-end"), *quick_front],
        [sys.executable, os.path.join(HERE, "bench_modules.py"), "--device", device,
         "--save", out("modules"), *quick_modules],
        [sys.executable, os.path.join(HERE, "bench_overhead.py"), "--device", device,
         "--save", out("overhead"), *quick_overhead],
        [sys.executable, "-m", "memkern.cli", "bench", "--device", device, "--json",
         out("bench"), "--plot", out("bench", "png"), *quick_bench],
    ]
    if device == "cuda" and not args.quick:
        # The GPU targets of issue 12/14 in the same call: GPT-2 small (batch 8, seq 1024) eager
        # and compiled against compiled AMP with and without torch's memory budget; HF models
        # against Liger-Kernel; the 8-bit step against the copy bandwidth.
        gpt2 = ["--size", "gpt2-small", "--batch", "8", "--steps", "10"]
        runs += [
            [sys.executable, "-m", "memkern.cli", "bench", "--device", device, *gpt2,
             "--configs", "torch-amp,torch-amp-compiled,torch-amp-compiled-budget,memkern-full,"
             "memkern-full-ckpt,memkern-full-8bit", "--json", out("bench-gpt2-small")],
            [sys.executable, "-m", "memkern.cli", "bench", "--device", device, *gpt2,
             "--compile", "--configs", "torch-amp-compiled,memkern-full,memkern-full-ckpt",
             "--json", out("bench-gpt2-small-compiled")],
            [sys.executable, os.path.join(HERE, "bench_hf.py"), "--device", device, "--size",
             "160m", "--save", out("hf")],
            [sys.executable, os.path.join(HERE, "bench_8bit_state.py"), "--device", device,
             "--sections", "step,bytes", "--save", out("8bit-step")],
        ]
    failures = []
    for cmd in runs:  # all of them, even after a failure: a GPU run is too dear to stop early
        print(f"\n$ {' '.join(os.path.relpath(c) if c.endswith('.py') else c for c in cmd[1:])}",
              flush=True)
        done = subprocess.run(cmd)
        if done.returncode != 0:
            failures.append(f"exit status {done.returncode}: {' '.join(cmd)}")
    for failure in failures:
        print(f"run_all: failed with {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
