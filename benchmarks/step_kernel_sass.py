"""What the optimizer-step kernels cost a GPU, seen without one: each is compiled for sm_90 (the
CUDA kernels with nvcc, the Triton ones with ``triton.compile`` for a ``GPUTarget``) and its
SASS counted with the ``cuobjdump`` that Triton ships. A step kernel that runs at the copy
bandwidth has a budget of instructions per element (an H100 issues ~30 T lane-instructions/s
and moves the ~16 bytes of an 8-bit bf16 AdamW element at ~150 G elements/s at 80% of its
copy bandwidth: ~200 per element); the counts show which kernels spend it.

Rows: bf16 grads and params. ``correctly rounded divisions`` counts FCHK, the range check that
every IEEE division emits. Triton kernels: the whole kernel (straight-line code, 8 elements per
thread for every kernel here). CUDA: the loop of the vector path, the one all but the last
few elements take (``kVecWidth`` = 8 elements per thread and trip: a grid-stride loop over
vector chunks in the 32-bit kernels, over whole quantization blocks in the 8-bit ones, the
instantiation for aligned buffers); the tail's element path and the rare slow paths of a
division or a root are not counted.

Usage: python benchmarks/step_kernel_sass.py [--backends cuda,triton]
       [--out benchmarks/results/sm90-step-kernel-sass.json]
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
CUDA_KERNELS = {  # kernel -> the mangled template arguments of its bf16/bf16 vector instance
    "adamw_step_kernel": "I13__nv_bfloat16S2_E", "sgd_step_kernel": "I13__nv_bfloat16S2_E",
    "adamw8bit_step_kernel": "I13__nv_bfloat16S2_Lb1EE",
    "sgd8bit_step_kernel": "I13__nv_bfloat16S2_Lb1EE"}
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


def summary(instructions: list[str], elements: int) -> dict[str, int]:
    """Counts over ``instructions``, code that handles ``elements`` elements per thread."""
    ops = collections.Counter(opcode(t) for t in instructions)
    return {"instructions": len(instructions), "elements": elements,
            "correctly_rounded_divisions": ops["FCHK"], "special_function_unit": ops["MUFU"],
            "memory": ops["LDG"] + ops["STG"]}


def loops(code: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last) addresses of every loop: the spans closed by a backward branch."""
    return [(int(m.group(1), 16), a) for a, t in code
            for m in [re.search(r"\bBRA\s+(?:`\(\S+\)\s+)?0x([0-9a-f]+)", t)]
            if m and int(m.group(1), 16) < a]


def vector_width() -> int:
    """Elements per thread and trip of the CUDA flat kernels' vector loop (common.cuh)."""
    with open(os.path.join(ROOT, "csrc", "cuda", "kernels", "common.cuh")) as fh:
        return int(re.search(r"constexpr int kVecWidth = (\d+);", fh.read()).group(1))


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
        out[f"triton {op}"] = summary([t for _, t in code], 8)
    return out


def sm90_cubin(source: str) -> bytes | None:
    """csrc/cuda/``source`` compiled for sm_90 by the nvcc on the PATH; None without one."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernels.cubin")
        subprocess.run([nvcc, "-O3", "-std=c++17", "-arch=sm_90", "-cubin", "-o", cubin,
                        os.path.join(ROOT, "csrc", "cuda", source)], check=True)
        with open(cubin, "rb") as fh:
            return fh.read()


def cuda_kernels() -> dict[str, dict[str, int]]:
    cubin = sm90_cubin("flat_ops.cu")
    if cubin is None:
        print("nvcc not found: the CUDA kernels are not counted")
        return {}
    funcs = functions(cubin)
    out = {}
    for kernel, arguments in CUDA_KERNELS.items():
        code = funcs[next(n for n in funcs if f"{kernel}{arguments}" in n)]
        # the loops with 16-byte loads are the vector path (one copy per case the compiler
        # unswitched, e.g. with and without a params copy): the largest one writes params
        bodies = [[t for a, t in code if start <= a <= end] for start, end in loops(code)]
        body = max((b for b in bodies if any(opcode(t) == "LDG" and ".128" in t for t in b)),
                   key=len)
        out[f"cuda {kernel} (vector loop)"] = summary(body, vector_width())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out",
                        default=os.path.join(HERE, "results", "sm90-step-kernel-sass.json"))
    parser.add_argument("--backends", default="triton,cuda",
                        help="comma-separated: which kernels to count (default: both)")
    args = parser.parse_args(argv)
    counters = {"triton": triton_kernels, "cuda": cuda_kernels}
    chosen = args.backends.split(",")
    if unknown := set(chosen) - set(counters):
        parser.error(f"argument --backends: unknown {sorted(unknown)}; choose from "
                     f"{sorted(counters)}")
    rows = {name: row for b in chosen for name, row in counters[b]().items()}
    print(f"{'kernel (bf16 grads and params, sm_90)':<46} {'SASS':>6} {'per elt':>8} "
          f"{'divisions':>9} {'MUFU':>5} {'LDG+STG':>7}")
    for name, r in rows.items():
        print(f"{name:<46} {r['instructions']:>6} {r['instructions'] / r['elements']:>8.0f} "
              f"{r['correctly_rounded_divisions']:>9} {r['special_function_unit']:>5} "
              f"{r['memory']:>7}")
    common.save(args.out, {"kernels": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
