"""``memkern::dropout``: dropout whose mask is a pure function of ``(seed, element index)``.

Nothing is stored between forward and backward but the seed: the backward applies the same op
to the gradient, which regenerates exactly the forward's mask (same seed, same indices).

Arguments
    x      contiguous float tensor (any shape); element ``i`` is ``x.view(-1)[i]``.
    seed   int64 tensor with one element, on ``x``'s device (read by the kernel: no host sync).
    p      drop probability in [0, 1].

The random stream is Philox4x32-10 (Salmon et al., 2011) as in ``tl.randint4x``: key =
``seed`` (low word, high word), counter = ``(c, 0, 0, 0)``. With ``n4 = ceil(n / 4)``, element
``i`` uses output word ``i // n4`` of counter ``c = i % n4``, so every output word is used once.
Element ``i`` is kept when that word ``r`` (as an unsigned 32-bit integer) satisfies
``r >= round(p * 2**32)``; kept elements are ``x * (1 / (1 - p))`` (computed in float32 for
16-bit inputs, rounded once), dropped ones are 0 (even where ``x`` is NaN/inf, as in CUDA's
``native_dropout``). The reference, the C++ CPU and CUDA kernels (``csrc/cpu/dropout.cpp``,
``csrc/cuda/dropout.cu``: one Philox implementation, ``csrc/cuda/kernels/dropout_math.h``) and
the Triton kernel produce bit-identical masks.
"""
from __future__ import annotations

import torch

from memkern.ops import _checks
from memkern.ops._registry import Op

M32 = 0xFFFFFFFF
PHILOX_ROUNDS = 10
PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
_REFERENCE_CHUNK = 1 << 20  # counters per step of the reference (bounds its int64 scratch)


def threshold(p: float) -> int:
    """Words below this are dropped: ``round(p * 2**32)``, in [0, 2**32]."""
    return min(max(int(round(p * 4294967296.0)), 0), 1 << 32)


def scale(p: float) -> float:
    """The multiplier of kept elements (0 when everything is dropped)."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def _check(x: torch.Tensor, seed: torch.Tensor, p: float) -> torch.device:
    _checks.tensor("dropout", "x", x)
    if not isinstance(seed, torch.Tensor) or seed.dtype != torch.int64 or seed.numel() != 1:
        raise ValueError(
            "memkern.ops.dropout: seed must be an int64 tensor with one element, got "
            + (f"{seed.dtype} of shape {tuple(seed.shape)}"
               if isinstance(seed, torch.Tensor) else repr(seed))
        )
    _checks.same_device("dropout", "seed", seed, x, "x")
    if not (0.0 <= p <= 1.0):
        raise ValueError(f"memkern.ops.dropout: p={p} must be a probability in [0, 1]")
    return x.device


def _fake(x: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    return torch.empty_like(x)


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``a * b`` (a: 32-bit constant, b: uint32 values in int64).

    ``b`` is split into 16-bit halves so that every product fits in int64 without overflow.
    """
    p_lo = a * (b & 0xFFFF)
    p_hi = a * (b >> 16)
    hi = (p_hi + (p_lo >> 16)) >> 16
    lo = (((p_hi & 0xFFFF) << 16) + p_lo) & M32
    return hi, lo


def philox4x32(seed: torch.Tensor, counter: torch.Tensor) -> list[torch.Tensor]:
    """Philox4x32-10 of counters ``(counter_lo, counter_hi, 0, 0)`` under key ``seed``.

    ``counter``: int64 tensor of non-negative counters; returns the four output words, each an
    int64 tensor of values in [0, 2**32). Matches ``tl.randint4x(seed, counter)``.
    """
    seed = seed.reshape(())
    k0 = seed & M32
    k1 = (seed >> 32) & M32
    c0 = counter & M32
    c1 = (counter >> 32) & M32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mulhilo(PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + PHILOX_KEY_A) & M32
        k1 = (k1 + PHILOX_KEY_B) & M32
    return [c0, c1, c2, c3]


def keep_mask(seed: torch.Tensor, numel: int, p: float) -> torch.Tensor:
    """The boolean keep-mask of ``numel`` elements (the reference's definition of the mask)."""
    n4 = -(-numel // 4)
    thresh = threshold(p)
    words = [torch.empty(n4, dtype=torch.bool, device=seed.device) for _ in range(4)]
    for start in range(0, n4, _REFERENCE_CHUNK):
        stop = min(n4, start + _REFERENCE_CHUNK)
        counter = torch.arange(start, stop, dtype=torch.int64, device=seed.device)
        for w, r in zip(words, philox4x32(seed, counter)):
            w[start:stop] = r >= thresh
    return torch.cat(words)[:numel]


def reference(x: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    keep = keep_mask(seed, x.numel(), p).view(x.shape)
    cd = _checks.compute_dtype(x.dtype)
    kept = (x.to(cd) * scale(p)).to(x.dtype)
    return torch.where(keep, kept, torch.zeros((), dtype=x.dtype, device=x.device))


dropout = Op(
    "dropout",
    "(Tensor x, Tensor seed, float p) -> Tensor",
    check=_check,
    fake=_fake,
    reference=reference,
    triton="memkern.kernels.dropout.dropout",
    compiled_kernels=True,
)
