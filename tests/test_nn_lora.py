"""memkern's LoRA layer (memkern.nn.functional.lora, csrc/autograd/lora.cpp):
``base + scaling * B(A(dropout(x)))``.

Oracles: the same sum computed by torch in float64 (outputs and every gradient); for dropout,
the mask the op must have drawn (torch's generator replayed to the same seed, that seed's mask
from the dropout's Philox reference) and three identities that hold only when backward applies
the forward's mask (``scaling * B A dropout(x)`` is linear in ``A``, in ``B`` and in ``x``:
⟨A, dA⟩ = ⟨B, dB⟩ = ⟨x, dx⟩ = ⟨G, out − base⟩ − ⟨b_B, db_B⟩); saved bytes counted by
memkern.profile against what the layer must keep (nothing after a memkern norm with the wrapped
layer frozen: the norm's input, which the norm keeps anyway, and an 8-byte seed).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memkern as mk
from compare import rel_err
from conftest import needs_layer_extension
from memkern.nn.functional import lora
from memkern.ops.dropout import reference as dropout_reference
from memkern.profile import saved_bytes

TOL = 2e-6


def _params(d_in=37, d_out=23, r=5, bias=True, dtype=torch.float32):
    """A, B, b_B: parameters (saved-bytes counts leave them out, as they do a model's)."""
    a = nn.Parameter(torch.randn(r, d_in, dtype=dtype) / d_in ** 0.5)
    b = nn.Parameter(torch.randn(d_out, r, dtype=dtype))
    bb = nn.Parameter(torch.randn(d_out, dtype=dtype)) if bias else None
    return a, b, bb


def _oracle(base, x, a, b, bb, scaling, mask=None, p=0.0):
    """The adapter in float64 with torch's own ops (the dropout mask given)."""
    xd = x.double() if mask is None else x.double() * mask.double() / (1 - p)
    out = base.double() + F.linear(F.linear(xd, a.double()), b.double(),
                                   None if bb is None else bb.double()) * scaling
    return out


def _grads(out, g, tensors):
    return torch.autograd.grad(out, [t for t in tensors if t is not None], g)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(41,), (3, 13)])
def test_equals_float64_torch(bias, shape):
    a, b, bb = _params(bias=bias)
    x = torch.randn(*shape, 37, requires_grad=True)
    base = torch.randn(*shape, 23, requires_grad=True)
    g = torch.randn(*shape, 23)
    scaling = 0.37
    out = lora(base, x, a, b, bb, scaling=scaling)
    ref = _oracle(base, x, a, b, bb, scaling)
    assert out.dtype == base.dtype and out.shape == base.shape
    assert rel_err(out, ref) < TOL
    tensors = [base, x, a, b, bb]
    for got, want in zip(_grads(out, g, tensors), _grads(ref, g.double(), tensors)):
        assert rel_err(got, want) < TOL


def _seeded_call(p, scaling, *, seed):
    """One dropout call and the mask it must have drawn: torch's CPU generator at ``seed``
    draws the op's seed as memkern's Dropout does (``[0, 2**62)``); the dropout's Philox
    reference (an oracle apart from the C++ kernel) on ones shows that seed's mask."""
    a, b, bb = _params()
    x = torch.randn(29, 37, requires_grad=True)
    base = torch.randn(29, 23, requires_grad=True)
    torch.manual_seed(seed)
    out = lora(base, x, a, b, bb, scaling=scaling, p=p)
    torch.manual_seed(seed)
    drawn = torch.randint(0, 1 << 62, (), dtype=torch.int64)
    mask = dropout_reference(torch.ones(29, 37), drawn, p) != 0
    return out, (base, x, a, b, bb), mask


@needs_layer_extension
def test_dropout_mask_drawn_once_and_replayed_in_backward():
    p, scaling = 0.3, 1.7
    out, (base, x, a, b, bb), mask = _seeded_call(p, scaling, seed=1234)
    assert 0.15 < 1 - mask.float().mean().item() < 0.45  # about p of the inputs dropped
    ref = _oracle(base, x, a, b, bb, scaling, mask=mask, p=p)
    assert rel_err(out, ref) < TOL
    g = torch.randn(29, 23)
    tensors = [base, x, a, b, bb]
    grads = _grads(out, g, tensors)
    for got, want in zip(grads, _grads(ref, g.double(), tensors)):
        assert rel_err(got, want) < TOL
    # without the mask's values: scaling * B A dropout(x) is linear in A, in B, in x
    _, dx, da, db, dbb = grads
    term = (g.double() * (out - base).double()).sum().item() - (bb.double() * dbb).sum().item()
    for lhs in ((a.double() * da).sum(), (b.double() * db).sum(), (x.double() * dx).sum()):
        assert abs(lhs.item() - term) < 1e-5 * max(abs(term), 1.0)


def test_eval_mode_has_no_dropout():
    a, b, bb = _params()
    x, base = torch.randn(11, 37), torch.randn(11, 23)
    out = lora(base, x, a, b, bb, scaling=0.5, p=0.9, training=False)
    assert rel_err(out, _oracle(base, x, a, b, bb, 0.5)) < TOL


@needs_layer_extension
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_after_a_norm_with_the_layer_frozen_keeps_only_the_norms_input(norm):
    """The wrapped layer frozen (PEFT's case): memkern's Linear saves nothing, and the adapter
    the norm's recipe: the chain keeps what the norm alone keeps, plus the dropout seed."""
    d, rows = 37, 3 * 17
    x = torch.randn(3, 17, d, requires_grad=True)
    m = mk.nn.RMSNorm(d) if norm == "rms" else mk.nn.LayerNorm(d)
    layer = mk.nn.Linear(d, 23).requires_grad_(False)
    a, b, _ = _params(d_in=d)
    alone = saved_bytes(lambda: m(x))
    assert alone == x.numel() * 4 + (1 if norm == "rms" else 2) * rows * 4

    def chain(p):
        h = m(x)
        return lora(layer(h), h, a, b, scaling=2.0, p=p)

    assert saved_bytes(lambda: chain(0.0)) == alone
    assert saved_bytes(lambda: chain(0.25)) == alone + 8  # the seed
    # and the rebuilt input gives the right gradients
    ref_norm = torch.nn.RMSNorm(d) if norm == "rms" else torch.nn.LayerNorm(d)
    ref_norm.load_state_dict(m.state_dict())
    g = torch.randn(3, 17, 23)
    h = m(x)
    got = torch.autograd.grad(lora(layer(h), h, a, b, scaling=2.0), [x, a, b, *m.parameters()], g)
    h64 = ref_norm.double()(x.double())
    ref = _oracle(F.linear(h64, layer.weight.double(), layer.bias.double()), h64, a, b, None, 2.0)
    want = torch.autograd.grad(ref, [x, a, b, *ref_norm.parameters()], g.double())
    for u, v in zip(got, want):
        assert rel_err(u, v) < 1e-5


@needs_layer_extension
def test_keeps_the_input_as_given_when_cast():
    """A bfloat16 input to a float32 adapter (PEFT keeps adapters in float32) is saved in
    bfloat16 and cast again in backward, never kept cast; the output has base's dtype."""
    a, b, bb = _params()
    x = torch.randn(19, 37, dtype=torch.bfloat16, requires_grad=True)
    base = torch.randn(19, 23, dtype=torch.bfloat16, requires_grad=True)
    assert saved_bytes(lambda: lora(base, x, a, b, bb, scaling=0.5)) == x.numel() * 2
    out = lora(base, x, a, b, bb, scaling=0.5)
    assert out.dtype == torch.bfloat16
    ref = _oracle(base, x, a, b, bb, 0.5)
    assert rel_err(out, ref) < 1e-2  # one bfloat16 rounding of the sum
    g = torch.randn(19, 23, dtype=torch.bfloat16)
    for got, want in zip(_grads(out, g, [x, a, b]), _grads(ref, g.double(), [x, a, b])):
        assert rel_err(got, want) < 1e-2


def test_under_autocast_computes_in_autocasts_dtype():
    a, b, bb = _params()
    x, base = torch.randn(19, 37), torch.randn(19, 23, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lora(base, x, a, b, bb, scaling=0.5)
        torch_out = base + F.linear(F.linear(x, a), b, bb) * 0.5  # PEFT's composition
    assert out.dtype == torch.bfloat16
    assert rel_err(out, torch_out) < 2e-2


@needs_layer_extension
def test_adds_the_adapters_gradients_into_existing_grad():
    a, b, bb = _params()
    x, base = torch.randn(13, 37), torch.randn(13, 23)
    a.grad, b.grad = torch.ones_like(a), torch.full_like(b, 2.0)
    g = torch.randn(13, 23)
    lora(base, x, a, b, bb, scaling=0.7).backward(g)
    da, db = _grads(_oracle(base, x, a, b, bb, 0.7), g.double(), [a, b])
    assert rel_err(a.grad, 1.0 + da) < TOL and rel_err(b.grad, 2.0 + db) < TOL


@pytest.mark.parametrize("args,match", [
    (dict(x=torch.randn(4, 36)), "x has shape"),
    (dict(base=torch.randn(4, 22)), "base has shape"),
    (dict(lora_B=torch.randn(23, 4)), "must be \\[r, in\\] and \\[out, r\\]"),
    (dict(lora_B_bias=torch.randn(22)), "lora_B_bias has shape"),
    (dict(lora_B=torch.randn(23, 5, dtype=torch.float64)), "lora_B has dtype"),
    (dict(p=1.5), "p=1.5"),
])
def test_bad_arguments_are_refused_by_name(args, match):
    a, b, bb = _params()
    call = dict(base=torch.randn(4, 23), x=torch.randn(4, 37), lora_A=a, lora_B=b,
                lora_B_bias=bb, p=0.0) | args
    with pytest.raises((ValueError, RuntimeError, TypeError), match=match):
        lora(call["base"], call["x"], call["lora_A"], call["lora_B"], call["lora_B_bias"],
             scaling=1.0, p=call["p"])
