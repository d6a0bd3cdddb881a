"""Ahead-of-time compilation of every memkern Triton kernel for real GPUs, without a GPU.

The Triton interpreter (how CI runs the kernels) accepts code that every GPU compiler rejects,
so this module compiles each kernel with ``triton.compile`` for a ``GPUTarget`` — which needs
no GPU — exactly as the ops launch it: every dtype and every constexpr value.

The launches are not listed by hand. Each op's Triton launcher runs on CPU tensors with
``JITFunction.run`` replaced by a recorder (nothing executes, nothing is read back), over
argument cases built from the ops' own constants (the kernels' dtype lists, the activation
kinds, the block sizes the launchers derive from shapes). Whatever the launchers pass — a new
kernel, dtype or constexpr value — is what gets compiled. :func:`uncovered_kernels` names
every ``@triton.jit`` function in :mod:`memkern.kernels` that no recorded launch reaches, and
:data:`CASES` must name every op that has a Triton implementation; the tests fail otherwise.

Runs in its own process (``python tests/triton_aot.py OP ...``): with ``TRITON_INTERPRET=1``,
as the test process has it, ``@triton.jit`` makes interpreter objects that cannot be compiled.
Each run compiles into a fresh cache directory: nothing is reused between runs.
"""
from __future__ import annotations

import importlib
import itertools
import json
import os
import pkgutil
import sys
import tempfile
import types
from collections.abc import Callable, Iterator
from typing import Any

ARCHS = (80, 90)
"""Compute capabilities compiled for: sm_80 (A100) and sm_90 (H100/H200)."""

_POINTER_TYPES = {
    "float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64",
    "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1",
}


# --------------------------------------------------------------------------------------------
# Argument cases, one builder per op with a Triton implementation.


def _pairwise(axes: dict[str, tuple]) -> list[dict[str, Any]]:
    """A small set of assignments covering every pair of values of any two axes (greedy)."""
    names = list(axes)
    if len(names) < 2:
        return [{names[0]: v} for v in axes[names[0]]] if names else [{}]
    uncovered = {
        (a, va, b, vb)
        for a, b in itertools.combinations(names, 2) for va in axes[a] for vb in axes[b]
    }
    chosen = []
    while uncovered:
        best, best_hits = None, -1
        for combo in itertools.product(*(axes[n] for n in names)):
            row = dict(zip(names, combo))
            hits = sum((a, row[a], b, row[b]) in uncovered
                       for a, b in itertools.combinations(names, 2))
            if hits > best_hits:
                best, best_hits = row, hits
        chosen.append(best)
        uncovered -= {(a, best[a], b, best[b]) for a, b in itertools.combinations(names, 2)}
    return chosen


def _covering(dtype_axes: dict[str, tuple],
              flag_axes: dict[str, tuple]) -> Iterator[dict[str, Any]]:
    """Every combination of the dtype axes (flags at their first value), then a pairwise
    covering of the flag axes (dtypes at their first value): every value of every axis, and
    every pair of flags, is launched at least once."""
    first_flags = {k: v[0] for k, v in flag_axes.items()}
    for combo in itertools.product(*dtype_axes.values()):
        yield {**dict(zip(dtype_axes, combo)), **first_flags}
    first_dtypes = {k: v[0] for k, v in dtype_axes.items()}
    for flags in _pairwise(flag_axes):
        yield {**first_dtypes, **flags}


def _powers_of_two(limit: int) -> list[int]:
    """Sizes 1, 2, 3, 5, 9, ... whose next power of two runs through every power up to limit."""
    sizes, p = [1], 1
    while p < limit:
        sizes.append(p + 1)
        p *= 2
    return sizes


def _flat_step_cases(op_name: str) -> Iterator[tuple]:
    import torch

    from memkern.kernels import _common

    grads = _common.GRAD_DTYPES
    n = 1027

    def scalar(v):
        return torch.full((1,), v, dtype=torch.float32)

    def buf(dtype):
        return torch.empty(n, dtype=dtype)

    if op_name == "adamw_step_":
        flags = {"multiplier": (True, False), "found_inf": (True, False), "beta1": (0.9, 0.3)}
        for c in _covering({"grads": grads, "params": (None, *grads)}, flags):
            yield (buf(torch.float32), buf(torch.float32), buf(torch.float32), buf(c["grads"]),
                   None if c["params"] is None else buf(c["params"]), scalar(0.0),
                   scalar(0.5) if c["multiplier"] else None,
                   scalar(0.0) if c["found_inf"] else None,
                   1e-3, c["beta1"], 0.999, 1e-8, 0.01)
    elif op_name == "adamw8bit_step_":
        from memkern.kernels.state8bit import num_blocks

        flags = {"multiplier": (True, False), "found_inf": (True, False), "beta1": (0.9, 0.3)}
        for c in _covering({"grads": grads, "params": (None, *grads)}, flags):
            yield (buf(torch.float32), buf(torch.int8), torch.empty(num_blocks(n)),
                   buf(torch.uint8), torch.empty(num_blocks(n)), buf(c["grads"]),
                   None if c["params"] is None else buf(c["params"]), scalar(0.0),
                   scalar(0.5) if c["multiplier"] else None,
                   scalar(0.0) if c["found_inf"] else None,
                   1e-3, c["beta1"], 0.999, 1e-8, 0.01)
    elif op_name == "sgd8bit_step_":
        from memkern.kernels.state8bit import num_blocks

        flags = {"weight_decay": (0.01, 0.0), "nesterov": (False, True),
                 "multiplier": (True, False), "found_inf": (True, False)}
        for c in _covering({"grads": grads, "params": (None, *grads)}, flags):
            yield (buf(torch.float32), buf(torch.int8), torch.empty(num_blocks(n)),
                   buf(c["grads"]), None if c["params"] is None else buf(c["params"]),
                   scalar(0.0), scalar(0.5) if c["multiplier"] else None,
                   scalar(0.0) if c["found_inf"] else None,
                   0.1, 0.9, 0.0, c["weight_decay"], c["nesterov"])
    else:
        flags = {"momentum": (0.9, 0.0), "weight_decay": (0.01, 0.0), "nesterov": (False, True),
                 "multiplier": (True, False), "found_inf": (True, False)}
        for c in _covering({"grads": grads, "params": (None, *grads)}, flags):
            if c["nesterov"] and c["momentum"] == 0.0:
                continue  # torch's rule, checked by the op: Nesterov needs momentum
            yield (buf(torch.float32), buf(torch.float32) if c["momentum"] else None,
                   buf(c["grads"]), None if c["params"] is None else buf(c["params"]),
                   scalar(0.0), scalar(0.5) if c["multiplier"] else None,
                   scalar(0.0) if c["found_inf"] else None,
                   0.1, c["momentum"], 0.0, c["weight_decay"], c["nesterov"])


def _unscale_cases() -> Iterator[tuple]:
    import torch

    from memkern.kernels import _common

    for dtype in _common.GRAD_DTYPES:
        yield torch.empty(1027, dtype=dtype), torch.zeros(1), torch.ones(1)


def _l2_norm_cases() -> Iterator[tuple]:
    import torch

    from memkern.kernels import _common

    for dtype in _common.GRAD_DTYPES:
        yield (torch.empty(1027, dtype=dtype),)


def _activation_cases(backward: bool) -> Iterator[tuple]:
    import torch

    from memkern.kernels import _nn_common
    from memkern.ops.activation import KINDS

    for dtype, kind in itertools.product(_nn_common.DTYPES, KINDS):
        x = torch.empty(37, 29, dtype=dtype)
        yield (torch.empty_like(x), x, kind) if backward else (x, kind)


def _swiglu_cases(backward: bool) -> Iterator[tuple]:
    import torch

    from memkern.kernels import _nn_common

    for dtype in _nn_common.DTYPES:
        a = torch.empty(37, 29, dtype=dtype)
        yield ((torch.empty_like(a), a, torch.empty_like(a)) if backward
               else (a, torch.empty_like(a)))


def _dropout_cases() -> Iterator[tuple]:
    import torch

    from memkern.kernels import _nn_common

    for dtype in _nn_common.DTYPES:
        yield torch.empty(37, 29, dtype=dtype), torch.zeros(1, dtype=torch.int64), 0.1


def _norm_cases(backward: bool) -> Iterator[tuple]:
    import torch

    from memkern.kernels import _nn_common
    from memkern.kernels.norm import MAX_D

    def case(x_dtype, w_dtype, has_bias, rms, D):
        x = torch.empty(13, D, dtype=x_dtype)
        w = None if w_dtype is None else torch.empty(D, dtype=w_dtype)
        if backward:
            mean = torch.empty(0 if rms else 13)
            return (torch.empty_like(x), x, w, mean, torch.empty(13), rms)
        b = torch.empty(D, dtype=w_dtype) if has_bias and w_dtype is not None else None
        return (x, w, b, 1e-5, rms)

    dtypes = _nn_common.DTYPES
    for c in _covering({"x": dtypes, "w": (*dtypes, None)},
                       {"rms": (False, True), "bias": (True, False)}):
        yield case(c["x"], c["w"], c["bias"], c["rms"], 129)
    for D in _powers_of_two(MAX_D):  # BLOCK_D = next_power_of_2(D), and num_warps with it
        yield case(dtypes[0], dtypes[0], True, False, D)


def _cross_entropy_cases() -> Iterator[tuple]:
    import torch

    from memkern.kernels import _nn_common
    from memkern.kernels.cross_entropy import MAX_BLOCK_V
    from memkern.ops.cross_entropy import ROW_ENTROPY, ROW_IS_TOP1, ROW_MEAN_LOGIT

    def case(dtype, V, scale, grad, softcap, outputs=0):
        return (torch.empty(7, V, dtype=dtype), torch.zeros(7, dtype=torch.int64),
                torch.empty(7) if scale else None, -100, 0.1, grad, softcap, outputs,
                torch.empty(3, 7) if outputs else None)

    every = ROW_ENTROPY | ROW_IS_TOP1 | ROW_MEAN_LOGIT
    # the per-row statistics: every mask of the three (each a constexpr), paired with the rest
    flags = {"outputs": tuple(range(every + 1)), "scale": (True, False), "grad": (True, False),
             "softcap": (0.0, 2.5)}
    for c in _covering({"dtype": _nn_common.DTYPES}, flags):
        yield case(c["dtype"], 1000, c["scale"], c["grad"], c["softcap"], c["outputs"])
    for dtype in _nn_common.DTYPES:  # all three statistics in every dtype
        yield case(dtype, 1000, False, True, 0.0, every)
    for V in _powers_of_two(MAX_BLOCK_V):  # BLOCK_V = min(next_power_of_2(V), MAX_BLOCK_V)
        yield case(_nn_common.DTYPES[0], V, True, True, 0.0)


def _cross_entropy_block_cases() -> Iterator[tuple]:
    import torch

    from memkern.kernels import _nn_common
    from memkern.kernels.cross_entropy import MAX_BLOCK_V

    def case(dtype, width, softcap, entropy=False):
        return (torch.empty(7, width, dtype=dtype), torch.empty(7),
                torch.zeros(7, dtype=torch.int64), torch.empty(1).expand(7), 3, width + 5, -100,
                0.1, softcap, torch.empty(7) if entropy else None,
                torch.empty(7) if entropy else None)

    for c in _covering({"dtype": _nn_common.DTYPES},
                       {"softcap": (0.0, 2.5), "entropy": (False, True)}):
        yield case(c["dtype"], 1000, c["softcap"], c["entropy"])
    for dtype in _nn_common.DTYPES:  # the entropy's term in every dtype
        yield case(dtype, 1000, 0.0, True)
    for width in _powers_of_two(MAX_BLOCK_V):  # BLOCK = min(next_power_of_2(width), MAX_BLOCK_V)
        yield case(_nn_common.DTYPES[0], width, 0.0)


CASES: dict[str, Callable[[], Iterator[tuple]]] = {
    "unscale_": _unscale_cases,
    "l2_norm": _l2_norm_cases,
    "adamw_step_": lambda: _flat_step_cases("adamw_step_"),
    "adamw8bit_step_": lambda: _flat_step_cases("adamw8bit_step_"),
    "sgd_step_": lambda: _flat_step_cases("sgd_step_"),
    "sgd8bit_step_": lambda: _flat_step_cases("sgd8bit_step_"),
    "act_forward": lambda: _activation_cases(backward=False),
    "act_backward": lambda: _activation_cases(backward=True),
    "swiglu_forward": lambda: _swiglu_cases(backward=False),
    "swiglu_backward": lambda: _swiglu_cases(backward=True),
    "dropout": _dropout_cases,
    "norm_forward": lambda: _norm_cases(backward=False),
    "norm_backward": lambda: _norm_cases(backward=True),
    "cross_entropy_rows_": _cross_entropy_cases,
    "cross_entropy_block_grad_": _cross_entropy_block_cases,
}
"""Argument cases per op name; every op with a Triton implementation must have an entry."""


# --------------------------------------------------------------------------------------------
# Recording launches and compiling them.


def _triton_type(value: Any) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return "*" + _POINTER_TYPES[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for a launch argument of type {type(value).__name__}")


def record_launches(op_names) -> list[dict[str, Any]]:
    """Run the Triton launchers of ``op_names`` over their cases; return each distinct launch
    as ``{"kernel", "fn", "signature", "constexprs", "options"}`` (nothing is executed)."""
    from triton.runtime.jit import JITFunction

    import memkern.ops as ops

    by_name = {op.name: op for op in (*ops.ALL, *ops.NN_OPS)}
    launches: dict[str, dict[str, Any]] = {}

    def record(self, *args, grid, warmup, **kwargs):
        names = [p.name for p in self.params]
        bound = dict(zip(names, args))
        options = {}
        for k, v in kwargs.items():
            (bound if k in names else options)[k] = v
        signature, constexprs = {}, {}
        for p in self.params:
            value = bound[p.name] if p.name in bound else p.default
            if p.is_constexpr or value is None:
                signature[p.name] = "constexpr"
                constexprs[p.name] = value
            else:
                signature[p.name] = _triton_type(value)
        name = f"{self.fn.__module__}.{self.fn.__name__}"
        key = json.dumps([name, signature, constexprs, options], sort_keys=True, default=str)
        launches.setdefault(key, {
            "kernel": name, "fn": self,
            "signature": signature, "constexprs": constexprs, "options": options,
        })

    original = JITFunction.run
    JITFunction.run = record
    try:
        for name in op_names:
            for args in CASES[name]():
                by_name[name].triton(*args)
    finally:
        JITFunction.run = original
    return list(launches.values())


def compile_for(launch: dict[str, Any], arch: int):
    """One recorded launch compiled for ``sm_<arch>``: Triton's compiled kernel (``.asm``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=launch["fn"], signature=launch["signature"], constexprs=launch["constexprs"])
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=launch["options"])


def compile_launch(launch: dict[str, Any], arch: int) -> str | None:
    """Compile one recorded launch for ``sm_<arch>``; the error text, or None on success."""
    try:
        compiled = compile_for(launch, arch)
    except Exception as e:  # noqa: BLE001 - any compiler error is the finding to report
        return f"{type(e).__name__}: {e}"
    if not compiled.asm.get("cubin"):
        return "no cubin produced"
    return None


def _jit_functions() -> dict[str, Any]:
    from triton.runtime.jit import JITFunction

    import memkern.kernels

    found = {}
    for info in pkgutil.iter_modules(memkern.kernels.__path__, "memkern.kernels."):
        module = importlib.import_module(info.name)
        for attr, value in vars(module).items():
            if isinstance(value, JITFunction) and value.fn.__module__ == module.__name__:
                found[f"{module.__name__}.{attr}"] = value
    return found


def _callees(fn) -> list:
    """The @triton.jit functions ``fn``'s source refers to (``name`` or ``module.name``)."""
    from triton.runtime.jit import JITFunction

    out = []
    for name in fn.fn.__code__.co_names:
        value = fn.fn.__globals__.get(name)
        if isinstance(value, JITFunction):
            out.append(value)
        elif isinstance(value, types.ModuleType):
            out += [v for n in fn.fn.__code__.co_names
                    if isinstance(v := getattr(value, n, None), JITFunction)]
    return out


def uncovered_kernels(launches: list[dict[str, Any]]) -> list[str]:
    """The ``@triton.jit`` functions of memkern.kernels that no recorded launch compiles."""
    reached, todo = set(), [launch["fn"] for launch in launches]
    while todo:
        fn = todo.pop()
        if id(fn) not in reached:
            reached.add(id(fn))
            todo += _callees(fn)
    return sorted(name for name, fn in _jit_functions().items() if id(fn) not in reached)


def bf16_store_ir() -> str:
    """The TTIR of ``unscale_``'s kernel on bfloat16 gradients, compiled for sm_90: the code
    path of :func:`memkern.kernels._common.round_to`'s hand rounding as the GPU runs it."""
    launch = next(launch for launch in record_launches(["unscale_"])
                  if launch["signature"]["grads_ptr"] == "*bf16")
    return compile_for(launch, 90).asm["ttir"]


def main(argv: list[str]) -> int:
    """``triton_aot.py --coverage``, ``--bf16-store-ir`` or ``OP [OP ...]``: JSON on stdout."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("triton_aot.py: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="memkern-aot-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        return _main(argv)


def _main(argv: list[str]) -> int:
    if argv == ["--coverage"]:
        launches = record_launches(CASES)
        print(json.dumps({"uncovered": uncovered_kernels(launches),
                          "launches": len(launches)}))
        return 0
    if argv == ["--bf16-store-ir"]:
        print(json.dumps({"ttir": bf16_store_ir()}))
        return 0
    results = []
    for launch in record_launches(argv):
        for arch in ARCHS:
            results.append({
                "kernel": launch["kernel"], "arch": arch, "signature": launch["signature"],
                "constexprs": launch["constexprs"], "error": compile_launch(launch, arch),
            })
    print(json.dumps(results, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
