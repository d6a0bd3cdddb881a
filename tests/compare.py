"""The error measures the tests share."""
from __future__ import annotations

from collections.abc import Iterable

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in float64."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def params_rel_err(a: torch.nn.Module | Iterable[torch.Tensor],
                   b: torch.nn.Module | Iterable[torch.Tensor]) -> float:
    """Largest ||p_a - p_b|| / ||p_b|| over paired parameter tensors (modules or lists).

    Norm-wise, not element-wise: two correct float32 implementations drift apart by a random
    walk of ~1 ulp per step on every entry, so after 100 steps the largest entry-wise gap
    reaches ~1e-6 of the tensor's largest entry on some seeds."""
    if isinstance(a, torch.nn.Module):
        a = a.parameters()
    if isinstance(b, torch.nn.Module):
        b = b.parameters()
    return max((torch.linalg.vector_norm(p.double() - q.double())
                / torch.linalg.vector_norm(q.double())).item() for p, q in zip(a, b))


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bits as integers of its element size."""
    return t.detach().reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[
        t.element_size()])


def assert_same_bits(a, b, what: str) -> None:
    """Tensors (bit for bit), dicts, lists and plain values (NaN equal to NaN), nested."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, what
        assert torch.equal(bits(a), bits(b)), f"{what}: differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            assert_same_bits(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_bits(x, y, f"{what}[{i}]")
    else:
        assert a == b or (a != a and b != b), f"{what}: {a!r} != {b!r}"
