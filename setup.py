"""Builds memkern._C: the C++ CPU kernels always, the CUDA kernels when they can be built.

Environment switches
    MEMKERN_BUILD_EXT=0        build no extension at all (memkern then runs on the reference
                               and Triton backends and says so at import)
    MEMKERN_BUILD_CUDA=auto    (default) compile the CUDA kernels when torch was built with
                               CUDA and a toolkit of the same major version is found, with
                               its headers (CUDA_HOME/include/cuda_runtime.h);
                       =1      require them (fail if impossible);  =0  never
    TORCH_CUDA_ARCH_LIST       GPU architectures (default "8.0;9.0": A100 and H100/H200)
    MAX_JOBS                   parallel compile jobs (ninja)
    MEMKERN_WERROR=1           treat compiler warnings in memkern's C++ and CUDA code as
                               errors (CI)

Install with ``pip install --no-build-isolation .`` so the build uses the torch already
installed rather than downloading another one into an isolated build environment.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
OBJECTS_DIR = os.path.join(ROOT, "build", "ext")
"""Where the compiled objects stay between builds (see ``build_ext_keeping_objects``)."""
CXX_FLAGS = ["-O3", "-fno-math-errno", "-Wall", "-Wno-unknown-pragmas"]
NVCC_FLAGS = ["-O3", "-std=c++17", "-lineinfo"]


def say(message: str) -> None:
    print(f"memkern setup: {message}", file=sys.stderr)


def sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def have_cxx_compiler() -> bool:
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def openmp_flags() -> list[str]:
    """-fopenmp when torch runs its CPU threads on OpenMP: ATen's at::parallel_for is a header
    template that runs serially unless the code calling it is compiled with OpenMP, so without
    the flag every memkern CPU kernel would use one thread whatever torch.set_num_threads says.
    Compile-only: the OpenMP symbols resolve to the runtime libtorch_cpu already loads (linking
    our own could load a second runtime, whose thread count torch would not control)."""
    import torch

    return ["-fopenmp"] if torch.backends.openmp.is_available() else []


def toolkit_major(cuda_home: str) -> int | None:
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    match = re.search(r"release (\d+)\.", out)
    return int(match.group(1)) if match else None


def want_cuda() -> bool:
    mode = os.environ.get("MEMKERN_BUILD_CUDA", "auto").lower()
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"MEMKERN_BUILD_CUDA={mode!r}: use auto, 0 or 1")
    if mode == "0":
        return False
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    reason = None
    if torch.version.cuda is None:
        reason = f"torch {torch.__version__} was built without CUDA"
    elif CUDA_HOME is None:
        reason = "no CUDA toolkit found (set CUDA_HOME)"
    elif not os.path.isfile(os.path.join(CUDA_HOME, "include", "cuda_runtime.h")):
        # torch takes the folder above the nvcc on the PATH, which may be a wrapper's
        reason = (f"{CUDA_HOME}/include has no cuda_runtime.h (set CUDA_HOME to the toolkit's "
                  "folder: the one holding bin/nvcc and include/cuda_runtime.h)")
    else:
        major = toolkit_major(CUDA_HOME)
        torch_major = int(torch.version.cuda.split(".")[0])
        if major != torch_major:
            reason = (f"the toolkit in {CUDA_HOME} is CUDA {major}, torch was built with "
                      f"CUDA {torch.version.cuda}")
    if reason is None:
        return True
    if mode == "1":
        raise SystemExit(f"MEMKERN_BUILD_CUDA=1 but the CUDA kernels cannot be built: {reason}")
    say(f"building without CUDA kernels: {reason}")
    return False


def build_ext_keeping_objects():
    """torch's ninja build_ext, with its objects in ``OBJECTS_DIR`` rather than a temporary
    folder. pip's installs (editable or not) give every build a new temporary folder, so each
    ``pip install`` recompiled every source (about 8 minutes on 2 cores), e.g. the test
    install right after the first one. Kept objects let ninja recompile only what changed: it
    compares each object with its source, the headers that source included and the command
    line that built it (so a change of torch, flags or CUDA choice rebuilds what it affects).
    A fresh clone has no ``build/`` and compiles everything."""
    from torch.utils.cpp_extension import BuildExtension

    class BuildExtKeepingObjects(BuildExtension.with_options(use_ninja=True)):
        def finalize_options(self) -> None:
            super().finalize_options()
            self.build_temp = OBJECTS_DIR

    return BuildExtKeepingObjects


def extensions() -> tuple[list, dict]:
    if os.environ.get("MEMKERN_BUILD_EXT", "1") == "0":
        say("MEMKERN_BUILD_EXT=0: no compiled extension (reference/Triton backends only)")
        return [], {}
    if not have_cxx_compiler():
        say("no C++ compiler found: no compiled extension (reference/Triton backends only)")
        return [], {}
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    cxx_flags = CXX_FLAGS + openmp_flags()
    nvcc_flags = list(NVCC_FLAGS)
    if os.environ.get("MEMKERN_WERROR", "0") == "1":
        cxx_flags.append("-Werror")
        nvcc_flags += ["-Werror=all-warnings", "-Xcompiler=-Werror"]
    cpp_sources = (sources("csrc/*.cpp") + sources("csrc/cpu/*.cpp")
                   + sources("csrc/any_device/*.cpp") + sources("csrc/autograd/*.cpp"))
    if want_cuda():
        archs = os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        defines = ["-DMEMKERN_WITH_CUDA", f'-DMEMKERN_CUDA_ARCHS="{archs}"']
        ext = CUDAExtension(
            "memkern._C",
            cpp_sources + sources("csrc/cuda/*.cpp") + sources("csrc/cuda/*.cu"),
            extra_compile_args={"cxx": cxx_flags + defines, "nvcc": nvcc_flags + defines},
        )
        say(f"building the C++ CPU and CUDA kernels (TORCH_CUDA_ARCH_LIST={archs})")
    else:
        ext = CppExtension("memkern._C", cpp_sources, extra_compile_args={"cxx": cxx_flags})
        say("building the C++ CPU kernels")
    if "-fopenmp" not in cxx_flags:
        say("torch does not use OpenMP: the C++ CPU kernels will run on one thread")
    return [ext], {"build_ext": build_ext_keeping_objects()}


ext_modules, cmdclass = extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
