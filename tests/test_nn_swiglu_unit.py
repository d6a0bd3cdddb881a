"""SwiGLU's gated unit as its own layer (memkern.nn.functional.swiglu_unit,
csrc/autograd/swiglu_unit.cpp) and the recipe its output carries for the down projection.

Oracles: ``F.silu(gate) * up`` in float64 (output and gradients, through the down projection
too: a rebuilt input that differed would change the weight gradient); saved bytes counted by
memkern.profile against what must be kept (gate and up, nothing for the projection after it;
the output itself once it was modified in place).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import memkern as mk
from compare import rel_err
from conftest import needs_layer_extension
from memkern.nn.functional import lora, swiglu_unit
from memkern.profile import saved_bytes


def _pair(*shape, dtype=torch.float32):
    return (torch.randn(*shape, dtype=dtype, requires_grad=True),
            torch.randn(*shape, dtype=dtype, requires_grad=True))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
def test_equals_float64_torch(dtype, tol):
    gate, up = _pair(3, 7, 43, dtype=dtype)
    h = swiglu_unit(gate, up)
    ref = F.silu(gate.double()) * up.double()
    assert h.dtype == dtype and rel_err(h, ref) < tol
    g = torch.randn_like(h)
    for got, want in zip(torch.autograd.grad(h, [gate, up], g),
                         torch.autograd.grad(ref, [gate, up], g.double())):
        assert rel_err(got, want) < tol


@needs_layer_extension
def test_the_down_projection_keeps_gate_and_up_not_the_unit_output():
    gate, up = _pair(5, 11, 43)
    down = mk.nn.Linear(43, 17)
    alone = saved_bytes(lambda: swiglu_unit(gate, up))
    assert alone == 2 * gate.numel() * 4
    assert saved_bytes(lambda: down(swiglu_unit(gate, up))) == alone
    frozen = mk.nn.Linear(43, 17).requires_grad_(False)
    a, b = torch.nn.Parameter(torch.randn(4, 43)), torch.nn.Parameter(torch.randn(17, 4))

    def adapted():
        h = swiglu_unit(gate, up)
        return lora(frozen(h), h, a, b, scaling=0.5)

    assert saved_bytes(adapted) == alone
    # the rebuilt input gives the float64 gradients
    g = torch.randn(5, 11, 17)
    got = torch.autograd.grad(adapted(), [gate, up, a, b], g)
    h64 = F.silu(gate.double()) * up.double()
    ref = (F.linear(h64, frozen.weight.double(), frozen.bias.double())
           + F.linear(F.linear(h64, a.double()), b.double()) * 0.5)
    for u, v in zip(got, torch.autograd.grad(ref, [gate, up, a, b], g.double())):
        assert rel_err(u, v) < 1e-5


@needs_layer_extension
def test_an_output_modified_in_place_is_saved_as_it_is():
    gate, up = _pair(6, 43)
    down = mk.nn.Linear(43, 9)
    h = swiglu_unit(gate, up)
    h.mul_(2.0)  # the recipe would rebuild the unmodified output
    out = down(h)
    g = torch.randn(6, 9)
    got = torch.autograd.grad(out, [gate, up, down.weight], g)
    h64 = 2.0 * F.silu(gate.double()) * up.double()
    ref = F.linear(h64, down.weight.double(), down.bias.double())
    for u, v in zip(got, torch.autograd.grad(ref, [gate, up, down.weight], g.double())):
        assert rel_err(u, v) < 1e-5


@pytest.mark.parametrize("gate,up,match", [
    (torch.randn(3, 4), torch.randn(3, 5), "one shape"),
    (torch.randn(3, 4), torch.randn(3, 4, dtype=torch.float64), "one shape, dtype"),
    (torch.arange(4), torch.arange(4), "gate must be a floating-point"),
])
@needs_layer_extension
def test_bad_arguments_are_refused_by_name(gate, up, match):
    with pytest.raises((ValueError, TypeError), match=match):
        swiglu_unit(gate, up)
