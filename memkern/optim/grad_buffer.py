"""``GradBuffer``: the gradients of a set of parameters in one flat buffer per dtype.

Layout. Parameters are grouped into *buckets* by dtype (all on one device). A bucket's
gradients are one contiguous 1-D tensor ``bucket.grads``; parameter ``i`` of the bucket owns
``grads[offsets[i] : offsets[i] + numel_i]``, in the order the parameters were given, and every
offset is a multiple of :data:`ALIGN` elements. The gaps between parameters are zero and stay
zero (nothing writes them and ``zero_()`` clears them with the rest), so a norm or an inf check
over the whole flat buffer sees exactly the parameters' gradients.

Where the gradients live. When the buffer's dtype is the parameter's (the default), ``p.grad``
*is* a view into the flat buffer: autograd accumulates into it in place, so no copy happens
between backward and the optimizer. Autograd requires ``p.grad.dtype == p.dtype``, so with a
different gradient dtype (e.g. float32 accumulation for bfloat16 weights) each gradient is
added into the buffer by a post-accumulate hook right after autograd produced it, and
``p.grad`` is left ``None``; :meth:`GradBuffer.grad` returns the view either way.

The same layout can hold the parameters themselves: :meth:`GradBuffer.flat_params` moves every
parameter into one flat tensor per bucket at the same offsets, which is what lets the fused
optimizers update a whole param group with one kernel call.

Two options serve the sharded optimizer (:mod:`memkern.optim.zero`): ``layout`` replaces the
packed placement with one that pads runs of parameters so they split evenly across ranks, and
``on_grad`` makes a buffer that lays out the weights but holds no gradients at all: each
gradient goes to ``on_grad(p)`` as soon as autograd has produced it (ZeRO-2 reduces it into
the owning rank's shard there and frees it).
"""
from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable, Iterable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from memkern import _host
from memkern.kernels.state8bit import QBLOCK

ALIGN = QBLOCK
"""Every parameter starts at a multiple of 256 elements in every flat buffer: 512 bytes for
16-bit, 1024 for 32-bit data, from a buffer start torch aligns to at least 64 bytes (512 on
CUDA). Tensor-core GEMMs on the parameter views want aligned operands, vectorised kernels want
aligned segment starts, and on CUDA no 128-byte line is shared by two parameters. It is the
8-bit optimizer state's block size, so that a quantization block never spans two parameters
(nor two ZeRO shards, which are cut at multiples of it); the padding this costs is zero
elements for dimensions that are multiples of 256 and is counted in every measured byte."""

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Which GradBuffer each parameter's gradient belongs to. Weak both ways: dropping a model or an
# optimizer frees them (and a new buffer can take the parameters over); kept outside the
# parameters so that pickling a model is unaffected.
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def aligned(n: int, multiple: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (by default the slot a parameter of n
    elements takes)."""
    return -(-n // multiple) * multiple


Layout = Callable[[list[torch.Tensor]], tuple[list[int], int]]
"""Places the parameters of one bucket: returns each one's offset (multiples of
:data:`ALIGN`, in order, non-overlapping) and the bucket's length in elements."""


def packed_layout(params: list[torch.Tensor]) -> tuple[list[int], int]:
    """The default :data:`Layout`: parameters one after the other, each in an aligned slot."""
    offsets, end = [], 0
    for p in params:
        offsets.append(end)
        end += aligned(p.numel())
    return offsets, end


@dataclasses.dataclass(eq=False)
class Bucket:
    """The parameters of one dtype and their flat gradient buffer.

    ``grads`` is 1-D, ``grad_dtype``, on ``device``, of ``numel`` elements (alignment gaps
    included), or None when the buffer hands gradients to ``on_grad`` instead of holding them.
    ``weights`` is the matching flat tensor of ``dtype`` holding the parameters themselves once
    :meth:`GradBuffer.flat_params` was called, else None.
    """

    device: torch.device
    dtype: torch.dtype
    grad_dtype: torch.dtype
    params: list[torch.Tensor]
    offsets: list[int]
    numel: int
    grads: torch.Tensor | None
    views: list[torch.Tensor]
    weights: torch.Tensor | None = None

    @property
    def grads_are_views(self) -> bool:
        """``p.grad`` is the buffer's view (same dtype); otherwise hooks fill the buffer (or
        hand the gradients on, when the buffer holds none)."""
        return self.grads is not None and self.grad_dtype == self.dtype


def check_params(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``params`` as a list, or a ValueError/TypeError naming what is wrong and the fix."""
    params = list(params)
    if not params:
        raise ValueError(
            "memkern: params is empty; pass the parameters to train, e.g. model.parameters() "
            "(a generator is used up after one pass: build it again or pass a list)"
        )
    seen: dict[int, int] = {}
    for i, p in enumerate(params):
        what = f"params[{i}]"
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"memkern: {what} is a {type(p).__name__}, not a tensor/Parameter")
        what += f" (shape {tuple(p.shape)}, {p.dtype})"
        if id(p) in seen:
            raise ValueError(
                f"memkern: {what} is the same tensor as params[{seen[id(p)]}] (tied weights?); "
                "pass each parameter once"
            )
        seen[id(p)] = i
        if not p.is_floating_point():
            raise TypeError(
                f"memkern: {what} has an integer/bool dtype; only float32, bfloat16 and float16 "
                "parameters can be trained: leave the others out of params"
            )
        if p.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"memkern: {what}: dtype {p.dtype} is not supported; use float32, bfloat16 or "
                "float16 parameters"
            )
        if not p.requires_grad:
            raise ValueError(
                f"memkern: {what} does not require grad; pass only trainable parameters, e.g. "
                "[p for p in model.parameters() if p.requires_grad]"
            )
        if not p.is_leaf:
            raise ValueError(
                f"memkern: {what} is not a leaf tensor (it was computed from other tensors), so "
                "autograd never fills its .grad; pass the nn.Parameters themselves"
            )
        if p.layout != torch.strided or (p.grad is not None and p.grad.layout != torch.strided):
            raise ValueError(
                f"memkern: {what} has a sparse parameter or gradient; the flat buffer holds dense "
                "gradients only (for nn.Embedding use sparse=False)"
            )
        if p.device != params[0].device:
            raise ValueError(
                f"memkern: {what} is on {p.device} but params[0] is on {params[0].device}; one "
                "buffer holds one device's parameters: move the model to one device first, or "
                "build one optimizer per device"
            )
    return params


class GradBuffer:
    """The gradients of ``params`` in one contiguous flat buffer per parameter dtype.

    Args:
        params: the parameters (leaf tensors that require grad, float32/bfloat16/float16, all
            on one device, each once). Their order is the order in the buffer.
        dtype: the gradients' dtype (float32, bfloat16 or float16); None keeps each
            parameter's own dtype, which makes every ``p.grad`` a view into the buffer.
        layout: places each bucket's parameters (a :data:`Layout`); default
            :func:`packed_layout`.
        on_grad: if given, the buffer holds no gradients: ``on_grad(p)`` is called by a
            post-accumulate hook each time autograd has accumulated ``p.grad``, and owns it
            from there (``grad()``, ``zero_()`` and ``claim_grads()`` have nothing to act on).

    After construction ``p.grad`` is the parameter's view into the buffer (any gradient it had
    is copied in) and stays so across :meth:`zero_` and backward: autograd adds into it in
    place. :meth:`zero_` is one fill per bucket. Something that replaces ``p.grad`` (e.g.
    ``model.zero_grad()``, which sets it to None by default) is undone by :meth:`claim_grads`,
    which the memkern optimizers call at every step.
    """

    def __init__(self, params: Iterable[torch.Tensor], dtype: torch.dtype | None = None, *,
                 layout: Layout = packed_layout,
                 on_grad: Callable[[torch.Tensor], None] | None = None) -> None:
        if dtype is not None and dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"memkern.GradBuffer: dtype={dtype} is not supported; use None (the parameters' "
                "own dtype), torch.float32, torch.bfloat16 or torch.float16"
            )
        params = check_params(params)
        self.device = params[0].device
        self.buckets: list[Bucket] = []
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._superseded = False
        self._warned_replaced = False
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        for p_dtype, ps in by_dtype.items():
            self.buckets.append(self._make_bucket(ps, p_dtype, dtype or p_dtype, layout, on_grad))
        self._views = {id(p): v for b in self.buckets for p, v in zip(b.params, b.views)}
        for p in params:
            previous = _OWNERS.get(p)
            previous = previous() if previous is not None else None
            if previous is not None and previous is not self:
                previous._supersede()
            _OWNERS[p] = weakref.ref(self)

    def _make_bucket(self, params: list[torch.Tensor], dtype: torch.dtype,
                     grad_dtype: torch.dtype, layout: Layout,
                     on_grad: Callable[[torch.Tensor], None] | None) -> Bucket:
        offsets, end = layout(params)
        if on_grad is not None:
            for p in params:
                self._hooks.append(p.register_post_accumulate_grad_hook(on_grad))
            return Bucket(self.device, dtype, grad_dtype, params, offsets, end, None, [])
        grads = torch.zeros(end, dtype=grad_dtype, device=self.device)
        views = [grads[o:o + p.numel()].view_as(p) for p, o in zip(params, offsets)]
        bucket = Bucket(self.device, dtype, grad_dtype, params, offsets, end, grads, views)
        for p, view in zip(params, views):
            if p.grad is not None:
                view.copy_(p.grad)
            if bucket.grads_are_views:
                p.grad = view
            else:
                p.grad = None
                self._hooks.append(p.register_post_accumulate_grad_hook(_adder(view)))
        return bucket

    def _supersede(self) -> None:
        """A newer GradBuffer took (some of) these parameters over: stop filling this one."""
        self._superseded = True
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _check_current(self) -> None:
        if self._superseded:
            raise RuntimeError(
                "memkern.GradBuffer: a GradBuffer (or memkern optimizer) created later took over "
                "these parameters; a parameter's gradient lives in one flat buffer at a time: "
                "keep using the newer one"
            )

    @property
    def params(self) -> list[torch.Tensor]:
        """All parameters, bucket by bucket, in buffer order."""
        return [p for b in self.buckets for p in b.params]

    @property
    def numel(self) -> int:
        """Number of gradient elements (the parameters' total size, alignment gaps excluded)."""
        return sum(p.numel() for b in self.buckets for p in b.params)

    def grad(self, p: torch.Tensor) -> torch.Tensor:
        """The buffer's view holding ``p``'s gradient (``p.grad`` itself in the default mode)."""
        try:
            return self._views[id(p)]
        except KeyError:
            if any(b.grads is None for b in self.buckets):
                raise KeyError("memkern.GradBuffer.grad: this buffer holds no gradients (they "
                               "go to its on_grad callback)") from None
            raise KeyError("memkern.GradBuffer.grad: p is not one of this buffer's "
                           "parameters") from None

    def zero_(self) -> None:
        """Sets every gradient to zero: one fill per bucket."""
        self._check_current()
        for b in self.buckets:
            if b.grads is not None:
                b.grads.zero_()

    def claim_grads(self) -> None:
        """Makes every ``p.grad`` the buffer's view again, keeping torch's semantics.

        A parameter whose ``p.grad`` was replaced by another tensor (e.g. ``model.zero_grad()``
        set it to None and the next backward allocated a fresh one) gets that tensor's values
        copied into its view; one whose ``p.grad`` is None gets a zero gradient. Costs one
        identity check per parameter when nothing was replaced.
        """
        self._check_current()
        for b in self.buckets:
            if not b.grads_are_views:
                continue
            for p, view in zip(b.params, b.views):
                grad = p.grad
                if grad is view:
                    continue
                if grad is not None and grad.layout != torch.strided:
                    raise ValueError(
                        f"memkern: a parameter of shape {tuple(p.shape)} received a sparse "
                        "gradient; the flat buffer holds dense gradients only (for nn.Embedding "
                        "use sparse=False)"
                    )
                self._warn_replaced()
                if grad is None:
                    view.zero_()
                else:
                    view.copy_(grad)
                p.grad = view

    def _warn_replaced(self) -> None:
        if not self._warned_replaced:
            self._warned_replaced = True
            warnings.warn(
                "memkern: a parameter's .grad was replaced (model.zero_grad() sets it to None by "
                "default) and was copied back into the flat gradient buffer; zero gradients "
                "with the optimizer's zero_grad() to avoid the extra allocation and copy",
                RuntimeWarning,
                stacklevel=3,
            )

    def flat_params(self, *, through_host: bool = False) -> list[torch.Tensor]:
        """The parameters in one flat tensor per bucket, laid out like the gradients.

        On the first call every parameter's storage is moved (``p.data = flat[o:o+n]``) into
        a new flat tensor of its dtype at its gradient's offset, gaps zero; ``p`` stays the
        same ``nn.Parameter`` object. Move or cast the model before this, not after (as with
        any torch optimizer, which keeps references to the parameters it was given).

        While a bucket's flat tensor is filled, the device holds its weights twice (the flat
        tensor and the parameters' own storages). ``through_host``: each bucket's weights are
        first copied to host memory and the parameters' storages let go, so that it holds them
        once, for a model that fills the device; the weights go down and up once.
        """
        self._check_current()
        for b in self.buckets:
            if b.weights is None:
                held = [p.detach() for p in b.params]
                if through_host:
                    with _host.allocating("weights"):
                        held = [w.to("cpu", copy=True) for w in held]
                    for p in b.params:
                        p.data = torch.empty(0, dtype=b.dtype, device=self.device)
                b.weights = torch.zeros(b.numel, dtype=b.dtype, device=self.device)
                for p, o, w in zip(b.params, b.offsets, held):
                    slot = b.weights[o:o + w.numel()].view_as(w)
                    slot.copy_(w)
                    p.data = slot
        return [b.weights for b in self.buckets]

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{len(b.params)} {str(b.dtype).removeprefix('torch.')} params -> "
            + (f"{str(b.grad_dtype).removeprefix('torch.')}[{b.numel}]" if b.grads is not None
               else "on_grad")
            for b in self.buckets
        )
        return f"GradBuffer({parts}, device={self.device})"


def _adder(view: torch.Tensor):
    """Post-accumulate hook of the other-dtype mode: move ``p.grad`` into the buffer."""

    def hook(p: torch.Tensor) -> None:
        view.add_(p.grad)
        p.grad = None

    return hook
