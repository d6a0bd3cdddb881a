"""Triton kernels of memkern's ops (the ``triton`` backend).

One module per op family, each exposing a launcher that takes the op's positional arguments
exactly as in its schema (see :mod:`memkern.ops`); ``_common`` holds what they share (dtype
checks, fp32 -> bf16/fp16 rounding, the step-counter kernel). Importing a module imports
``triton``; :mod:`memkern.ops` does that lazily, only when the Triton backend is used.

The math each launcher computes is defined by the ``reference()`` of the matching op in
:mod:`memkern.ops`; on a machine without a GPU the kernels run on CPU tensors under
``TRITON_INTERPRET=1`` (which must be set before ``triton`` is first imported).
"""
