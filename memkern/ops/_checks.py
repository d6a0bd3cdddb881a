"""Argument checks shared by the flat-buffer ops: each error names the argument and the fix."""
from __future__ import annotations

from typing import Any

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# float64 is accepted so that the reference implementation can serve as a float64 oracle.
ORACLE_DTYPES = FLOAT_DTYPES + (torch.float64,)


def flat(
    op: str,
    name: str,
    t: torch.Tensor,
    dtypes: tuple[torch.dtype, ...],
    like: torch.Tensor | None = None,
) -> None:
    """``t`` is a contiguous 1-D tensor of one of ``dtypes`` (same numel/device as ``like``)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"memkern.{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(
            f"memkern.{op}: {name} must be a contiguous 1-D flat buffer, got shape "
            f"{tuple(t.shape)} (contiguous={t.is_contiguous()}); pass a flat view, e.g. t.view(-1)"
        )
    if t.dtype not in dtypes:
        raise TypeError(f"memkern.{op}: {name} has dtype {t.dtype}; expected one of {dtypes}")
    if like is not None:
        if t.numel() != like.numel():
            raise ValueError(
                f"memkern.{op}: {name} has {t.numel()} elements but the buffers it goes with "
                f"have {like.numel()}; all flat buffers of one call must be the same length"
            )
        if t.device != like.device:
            raise ValueError(
                f"memkern.{op}: {name} is on {t.device} but the other buffers are on "
                f"{like.device}; move them to one device"
            )


def scalar(op: str, name: str, t: torch.Tensor | None, like: torch.Tensor) -> None:
    """``t`` (if given) is a one-element float32 tensor on the buffers' device."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.dtype != torch.float32:
        raise ValueError(
            f"memkern.{op}: {name} must be a one-element float32 tensor on {like.device}, got "
            + (f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else repr(t))
        )
    if t.device != like.device:
        raise ValueError(
            f"memkern.{op}: {name} is on {t.device}, the buffers on {like.device}; keep it on "
            "the buffers' device (reading it from elsewhere would force a host sync)"
        )


def step_inputs(op: str, master: torch.Tensor, grads: torch.Tensor, params: torch.Tensor | None,
                step: torch.Tensor, grad_multiplier: torch.Tensor | None,
                found_inf: torch.Tensor | None) -> None:
    """What every optimizer step takes besides master and its state: gradients and the
    optional parameter copy of master's length, and the three one-element scalars."""
    flat(op, "grads", grads, ORACLE_DTYPES, like=master)
    if params is not None:
        flat(op, "params", params, ORACLE_DTYPES, like=master)
    scalar(op, "step", step, master)
    scalar(op, "grad_multiplier", grad_multiplier, master)
    scalar(op, "found_inf", found_inf, master)


def keep_where_found_inf(found_inf: torch.Tensor | None, old: torch.Tensor,
                         new: torch.Tensor) -> torch.Tensor:
    """``new``, or ``old`` unchanged when ``found_inf`` is set (no host sync)."""
    if found_inf is None:
        return new
    return torch.where(found_inf.reshape(()) != 0, old, new)


def commit_step_(found_inf: torch.Tensor | None, updates: list[tuple[torch.Tensor, torch.Tensor]],
                 master: torch.Tensor, params: torch.Tensor | None, step: torch.Tensor) -> None:
    """Ends a reference optimizer step: each ``(buffer, new value)`` is written, then the
    parameter copy rounded from ``master`` and the step counter; all left as they were when
    ``found_inf`` is set (no host sync)."""
    for buffer, new in updates:
        buffer.copy_(keep_where_found_inf(found_inf, buffer, new))
    if params is not None:
        params.copy_(keep_where_found_inf(found_inf, params, master.to(params.dtype)))
    advance_step_(step, found_inf)


def advance_step_(step: torch.Tensor, found_inf: torch.Tensor | None) -> None:
    """``step += 1`` unless ``found_inf`` is set (no host sync)."""
    if found_inf is None:
        step.add_(1)
    else:
        step.add_((found_inf.reshape(()) == 0).to(step.dtype))


def tensor(op: str, name: str, t: Any, dtypes: tuple[torch.dtype, ...] = ORACLE_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"memkern.ops.{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(
            f"memkern.ops.{op}: {name} has dtype {t.dtype}; expected one of "
            f"{', '.join(str(d) for d in dtypes)} (cast it with .to(...))"
        )
    if not t.is_contiguous():
        raise ValueError(
            f"memkern.ops.{op}: {name} must be contiguous (shape {tuple(t.shape)}, strides "
            f"{t.stride()}); pass {name}.contiguous()"
        )


def same_device(op: str, name: str, t: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    if t.device != like.device:
        raise ValueError(
            f"memkern.ops.{op}: {name} is on {t.device} but {like_name} is on {like.device}; "
            "move them to one device"
        )


def same_shape(op: str, name: str, t: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    if t.shape != like.shape:
        raise ValueError(
            f"memkern.ops.{op}: {name} has shape {tuple(t.shape)} but {like_name} has "
            f"{tuple(like.shape)}; they must match"
        )


def same_dtype(op: str, name: str, t: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    if t.dtype != like.dtype:
        raise TypeError(
            f"memkern.ops.{op}: {name} has dtype {t.dtype} but {like_name} has {like.dtype}; "
            "they must match"
        )


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the math runs in: float32 for 16-bit inputs, the input's own otherwise."""
    return torch.promote_types(dtype, torch.float32)
