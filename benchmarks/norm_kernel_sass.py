"""What the RMSNorm / LayerNorm CUDA kernels cost per element, seen without a GPU: csrc/cuda/norm.cu
compiled for sm_90 with nvcc, its SASS read with the ``cuobjdump`` that Triton ships (as
``step_kernel_sass.py`` counts the optimizer kernels). Rows: bf16 x, dy and weight.

The general path (any width) loops over a row's columns, one element per trip, in several
passes; each pass's loop is told apart by its global loads and stores. Counted for RMSNorm with
a weight, the path of a Llama RMSNorm: forward = the sum-of-squares pass (x) + the output pass
(x, weight -> y); backward = the sums pass (dy, x, weight) + the dx pass (dy, x, weight -> dx)
+ the weight-gradient kernel's row loop (dy, x and the row's rstd, unrolled over rows).

The vector path holds a row in registers, ``Slots`` 16-byte vectors per thread, one pass of
straight-line code per row: the cost of one more element is the row loop's length at two slots
minus its length at one, over the 8 elements of a bf16 vector. That counts the code of every
variant compiled into the loop (LayerNorm's mean pass, bias or none), so it bounds the RMSNorm
path from above. Neither count includes the per-row block reductions (shuffles, two barriers,
shared memory: the same in both paths), which a row of 4096 spreads over 8 elements per
thread.

Usage: python benchmarks/norm_kernel_sass.py [--out benchmarks/results/sm90-norm-kernel-sass.json]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import common
from step_kernel_sass import functions, loops, opcode, sm90_cubin

HERE = os.path.dirname(os.path.abspath(__file__))
BF16 = "I13__nv_bfloat16S2_"  # <bf16 x, bf16 weight> instances
VEC_WIDTH = 8  # bf16 elements per 16-byte vector


def memory(body: list[str]) -> collections.Counter:
    """Global loads and stores of a loop body by width: LDG.U16, LDG.128, STG.U16, ..."""
    return collections.Counter(
        f"{opcode(t)}.{'128' if '.128' in t else 'U16' if '.U16' in t else '32'}"
        for t in body if opcode(t) in ("LDG", "STG"))


def loop_bodies(code: list[tuple[int, str]]) -> list[list[str]]:
    return [[t for a, t in code if start <= a <= end] for start, end in loops(code)]


def innermost(code, loads: int, stores: int) -> list[list[str]]:
    """The innermost loops (holding no other loop) with this many 16-bit global loads and
    stores, in code order."""
    spans = sorted(loops(code))
    inner = [(s, e) for s, e in spans
             if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in spans)]
    bodies = [[t for a, t in code if s <= a <= e] for s, e in inner]
    found = [b for b in bodies
             if memory(b)["LDG.U16"] == loads and memory(b)["STG.U16"] == stores]
    if not found:
        raise SystemExit(f"no loop with {loads} 16-bit loads and {stores} stores")
    return found


def row_loop(code) -> list[str]:
    """The vector path's row loop: the longest loop with a 16-byte load."""
    return max((b for b in loop_bodies(code) if memory(b)["LDG.128"]), key=len)


def count(cubin: bytes) -> dict[str, dict[str, float]]:
    funcs = functions(cubin)

    def code(kernel: str, extra: str = "") -> list[tuple[int, str]]:
        return funcs[next(n for n in funcs if f"{kernel}{BF16}{extra}" in n)]

    rows = {}
    fwd = code("norm_forward_kernel")
    # x alone: LayerNorm's mean pass, then the sum of squares; x and the weight -> y
    sum_sq, output = innermost(fwd, 1, 0)[-1], innermost(fwd, 2, 1)[0]
    rows["general forward"] = {"per_element": len(sum_sq) + len(output),
                               "global_accesses_per_element": 4}
    grad = code("norm_input_grad_kernel")
    sums, dx = innermost(grad, 3, 0)[0], innermost(grad, 3, 1)[0]  # dy, x and the weight
    partials_code = funcs[next(n for n in funcs
                               if "norm_weight_grad_partials_kernelI13__nv_bfloat16E" in n)]
    partials = max(loop_bodies(partials_code), key=lambda b: memory(b)["LDG.U16"]
                   / max(len(b), 1))  # the unrolled row loop: the most loads per instruction
    partial_rows = memory(partials)["LDG.U16"] / 2  # dy and x per row
    rows["general backward"] = {
        "per_element": len(sums) + len(dx) + len(partials) / partial_rows,
        "global_accesses_per_element": 3 + 4 + 2 + 1}
    for name, kernel, accesses in (("vector forward", "norm_forward_vec_kernel", 2 / VEC_WIDTH),
                                   ("vector backward", "norm_backward_vec_kernel",
                                    4 / VEC_WIDTH)):
        one, two = (len(row_loop(code(kernel, f"Li{s}E"))) for s in (1, 2))
        rows[name] = {"per_element": (two - one) / VEC_WIDTH,
                      "row_loop_at_one_slot": one, "row_loop_at_two_slots": two,
                      "global_accesses_per_element": accesses}
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out",
                        default=os.path.join(HERE, "results", "sm90-norm-kernel-sass.json"))
    args = parser.parse_args(argv)
    cubin = sm90_cubin("norm.cu")
    if cubin is None:
        raise SystemExit("nvcc not found: put the CUDA toolkit's bin/ on the PATH")
    rows = count(cubin)
    print(f"{'RMSNorm kernels, bf16 x/dy/weight, sm_90':<42} {'SASS per elt':>12} "
          f"{'global accesses per elt':>24}")
    for name, r in rows.items():
        print(f"{name:<42} {r['per_element']:>12.1f} {r['global_accesses_per_element']:>24.2f}")
    common.save(args.out, {"kernels": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
