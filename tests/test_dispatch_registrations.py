"""Where each memkern op's kernels for CUDA tensors are registered: in a build with the CUDA
kernels, by C++ only (docs/gpu.md: on a GPU the default eager path never enters Python).

Read from the dispatcher's own registration table (``torch._C._dispatch_dump``), which names
the file that registered each kernel: a C++ ``TORCH_LIBRARY_IMPL`` block names its source file,
a ``torch.library`` registration the Python file. A kernel registered from Python for a
dispatch key that serves CUDA tensors puts a Python call between a layer call and its launch,
forward and backward (tens of microseconds of host time each).

Runs without a GPU: a CUDA build of the extension imports and registers its kernels on a
machine without one (CI builds one for this test: .ci/run). Skipped against a build without the
CUDA kernels, where the Python registry deliberately serves the CUDA key with Triton; set
``MEMKERN_REQUIRE_EXT=cuda`` to make a missing CUDA build an import error instead.
"""
from __future__ import annotations

import re

import pytest
import torch

import memkern
from memkern._extension import compiled

pytestmark = pytest.mark.skipif(not compiled.has_cuda,
                                reason="memkern._C was built without its CUDA kernels")

# The dispatch keys whose kernel can run for a CUDA tensor outside fake/meta tracing: the CUDA
# backend key, the autograd keys in front of it, and the composite keys that stand in for a
# missing backend kernel. (Meta holds the fake implementation, registered from Python by
# design: it runs only under torch.compile / FakeTensor tracing.)
CUDA_PATH_KEYS = ("CUDA", "AutogradCUDA", "Autograd", "ADInplaceOrView",
                  "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional",
                  "CompositeImplicitAutograd")
# The keys of which one must exist for the op to run on CUDA tensors at all.
CUDA_KERNEL_KEYS = ("CUDA", "CompositeExplicitAutograd", "CompositeImplicitAutograd")

# "<key>: registered at <file>:<line> :: <signature>"; alias keys read "<key>[alias]: ...".
_LINE = re.compile(r"^(?P<key>\w+)(\[alias\])?: registered at (?P<where>\S+?)(:\d+)? ")


def memkern_ops() -> list[str]:
    """Every op of the memkern namespace the dispatcher knows (importing memkern defines them
    all). torch has no public listing of a namespace's ops; this private call is used here
    only, by a test that must see ops no Python list names."""
    memkern.ops  # noqa: B018 (imported for its definitions)
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("memkern::"))


def registrations(op: str) -> dict[str, str]:
    """dispatch key -> the file that registered its kernel, from the dispatcher's table."""
    found = {}
    for line in torch._C._dispatch_dump(op).splitlines():
        match = _LINE.match(line)
        if match and match["key"] != "debug":
            found[match["key"]] = match["where"]
    return found


def test_the_namespace_is_populated():
    """The listing is not vacuous: the ops of memkern.ops are all in it."""
    listed = set(memkern_ops())
    assert {f"memkern::{op.name}" for op in memkern.ops.NN_OPS + memkern.ops.ALL} <= listed


def test_no_cuda_kernel_is_registered_from_python():
    problems = []
    for op in memkern_ops():
        where = registrations(op)
        python = {key: where[key] for key in CUDA_PATH_KEYS
                  if key in where and where[key].endswith(".py")}
        if python:
            problems.append(f"{op}: " + ", ".join(f"{k} registered at {v}"
                                                  for k, v in python.items()))
        elif not any(key in where for key in CUDA_KERNEL_KEYS):
            problems.append(f"{op}: no kernel for CUDA tensors (keys: {sorted(where)})")
    assert not problems, ("memkern ops whose CUDA path runs Python (register their CUDA "
                          "kernels in C++, TORCH_LIBRARY_IMPL(memkern, CUDA, m)):\n  "
                          + "\n  ".join(problems))
