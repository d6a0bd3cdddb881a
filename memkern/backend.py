"""Which implementation of a memkern op runs on a given device.

Every op has up to four implementations computing the same function:

============  ==============================  ==========================================
backend       where it runs                   present (:func:`backends`) when
============  ==============================  ==========================================
reference     anywhere (plain torch ops)      always
cpu           CPU (``csrc/cpu``)              the C++ extension was built
cuda          NVIDIA GPU (``csrc/cuda``)      the extension was built with CUDA kernels
                                              and a CUDA GPU is visible
triton        NVIDIA GPU; CPU when            ``triton`` is importable and a CUDA GPU
              ``TRITON_INTERPRET=1``          is visible, or ``TRITON_INTERPRET=1``
                                              (interpreted on the CPU: the tests)
============  ==============================  ==========================================

By default a CUDA tensor goes to cuda → triton → reference and a CPU tensor to cpu →
reference, taking the first one present. ``MEMKERN_BACKEND=<name>`` (or the :func:`force`
context manager) asks for one; when it cannot run on the tensor's device the default order
is used instead and a warning says so once.

While :mod:`memkern.profile` plans a training step for a device (:func:`planning_for`), fake
CPU tensors stand in for that device's: :func:`select` then names the planned device's
choice, and memkern's device-dependent algorithms read the device type from
:func:`device_type`.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import warnings
from collections.abc import Iterator

import torch

from memkern._extension import compiled

NAMES = ("cuda", "triton", "cpu", "reference")
ENV_VAR = "MEMKERN_BACKEND"
_DEFAULT_ORDER = {"cuda": ("cuda", "triton", "reference"), "cpu": ("cpu", "reference")}
_forced: list[str] = []
_planned: list[str] = []

# os.environ.get encodes the key and decodes the value on every call (about 1 µs), and the
# backend is looked up on every op and layer call. On POSIX, os.environ keeps its variables
# in a bytes-keyed mapping that it updates with every assignment, so a read of that mapping
# sees what os.environ.get would, in a tenth of the time. It is a CPython detail, read here
# only, with os.environ.get as the fallback where it is absent.
_ENV_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None
if not isinstance(_ENV_BYTES, dict):
    _ENV_BYTES = None
_ENV_VAR_KEY, _INTERPRET_KEY = os.fsencode(ENV_VAR), b"TRITON_INTERPRET"


def _environ(key: bytes) -> bytes | None:
    """The raw value of environment variable ``key``, or None."""
    if _ENV_BYTES is not None:
        return _ENV_BYTES.get(key)
    value = os.environ.get(os.fsdecode(key))
    return None if value is None else os.fsencode(value)


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_interpreted() -> bool:
    return _environ(_INTERPRET_KEY) == b"1"


def backends() -> dict[str, bool]:
    """Which backends can run in this process (on some device). Triton installed on a machine
    without a CUDA GPU counts only under ``TRITON_INTERPRET=1``, where it runs interpreted on
    the CPU (for tests; far slower than the ``cpu`` backend)."""
    cuda_ok = torch.cuda.is_available()
    return {
        "reference": True,
        "cpu": compiled.has_cpu,
        "cuda": compiled.has_cuda and cuda_ok,
        "triton": _triton_importable() and (cuda_ok or _triton_interpreted()),
    }


def runs_on(backend: str, device: torch.device) -> bool:
    """Whether ``backend`` can run an op on tensors of ``device``."""
    if backend == "reference":
        return True
    if backend == "cpu":
        return compiled.has_cpu and device.type == "cpu"
    if backend == "cuda":
        return compiled.has_cuda and device.type == "cuda"
    if backend == "triton":
        return _triton_importable() and (
            device.type == "cuda" or (device.type == "cpu" and _triton_interpreted())
        )
    raise ValueError(f"unknown memkern backend {backend!r}; expected one of {NAMES}")


def requested() -> str | None:
    """The backend asked for by :func:`force` or ``MEMKERN_BACKEND``, if any."""
    if _forced:
        return _forced[-1]
    raw = _environ(_ENV_VAR_KEY)
    return None if raw is None else _parse_requested(raw)


@functools.cache
def _parse_requested(raw: bytes) -> str | None:
    name = os.fsdecode(raw).strip().lower()
    if not name:
        return None
    if name not in NAMES:
        raise ValueError(f"{ENV_VAR}={name!r} is not a memkern backend; use one of {NAMES}")
    return name


@functools.cache
def _warn_unusable(name: str, device_type: str, chosen: str) -> None:
    warnings.warn(
        f"memkern: backend {name!r} cannot run on {device_type} tensors here; using {chosen!r}",
        RuntimeWarning,
        stacklevel=4,
    )


def select(device: torch.device) -> str:
    """The backend that runs an op whose tensors live on ``device``; while planning
    (:func:`planning_for`), ``"planned:<device type>"``: the planned device's implementation
    (:class:`memkern.ops._registry.Op` knows which it is)."""
    if _planned:
        return "planned:" + _planned[-1]
    # Called on every op call: only the inputs of the choice are read here (two environment
    # lookups), the choice itself is computed once per distinct input.
    forced = _forced[-1] if _forced else None
    return _select(device.type, forced, _environ(_ENV_VAR_KEY), _environ(_INTERPRET_KEY))


@functools.cache
def _select(device_type: str, forced: str | None, env_value: bytes | None,
            interpret: bytes | None) -> str:
    device = torch.device(device_type)
    wanted = requested()
    if wanted is not None and runs_on(wanted, device):
        return wanted
    order = _DEFAULT_ORDER.get(device_type, ("reference",))
    chosen = next(b for b in order if runs_on(b, device))
    if wanted is not None:
        _warn_unusable(wanted, device_type, chosen)
    return chosen


@contextlib.contextmanager
def force(name: str) -> Iterator[None]:
    """Run memkern ops on backend ``name`` inside the block (tests, benchmarks)."""
    if name not in NAMES:
        raise ValueError(f"force(name={name!r}): expected one of {NAMES}")
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()


def planned() -> str | None:
    """The device type a training step is being planned for (:func:`planning_for`), or None."""
    return _planned[-1] if _planned else None


def device_type(device: torch.device) -> str:
    """The device type memkern's algorithm choices (chunk sizes, code paths) follow for tensors
    on ``device``: its own, or the planned device's while planning."""
    return _planned[-1] if _planned else device.type


@contextlib.contextmanager
def planning_for(device_type: str) -> Iterator[None]:
    """Inside the block, memkern runs as on a ``device_type`` device ("cuda" or "cpu") though
    its tensors are fake CPU tensors (:mod:`memkern.profile.plan`, which measures what the step
    would allocate there)."""
    if device_type not in _DEFAULT_ORDER:
        raise ValueError(f"planning_for(device_type={device_type!r}): expected one of "
                         f"{tuple(_DEFAULT_ORDER)}")
    _planned.append(device_type)
    try:
        yield
    finally:
        _planned.pop()
