"""What the optimizer-step kernels cost a GPU, seen without one: each is compiled for sm_90 (the
CUDA kernels with nvcc, the Triton ones with ``triton.compile`` for a ``GPUTarget``) and its
SASS counted with the ``cuobjdump`` that Triton ships. A step kernel that runs at the copy
bandwidth has a budget of instructions per element (an H100 issues ~30 T lane-instructions/s
and moves the ~16 bytes of an 8-bit bf16 AdamW element at ~150 G elements/s at 80% of its
copy bandwidth: ~200 per element); the counts show which kernels spend it.

Rows: bf16 grads and params. ``correctly rounded divisions`` counts FCHK, the range check that
every IEEE division emits. Triton kernels: the whole kernel (straight-line code, 8 elements per
thread for every kernel here). CUDA: the loop over quantization blocks of the 8-bit kernels (8
elements per lane), whose per-element branches make the whole function's count meaningless.

Usage: python benchmarks/step_kernel_sass.py [--out benchmarks/results/sm90-step-kernel-sass.json]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

import common

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TRITON_OPS = ("adamw_step_", "adamw8bit_step_", "sgd_step_", "sgd8bit_step_")
CUDA_KERNELS = ("adamw8bit_step_kernel", "sgd8bit_step_kernel")
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P\w+\s+)?[A-Z][A-Z0-9_.]*[^;]*);")


def cuobjdump() -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(path):
        raise SystemExit(f"no cuobjdump at {path}: this triton does not ship it")
    return path


def functions(cubin: bytes) -> dict[str, list[tuple[int, str]]]:
    """name -> [(address, instruction)] of every function in the cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        sass = subprocess.run([cuobjdump(), "-sass", fh.name], capture_output=True, text=True,
                              check=True).stdout
    out = {}
    for part in re.split(r"\n\s*Function : ", sass)[1:]:
        out[part.split("\n")[0].strip()] = [(int(a, 16), t) for a, t in INSTRUCTION.findall(part)]
    return out


def opcode(instruction: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def summary(instructions: list[str]) -> dict[str, int]:
    ops = collections.Counter(opcode(t) for t in instructions)
    return {"instructions": len(instructions), "correctly_rounded_divisions": ops["FCHK"],
            "special_function_unit": ops["MUFU"], "memory": ops["LDG"] + ops["STG"]}


def triton_kernels() -> dict[str, dict[str, int]]:
    os.environ.pop("TRITON_INTERPRET", None)
    # the launch recorder and compiler of the AOT compile test (tests/triton_aot.py)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import triton_aot

    out = {}
    for op in TRITON_OPS:
        launch = next(la for la in triton_aot.record_launches([op])
                      if la["signature"].get("grads_ptr") == "*bf16"
                      and la["signature"].get("params_ptr") == "*bf16")
        (name, code), = functions(triton_aot.compile_for(launch, 90).asm["cubin"]).items()
        out[f"triton {op}"] = summary([t for _, t in code])
    return out


def cuda_kernels() -> dict[str, dict[str, int]]:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("nvcc not found: the CUDA kernels are not counted")
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "flat_ops.cubin")
        subprocess.run([nvcc, "-O3", "-std=c++17", "-arch=sm_90", "-cubin", "-o", cubin,
                        os.path.join(ROOT, "csrc", "cuda", "flat_ops.cu")], check=True)
        with open(cubin, "rb") as fh:
            funcs = functions(fh.read())
    out = {}
    for kernel in CUDA_KERNELS:
        # mangled name of kernel<__nv_bfloat16, __nv_bfloat16>
        name = next(n for n in funcs if f"{kernel}I13__nv_bfloat16S2_" in n)
        code = funcs[name]
        # the outermost backward branch: the loop over the warp's quantization blocks
        loops = [(int(m.group(1), 16), a) for a, t in code
                 for m in [re.search(r"\bBRA\s+(?:`\(\S+\)\s+)?0x([0-9a-f]+)", t)]
                 if m and int(m.group(1), 16) < a]
        start, end = max(loops, key=lambda span: span[1] - span[0])
        out[f"cuda {kernel} (block loop)"] = summary([t for a, t in code if start <= a <= end])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out",
                        default=os.path.join(HERE, "results", "sm90-step-kernel-sass.json"))
    args = parser.parse_args(argv)
    rows = {**triton_kernels(), **cuda_kernels()}
    print(f"{'kernel (bf16 grads and params, sm_90)':<46} {'SASS':>6} {'per elt':>8} "
          f"{'divisions':>9} {'MUFU':>5} {'LDG+STG':>7}")
    for name, r in rows.items():
        print(f"{name:<46} {r['instructions']:>6} {r['instructions'] / 8:>8.0f} "
              f"{r['correctly_rounded_divisions']:>9} {r['special_function_unit']:>5} "
              f"{r['memory']:>7}")
    common.save(args.out, {"elements_per_thread": 8, "kernels": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
