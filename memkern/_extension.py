"""Loads the compiled extension ``memkern._C`` once, and says so once when it is missing.

Everything that asks "was the C++/CUDA code built?" reads :data:`compiled` from here.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import warnings


@dataclasses.dataclass(frozen=True)
class CompiledInfo:
    has_cpu: bool
    """The C++ CPU kernels are registered for the ``CPU`` dispatch key."""
    has_cuda: bool
    """The CUDA C++ kernels are registered for the ``CUDA`` dispatch key."""
    has_openmp: bool
    """The C++ CPU kernels run on torch's intra-op threads (built with OpenMP); without it
    they run on one thread."""
    cuda_archs: str
    """The ``TORCH_CUDA_ARCH_LIST`` the CUDA kernels were compiled for ('' without CUDA)."""
    missing_reason: str
    """Why the extension is absent ('' when it loaded)."""


def _load() -> CompiledInfo:
    if os.environ.get("MEMKERN_DISABLE_EXT", "0") == "1":
        return CompiledInfo(False, False, False, "", "disabled by MEMKERN_DISABLE_EXT=1")
    if importlib.util.find_spec("memkern._C") is None:
        return CompiledInfo(False, False, False, "", "memkern._C was not built (no C++ "
                            "compiler at install time, or MEMKERN_BUILD_EXT=0)")
    try:
        from memkern import _C  # registers the C++ kernels with the dispatcher
    except ImportError as exc:
        return CompiledInfo(False, False, False, "", f"memkern._C could not be loaded ({exc})")
    return CompiledInfo(True, bool(_C.has_cuda()), bool(_C.has_openmp()), _C.cuda_archs(), "")


def _require(info: CompiledInfo) -> None:
    """``MEMKERN_REQUIRE_EXT=1`` (CI): a missing extension is an error, not a fallback, so a
    build that silently skipped the C++ code cannot pass the tests on the reference alone;
    ``=cuda`` also requires the CUDA kernels."""
    required = os.environ.get("MEMKERN_REQUIRE_EXT", "0").strip().lower()
    if required in ("", "0"):
        return
    if required not in ("1", "cuda"):
        raise ValueError(f"MEMKERN_REQUIRE_EXT={required!r}: use 0, 1 or cuda")
    if not info.has_cpu:
        raise ImportError(f"memkern: MEMKERN_REQUIRE_EXT={required} but the compiled extension "
                          f"is not available: {info.missing_reason}. Build it (pip install "
                          "--no-build-isolation -e . with a C++ compiler), or unset the variable.")
    if required == "cuda" and not info.has_cuda:
        raise ImportError("memkern: MEMKERN_REQUIRE_EXT=cuda but memkern._C was built without "
                          "its CUDA kernels. Rebuild with MEMKERN_BUILD_CUDA=1 and a CUDA "
                          "toolkit matching torch, or set MEMKERN_REQUIRE_EXT=1.")


compiled = _load()
_require(compiled)
if not compiled.has_cpu:
    warnings.warn(
        f"memkern: the compiled extension is not available: {compiled.missing_reason}. "
        "Running on the reference (plain torch) and Triton backends; reinstall with a C++ "
        "compiler present to get the C++/CUDA kernels.",
        RuntimeWarning,
        stacklevel=2,
    )


_REBUILD = ("the extension was built from other sources; rebuild it (pip install "
            "--no-build-isolation -e .)")


def check_same_in_cpp(module: str, ours: dict[str, object]) -> None:
    """Raise ImportError unless each constant of ``ours`` (its ``memkern._C`` name: the value
    ``module`` uses) is what the extension exports (csrc/constants.cpp): an extension built from
    other sources would compute otherwise. Nothing to check without the extension."""
    if not compiled.has_cpu:
        return
    from memkern import _C

    for name, value in ours.items():
        theirs = getattr(_C, name, None)
        if theirs != value:
            raise ImportError(f"memkern._C.{name} is {theirs!r} but {module} uses {value!r}: "
                              f"{_REBUILD}")
