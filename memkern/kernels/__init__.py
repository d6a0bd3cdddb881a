"""Triton kernels of memkern's ops (the ``triton`` backend).

One module per op family, each exposing a launcher that takes the op's positional arguments
exactly as in its schema (see :mod:`memkern.ops`); ``_common`` holds what they share (dtype
checks, fp32 -> bf16/fp16 rounding, the step-counter kernel). Importing a module imports
``triton``; :mod:`memkern.ops` does that lazily, only when the Triton backend is used.

The math each launcher computes is defined by the ``reference()`` of the matching op in
:mod:`memkern.ops`; on a machine without a GPU the kernels run on CPU tensors under
``TRITON_INTERPRET=1`` (which must be set before ``triton`` is first imported).

Interpreter and compiled code. The interpreter runs the kernels with numpy, so CI also
compiles every kernel for sm_80/sm_90 (tests/test_triton_aot.py): compiled code is what runs
on a GPU. Where the two differ, and what the kernels do about it:

- Globals read in ``@triton.jit`` code must be ``tl.constexpr``; the interpreter accepts plain
  Python values, compiled Triton rejects them (caught by the AOT test).
- float32 -> bfloat16: the interpreter truncates, the GPU rounds to nearest even. ``round_to``
  rounds by hand with integer operations, whose compiled form (logical shifts, unordered NaN
  compare) the AOT test checks, so both give torch's result.
- Scalar comparisons combined with block masks: the interpreter keeps a float32 dtype on a
  splatted comparison, so ``load_splat`` compares blocks (a no-op once compiled).
- Loop indices of ``range`` are Python ints when interpreted: the norm backward lifts them to
  int64 explicitly (compiled, they are int32 and the lift is one extension).
- ``tl.exp``, ``tl.sqrt`` and ``/`` are exact in the interpreter and approximate (a few ulp)
  when compiled, and compiled code contracts ``a * b + c`` into FMAs (Triton's default
  ``enable_fp_fusion``): where results must match torch to the last bit (the optimizer steps)
  the kernels use ``tl.sqrt_rn`` / ``tl.div_rn``; elsewhere the tests' tolerances cover it.
"""
