"""memkern.nn.functional.modulated_layer_norm (adaLN: ``layer_norm(x) * (1 + scale) + shift``,
the op memkern::modulated_norm_layer with its C++ autograd node) and the recipe it leaves for a
memkern Linear/MLP consuming its output.

Oracle: torch's composition (``F.layer_norm`` without affine parameters, then the per-sample
multiply and add, as diffusers writes it) in float64 on the very inputs, fresh random data of
odd sizes; NaN/inf in one row stay in the rows and samples they reach.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import memkern as mk
from compare import rel_err
from conftest import needs_layer_extension, runs_cpp_autograd
from memkern.nn import modulated_norm as _modulated_norm
from memkern.nn.modulated_norm import modulated_layer_norm
from memkern.ops import _gemm_layer
from memkern.profile import SavedTensorsRecorder

EPS = 1e-6


def _composition(x, scale, shift):
    normed = F.layer_norm(x, (x.shape[-1],), eps=EPS)
    return normed * (1 + scale[:, None]) + shift[:, None]


def _inputs(dtype, b=3, t=11, d=13):
    x = torch.randn(b, t, d, dtype=dtype) * 3 + 1
    return x, torch.randn(b, d, dtype=dtype), torch.randn(b, d, dtype=dtype)


def _grads(fn, inputs, g):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    return (y, *torch.autograd.grad(y, leaves, g))


@pytest.mark.parametrize("path", ["extension", "composition"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_output_and_gradients_are_the_compositions(path, dtype, monkeypatch):
    if path == "extension" and _modulated_norm.modulated_norm_layer_entry is None:
        pytest.skip("the compiled extension is not built")
    if path == "composition":  # what runs without the extension (or under autocast)
        monkeypatch.setattr(_modulated_norm, "modulated_norm_layer_entry", None)
    x, scale, shift = _inputs(dtype)
    g = torch.randn(x.shape, dtype=dtype)
    got = _grads(modulated_layer_norm, (x, scale, shift), g)
    want = _grads(_composition, (x.double(), scale.double(), shift.double()), g.double())
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    for name, a, b in zip(("y", "dx", "dscale", "dshift"), got, want):
        assert a.dtype == dtype and rel_err(a, b) < tol, name
    assert (path == "extension") == runs_cpp_autograd(modulated_layer_norm(
        x, scale.requires_grad_(), shift).grad_fn)


@needs_layer_extension
def test_nan_and_inf_stay_in_their_rows_and_samples():
    """A NaN in one token of the last sample and an inf in another: those rows' outputs and
    input gradients, and that sample's scale/shift gradients, are what torch's composition
    gives (NaN); every other row and sample is exact."""
    x, scale, shift = _inputs(torch.float64)
    x[2, 7, 4] = float("nan")
    x[2, 9, 0] = float("inf")
    g = torch.randn(x.shape, dtype=torch.float64)
    got = _grads(modulated_layer_norm, (x, scale, shift), g)
    want = _grads(_composition, (x, scale, shift), g)
    for name, a, b in zip(("y", "dx", "dscale", "dshift"), got, want):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12, equal_nan=True), name
    y, dx, dscale, _ = got
    assert y[2, 7].isnan().all() and dx[2, 9].isnan().all() and dscale[2].isnan().all()
    assert y[:2].isfinite().all() and dx[:2].isfinite().all() and dscale[:2].isfinite().all()
    assert y[2, :7].isfinite().all() and dx[2, :7].isfinite().all()


@needs_layer_extension
@pytest.mark.parametrize("consumer", ["linear", "mlp"])
def test_consumer_saves_the_recipe_not_the_output(consumer):
    """A memkern Linear/MLP after the modulated norm keeps x, scale and shift (which the norm
    holds) and the row statistics — no [batch, tokens, features] tensor but x — and its
    gradients are those of torch's composition followed by torch's layers (float64)."""
    b, t, d, h = 3, 11, 13, 17
    x, scale, shift = _inputs(torch.float64, b, t, d)
    params = [torch.randn(h, d, dtype=torch.float64), torch.randn(h, dtype=torch.float64)]
    if consumer == "linear":
        def layer(z, w1, b1):
            return mk.nn.functional.linear(z, w1, b1)

        def ref_layer(z, w1, b1):
            return F.linear(z, w1, b1)
    else:
        params.append(torch.randn(d, h, dtype=torch.float64))

        def layer(z, w1, b1, w2):
            return mk.nn.functional.mlp(z, w1, b1, w2, None, activation="gelu_tanh")

        def ref_layer(z, w1, b1, w2):
            return F.linear(F.gelu(F.linear(z, w1, b1), approximate="tanh"), w2)
    leaves = [v.clone().requires_grad_() for v in (x, scale, shift, *params)]
    with SavedTensorsRecorder() as rec:
        y = modulated_layer_norm(*leaves[:3], EPS)
        out = layer(y, *leaves[3:])
    assert y._memkern_recipe.kind == _gemm_layer.MODULATED_LAYER_NORM
    token_sized = [e for e in rec.entries.values() if e.shape[-1] == d and e.shape[:-1] == (b, t)]
    assert len(token_sized) == 1, rec.entries  # x itself
    g = torch.randn(out.shape, dtype=torch.float64)
    got = torch.autograd.grad(out, leaves, g)
    ref = [v.clone().requires_grad_() for v in (x, scale, shift, *params)]
    want = torch.autograd.grad(ref_layer(_composition(*ref[:3]), *ref[3:]), ref, g)
    assert all(rel_err(a, c) < 1e-12 for a, c in zip(got, want))


@needs_layer_extension
def test_recipe_not_used_once_an_input_changed_in_place():
    """The consumer saves the output itself when the norm's shift was modified in place before
    the consumer ran (the recipe would rebuild another output): gradients stay exact."""
    x, scale, shift = _inputs(torch.float64)
    w = torch.randn(7, x.shape[-1], dtype=torch.float64, requires_grad=True)
    shift_leaf = shift.clone().requires_grad_()
    held = shift_leaf * 1.0
    y = modulated_layer_norm(x, scale, held, EPS)
    with torch.no_grad():
        held.add_(1.0)
    out = mk.nn.functional.linear(y, w)
    (gw,) = torch.autograd.grad(out.sum(), [w])
    assert rel_err(gw, torch.ones(out.shape, dtype=torch.float64).flatten(0, 1).T
                   @ y.detach().flatten(0, 1)) < 1e-13


@pytest.mark.parametrize("bad,match", [
    (lambda x, s: (x[0, 0], s, s), "x has shape"),
    (lambda x, s: (x, s[:, :-1], s), "scale has shape"),
    (lambda x, s: (x, s, s[:-1]), "shift has shape"),
])
def test_errors_name_the_argument(bad, match):
    x, scale, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match=match):
        modulated_layer_norm(*bad(x, scale))
