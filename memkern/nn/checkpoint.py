"""``memkern.checkpoint(module, policy)``: what a whole module keeps for backward.

=============  ==================================================================================
policy         what is kept between forward and backward
=============  ==================================================================================
"full"         the module's inputs only; the whole forward runs again in backward
               (``torch.utils.checkpoint``, non-reentrant)
"selective"    the inputs and the outputs of the matmul-class ops (GEMMs, attention kernels, the
               fused linear cross-entropy); the cheap elementwise/normalisation ops between them
               run again in backward (torch's selective activation checkpointing)
"offload"      everything the module saves, but moved to pinned CPU memory on a side stream as it
               is saved, and copied back on a side stream ahead of use: when the backward reaches
               a module, its saved tensors and those of the module before it (in forward order)
               are prefetched. CUDA tensors only: on the CPU it degrades to "full" with a warning.
"full-host"    as "full", but the kept input (the first positional argument, one tensor) waits in
               host memory: copied there while the next block runs its forward, brought back
               when the next block's backward starts (one block ahead), so the device holds at
               most two blocks' inputs (:mod:`memkern.nn.input_offload`). Runs the same steps
               on the CPU, with plain copies.
=============  ==================================================================================

The module is changed in place (its ``forward`` is wrapped) and returned; calling
``checkpoint`` again replaces the policy, ``policy=None`` removes it. Parameters, names,
``state_dict`` and hooks are untouched. Random ops (dropout) see the same random numbers when
recomputed (the RNG state is replayed).
"""
from __future__ import annotations

import contextlib
import functools
import threading
import warnings
import weakref
from typing import Any

import torch
import torch.utils._python_dispatch
import torch.utils.checkpoint as tcp
from torch import nn
from torch.utils._pytree import tree_leaves

from memkern._copies import dense, side_stream
from memkern._saved_notes import is_parameter, note_saved, reporting
from memkern.nn import input_offload

POLICIES = ("full", "selective", "offload", input_offload.POLICY)

_SAVE_OP_NAMES = (
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward", "_efficient_attention_forward",
)
_SAVE_OPS = {getattr(torch.ops.aten, n).default for n in _SAVE_OP_NAMES
             if hasattr(torch.ops.aten, n)}


def _save_ops() -> set:
    ops = set(_SAVE_OPS)
    lce = getattr(torch.ops.memkern, "linear_cross_entropy_forward", None)
    if lce is not None:
        ops.add(lce.default)
    return ops


def _selective_policy(ctx, func, *args, **kwargs):
    if func in _save_ops():
        return tcp.CheckpointPolicy.MUST_SAVE
    return tcp.CheckpointPolicy.PREFER_RECOMPUTE


class _NoteSavedOutputs(torch.utils._python_dispatch.TorchDispatchMode):
    """Reports the outputs the selective policy keeps to :mod:`memkern.profile` recorders
    (entered only while one listens: they cannot see what checkpoint stores for itself)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _save_ops():
            note_saved(*(t for t in tree_leaves(out) if isinstance(t, torch.Tensor)))
        return out


def _selective_contexts():
    forward_ctx, recompute_ctx = tcp.create_selective_checkpoint_contexts(_selective_policy)
    if not reporting():
        return forward_ctx, recompute_ctx
    stack = contextlib.ExitStack()

    class _Both:
        def __enter__(self):
            stack.enter_context(forward_ctx)
            stack.enter_context(_NoteSavedOutputs())

        def __exit__(self, *exc):
            return stack.__exit__(*exc)

    return _Both(), recompute_ctx


# ----------------------------------------------------------------------------------------------
# offload


class _Packed:
    """One saved tensor living in pinned host memory."""

    __slots__ = ("host", "device", "stored", "gpu", "loaded")

    def __init__(self, host, device, stored):
        self.host, self.device, self.stored = host, device, stored
        self.gpu = None
        self.loaded = None


_local = threading.local()


class _OffloadCall:
    """The tensors one forward call of an offloaded module saved, and the call before it."""

    def __init__(self, min_bytes: int) -> None:
        self.min_bytes = min_bytes
        self.packed: list[_Packed] = []
        previous = getattr(_local, "last_call", None)
        self.previous = previous  # a weakref (or None)
        _local.last_call = weakref.ref(self)

    def pack(self, t: torch.Tensor):
        if (not t.is_cuda or is_parameter(t)
                or t.numel() * t.element_size() < self.min_bytes):
            return t
        stream = side_stream(t.device)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            if dense(t):  # same strides on the host, so the restored tensor is t's twin
                host = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu",
                                           pin_memory=True)
            else:  # overlapping / gapped views (e.g. expanded): copied densely
                host = torch.empty(t.size(), dtype=t.dtype, device="cpu", pin_memory=True)
            host.copy_(t, non_blocking=True)
            stored = torch.cuda.Event()
            stored.record(stream)
        t.record_stream(stream)  # keep t's memory until the copy has read it
        p = _Packed(host, t.device, stored)
        self.packed.append(p)
        return p

    @staticmethod
    def fetch(p: _Packed) -> None:
        if p.gpu is not None:
            return
        stream = side_stream(p.device)
        with torch.cuda.stream(stream):
            stream.wait_event(p.stored)
            p.gpu = p.host.to(p.device, non_blocking=True)
            p.loaded = torch.cuda.Event()
            p.loaded.record(stream)

    def prefetch(self) -> None:
        for p in self.packed:
            self.fetch(p)
        prev = self.previous() if self.previous is not None else None
        if prev is not None:
            for p in prev.packed:
                self.fetch(p)

    def unpack(self, p):
        if not isinstance(p, _Packed):
            return p
        self.fetch(p)
        current = torch.cuda.current_stream(p.device)
        current.wait_event(p.loaded)
        gpu, p.gpu = p.gpu, None  # from here on only the backward node holds the device copy
        gpu.record_stream(current)
        return gpu  # (the pinned host copy stays with p: a retained graph can fetch it again)


def _offload_forward(owner, forward, min_bytes, args, kwargs):
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not any(t.is_cuda for t in tensors) or not torch.cuda.is_available():
        if not owner.warned:  # once per checkpointed module
            owner.warned = True
            warnings.warn(
                "memkern.checkpoint(policy='offload'): the inputs are not on a CUDA device, so "
                "there is nothing to offload; using policy 'full' instead", RuntimeWarning,
                stacklevel=4)
        return _full_forward(forward, args, kwargs)
    call = _OffloadCall(min_bytes)
    with torch.autograd.graph.saved_tensors_hooks(call.pack, call.unpack):
        out = forward(*args, **kwargs)
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(lambda grad, call=call: call.prefetch())
            break
    return out


# ----------------------------------------------------------------------------------------------


def _full_forward(forward, args, kwargs, kept_on_device=None):
    """``forward`` checkpointed, keeping its arguments (reported to :mod:`memkern.profile` as
    saved: ``kept_on_device``, default all of them)."""
    if reporting():
        kept = (args, kwargs) if kept_on_device is None else kept_on_device
        note_saved(*(t for t in tree_leaves(kept) if isinstance(t, torch.Tensor)))
    return tcp.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _full_host_forward(forward, args, kwargs, buffers):
    return input_offload.run(
        lambda: _full_forward(forward, args, kwargs, kept_on_device=(args[1:], kwargs)),
        args, buffers)


def recompute_in_backward(fn, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, keeping only its tensor arguments for backward: the call runs
    again in backward (policy "full" for one function call; random ops see the same numbers)."""
    return _full_forward(fn, args, kwargs)


def _selective_forward(forward, args, kwargs):
    if reporting():
        note_saved(*(t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)))
    return tcp.checkpoint(forward, *args, use_reentrant=False, context_fn=_selective_contexts,
                          **kwargs)


class _CheckpointedForward:
    """Replaces ``module.forward``; calls the original under the policy while grad is on."""

    def __init__(self, forward, policy: str, offload_min_bytes: int) -> None:
        self.original = forward
        self.policy = policy
        self.offload_min_bytes = offload_min_bytes
        self.host_buffers = (input_offload.HostBuffers() if policy == input_offload.POLICY
                             else None)
        self.warned = False
        functools.update_wrapper(self, forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.original(*args, **kwargs)
        if self.policy == "full":
            return _full_forward(self.original, args, kwargs)
        if self.policy == "selective":
            return _selective_forward(self.original, args, kwargs)
        if self.host_buffers is not None:
            return _full_host_forward(self.original, args, kwargs, self.host_buffers)
        return _offload_forward(self, self.original, self.offload_min_bytes, args, kwargs)


def checkpoint(module: nn.Module, policy: str | None = "full", *,
               offload_min_bytes: int = 1 << 16) -> nn.Module:
    """Apply a recompute ``policy`` to ``module`` in place and return it (see the module doc).

    ``offload_min_bytes``: with ``"offload"``, saved tensors smaller than this stay on the GPU.
    """
    if not isinstance(module, nn.Module):
        raise TypeError("memkern.checkpoint: module must be an nn.Module, got "
                        f"{type(module).__name__}")
    if policy is not None and policy not in POLICIES:
        raise ValueError(f"memkern.checkpoint: policy={policy!r} is not one of {POLICIES} "
                         "(or None)")
    current = module.__dict__.get("forward")
    if isinstance(current, _CheckpointedForward):
        del module.forward
    if policy is not None:
        module.forward = _CheckpointedForward(module.forward, policy, offload_min_bytes)
    return module


def policy_of(module: nn.Module) -> str | None:
    """The policy :func:`checkpoint` applied to ``module`` (None if none)."""
    current = module.__dict__.get("forward")
    return current.policy if isinstance(current, _CheckpointedForward) else None
