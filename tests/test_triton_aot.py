"""Every memkern Triton kernel compiles for real GPUs (sm_80, sm_90) as the ops launch it.

The CPU interpreter that runs the kernels in CI accepts code that GPU compilers reject (the
first GPU run found Python float globals in ``@triton.jit`` code that no GPU could compile).
These tests compile ahead of time with ``triton.compile`` for a ``GPUTarget``, which needs no
GPU; ``tests/triton_aot.py`` records what the ops launch and does the compiling, in a process
of its own (see there why).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import memkern.ops as ops

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).parent))
import triton_aot  # noqa: E402

SCRIPT = Path(__file__).with_name("triton_aot.py")
TRITON_OPS = sorted(op.name for op in (*ops.ALL, *ops.NN_OPS) if op.has_triton)


def _run(*args: str):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def test_every_triton_op_has_cases():
    """A new op with a Triton kernel cannot slip past: it needs argument cases here."""
    assert sorted(triton_aot.CASES) == TRITON_OPS


def test_every_kernel_is_reached_by_a_launch():
    """Every @triton.jit function in memkern.kernels is launched, or called by one that is."""
    result = _run("--coverage")
    assert result["launches"] > 0
    assert result["uncovered"] == [], f"never compiled: {result['uncovered']}"


@pytest.mark.slow
@pytest.mark.parametrize("op", TRITON_OPS)
def test_kernels_compile_for_gpu(op):
    results = _run(op)
    assert results, f"{op}: no launch recorded"
    assert {r["arch"] for r in results} == set(triton_aot.ARCHS)
    failures = [f"sm_{r['arch']} {r['kernel']} {r['signature']} {r['constexprs']}:\n{r['error']}"
                for r in results if r["error"] is not None]
    assert not failures, (f"{len(failures)} of {len(results)} compilations failed:\n"
                          + "\n\n".join(failures[:5]))


def test_bf16_hand_rounding_compiles_to_the_interpreters_semantics():
    """``round_to``'s bfloat16 rounding is integer arithmetic; the interpreter runs it with
    numpy's semantics. Compiled, the shifts must be logical (unsigned) and the NaN test an
    unordered compare (``x != x`` true for NaN), or the GPU would round differently."""
    ttir = _run("--bf16-store-ir")["ttir"]
    assert "arith.shrui" in ttir and "arith.shrsi" not in ttir
    assert "arith.cmpf une" in ttir
    assert "tt.bitcast" in ttir
