"""Policy "full-host" of :func:`memkern.checkpoint`: "full" recomputation whose kept input lives
in host memory, brought back one block ahead of the block's backward.

Under "full" a block (typically each decoder layer of a model) keeps only its input for
backward and runs its forward again there. Under "full-host" the blocks called one after another
(with gradients enabled) make a chain, and each block's input waits in host memory between its
forward and its backward. For block k of a chain, with input ``x_k``:

=========================  ==================================================================
when                       what happens to ``x_k``
=========================  ==================================================================
block k's forward          stays on the device (block k reads it)
block k+1's forward        copied to host memory while block k+1 runs (on CUDA, on a side
                           stream); when block k+1's forward ends the compute stream waits
                           for the copy and the device copy is let go (its memory is freed
                           unless something else holds it)
block k+1's backward       (the gradient of block k+1's output is ready) copied back into a new
starts                     device tensor while block k+1 recomputes its forward and runs its
                           backward
block k's backward         its forward is recomputed from that tensor (``torch.utils.
                           checkpoint``, as "full": same random numbers for dropout), which is
                           let go when block k's backward ends
=========================  ==================================================================

The chain's last block keeps its input on the device (no block runs after it, and its backward
comes first); the first block's backward brings nothing back. The output head's input (the last
block's output) is never copied. So besides what the running block makes (its output included),
the policy holds at most two block inputs on the device at any moment (``x_k`` and ``x_{k+1}``
while block k+1 runs forward; the copy in use and the one arriving in backward), where "full"
holds all of them; each arriving copy takes the block of memory the copy before the last one
gave back.

Host memory: each module under the policy has its own buffers (:class:`HostBuffers`): one per
call of it alive at once (one, unless the module runs again before the first call's backward),
made by :func:`memkern._host.empty` with exactly the bytes of the largest input it has held,
kept from step to step (on CUDA page-locked once, at that size: torch's pinned caching allocator
would round it up to a power of two). The last block's module never makes one: a
chain of L blocks whose inputs are B bytes each holds (L - 1)·B bytes of host memory.

The block's input is its first positional argument, one tensor (it comes back with its strides
when they are a permutation of a contiguous layout, else contiguous); its other arguments (an
attention mask, rotary embeddings) are kept as "full" keeps them. On a device other than CUDA
(the CPU in the tests, the CPU stand-in of a step :mod:`memkern.profile` plans) the same steps
run with plain copies (:mod:`memkern._copies`), so the same buffers live at the same moments.
"""
from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from memkern import _fake, _host
from memkern._copies import copies_for, dense

POLICY = "full-host"
_local = threading.local()  # .tail: weakref to the chain's last call (see run)


class _HostBuffer:
    """A host buffer and the last copy that read or wrote it (None: none, or done)."""

    __slots__ = ("tensor", "last_copy")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.last_copy = None

    def free(self) -> None:
        """Lets the memory go, once no copy uses it."""
        if self.last_copy is not None:
            self.last_copy.synchronize()
        self.tensor = None


class HostBuffers:
    """The host buffers one module's inputs are kept in, reused across its calls and steps."""

    def __init__(self) -> None:
        self.free: list[_HostBuffer] = []
        self.held: list[_HostBuffer] = []

    @property
    def nbytes(self) -> int:
        """Bytes of host memory held (free and in use)."""
        return sum(b.tensor.numel() for b in (*self.free, *self.held))

    def take(self, nbytes: int, device: torch.device) -> _HostBuffer:
        """The smallest free buffer of at least ``nbytes``; if none, the free ones (too small)
        are freed and one of exactly ``nbytes`` is made."""
        fake = _fake.fake_mode_active()  # a planned step's buffers are fake, a run's real
        fits = [b for b in self.free
                if b.tensor.numel() >= nbytes and _fake.is_fake(b.tensor) == fake]
        if fits:
            buf = min(fits, key=lambda b: b.tensor.numel())
            self.free.remove(buf)
        else:
            for b in self.free:
                b.free()
            self.free = []
            pinned = _host.pin_for(device)  # at exactly its size: no power-of-two rounding
            buf = _HostBuffer(_host.empty(nbytes, torch.uint8, pinned=pinned, exact=pinned,
                                          holds="activations"))
        self.held.append(buf)
        return buf

    def give_back(self, buf: _HostBuffer) -> None:
        self.held.remove(buf)
        self.free.append(buf)

    def __del__(self) -> None:
        for b in self.free:
            b.free()


class _BlockInput:
    """One call's block input, on the device, in host memory or both: what the saved-tensor
    hooks pack it into. ``position``: the call's place in its chain (0 for the first)."""

    __slots__ = ("device", "where", "size", "stride", "dtype", "dense", "copies", "buffers", "host",
                 "to_host", "to_device", "previous", "position", "packed", "backward_started",
                 "__weakref__")

    def __init__(self, x: torch.Tensor, buffers: HostBuffers, previous: _BlockInput | None):
        self.device: torch.Tensor | None = x
        self.where = x.device
        self.size, self.stride, self.dtype, self.dense = x.size(), x.stride(), x.dtype, dense(x)
        self.copies = copies_for(x.device)
        self.buffers = buffers
        self.host: _HostBuffer | None = None
        self.to_host = self.to_device = None  # the copies' ``done`` (see memkern._copies)
        self.previous = weakref.ref(previous) if previous is not None else None
        self.position = previous.position + 1 if previous is not None else 0
        self.packed = False
        self.backward_started = False

    def pack(self, t: torch.Tensor) -> Any:
        """The saved-tensor hook: the block's input is packed into this object, once. (autograd
        keeps the hooks as long as the graph: they must not hold the input themselves.)"""
        if t is self.device and not self.packed:
            self.packed = True
            return self
        return t

    def _host_view(self) -> torch.Tensor:
        nbytes = self.size.numel() * self.dtype.itemsize
        flat = self.host.tensor[:nbytes].view(self.dtype)
        return flat.as_strided(self.size, self.stride) if self.dense else flat.view(self.size)

    def offload(self) -> None:
        """Starts the copy to host memory (the device copy is kept until :meth:`offloaded`)."""
        x = self.device
        self.host = self.buffers.take(x.numel() * x.element_size(), x.device)
        self.to_host = self.host.last_copy = self.copies.start(self._host_view(), x)

    def offloaded(self) -> None:
        """The compute stream waits for the copy to host memory; the device copy is let go."""
        self.copies.wait(self.to_host)
        self.device = None

    def fetch(self) -> None:
        """Starts the copy back into a new device tensor."""
        if self.dense:
            x = torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=self.where)
        else:
            x = torch.empty(self.size, dtype=self.dtype, device=self.where)
        self.to_device = self.host.last_copy = self.copies.start(x, self._host_view())
        self.device = x

    def backward_starts(self) -> None:
        """The gradient of this call's output is ready: its input must be on the device (it
        is, unless the chain was broken), and the previous call's input starts coming back."""
        self.backward_started = True
        if self.device is None:
            self.fetch()
        previous = self.previous() if self.previous is not None else None
        if (previous is not None and not previous.backward_started and previous.device is None
                and previous.host is not None):
            previous.fetch()

    def unpack(self) -> torch.Tensor:
        """The input on the device, for the recomputation. A copy from host memory is handed
        over (a retained graph's next backward fetches it again); an input never copied stays
        held until this object dies, as "full" holds it."""
        if self.device is None:
            self.fetch()
        self.copies.wait(self.to_device)
        x = self.device
        if self.host is not None:
            self.device = self.to_device = None
        return x

    def __del__(self) -> None:
        if self.device is not None and self.to_device is not None:
            self.copies.let_go(self.device)  # fetched, never used
        if self.host is not None:
            self.buffers.give_back(self.host)


def _unpack(packed: Any) -> Any:
    return packed.unpack() if isinstance(packed, _BlockInput) else packed


def _backward_starts(call: weakref.ref, grad: torch.Tensor) -> None:
    c = call()
    if c is not None and not c.backward_started:
        c.backward_starts()


def _tail() -> _BlockInput | None:
    """The chain's last call, if its input is still on the device and its backward has not
    started (else a new call starts a new chain)."""
    ref = getattr(_local, "tail", None)
    tail = ref() if ref is not None else None
    if tail is None or tail.backward_started or tail.host is not None:
        return None
    return tail


@torch.compiler.disable
def run(forward: Callable[[], Any], args: Sequence[Any], buffers: HostBuffers) -> Any:
    """``forward()``: a block's call on ``args`` checkpointed as policy "full" does it
    (``torch.utils.checkpoint``, which saves its tensor arguments through autograd's saved-tensor
    hooks), with the block's input ``args[0]`` kept as the module docstring says.

    Under ``torch.compile`` this call, the block's forward included, runs eagerly (the graph
    breaks before and after it): the copies and the chain are Python state that a compiled graph
    would not keep, and the block recomputes bit for bit what it computed."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"memkern.checkpoint(policy={POLICY!r}): the module's first positional argument must "
            f"be the block's input, one tensor (it is what is kept in host memory); got "
            f"{type(x).__name__ if args else 'no positional argument'}. Pass the input tensor "
            f"first, or use policy 'full'")
    previous = _tail()
    call = _BlockInput(x, buffers, previous)
    if previous is not None:
        previous.offload()
    try:
        with torch.autograd.graph.saved_tensors_hooks(call.pack, _unpack):
            out = forward()
    finally:
        if previous is not None:
            previous.offloaded()
    if not call.packed:
        raise RuntimeError(
            f"memkern.checkpoint(policy={POLICY!r}): torch.utils.checkpoint (torch "
            f"{torch.__version__}) did not save the block's input through autograd's saved-tensor "
            f"hooks, so it cannot be kept in host memory; use policy 'full'")
    outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if outputs:
        ref = weakref.ref(call)
        torch.autograd.graph.register_multi_grad_hook(
            outputs, functools.partial(_backward_starts, ref), mode="any")
        _local.tail = ref
    return out
