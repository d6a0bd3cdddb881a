"""memkern.nn.LinearCrossEntropy / memkern.nn.functional.linear_cross_entropy against the
unfused ``F.cross_entropy(F.linear(x, W, b), t)``: every reduction with its gradients,
ignore_index, label_smoothing, bias, num_items (int and tensor), odd sizes and chunkings.
The memory and speed claims at N=4096, V=32000, H=512 are in test_nn_memory.py.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import memkern as mk
from memkern.nn.functional import linear_cross_entropy as lce
from compare import rel_err
from conftest import runs_cpp_autograd

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@pytest.fixture(autouse=True)
def _both_implementations(layer_autograd):
    """Every test runs on the C++ op (memkern::linear_cross_entropy) and the Python Function."""
    return layer_autograd


def test_routing_runs_the_cpp_autograd(layer_autograd):
    x, w, b, t = _data(5, 7, 11, dtype=torch.float32)
    for reduction in ("mean", "sum", "none"):
        node = lce(x, w, t, b, reduction=reduction).grad_fn
        if reduction == "none":  # the [N] loss viewed as target's shape
            node = node.next_functions[0][0]
        assert runs_cpp_autograd(node) == (layer_autograd == "cpp"), node.name()
    with mk.ops.force("reference"):  # a forced backend keeps the Python Function
        assert not runs_cpp_autograd(lce(x, w, t, b).grad_fn)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("value", [-1, 37, 10**12])
def test_out_of_range_target_raises_a_clear_error(where, value):
    """On the CPU a target outside [0, V) that is not ignore_index raises, naming the value and
    the range, before any gradient is written; ignore_index itself is fine anywhere."""
    x, w, b, t = _data(23, 13, 37, ignore=(4,))
    t[{"first": 0, "middle": 11, "last": 22}[where]] = value
    for reduction, backend in (("mean", None), ("sum", None), ("none", None), ("mean", "reference")):
        with mk.ops.force(backend) if backend else contextlib.nullcontext():
            with pytest.raises(ValueError, match=rf"= {value} is not a class index in \[0, 37\) "
                                                 r"nor ignore_index=-100"):
                lce(x, w, t, b, reduction=reduction, chunk_size=5)
    t[t == value] = 7
    t[t == -100] = -3
    assert torch.isfinite(lce(x, w, t, b, ignore_index=-3))



def _data(n, h, v, dtype=torch.float64, bias=True, ignore=(), ignore_index=-100):
    x = torch.randn(n, h, dtype=dtype, requires_grad=True)
    w = (torch.randn(v, h, dtype=dtype) / h ** 0.5).requires_grad_()
    b = torch.randn(v, dtype=dtype, requires_grad=True) if bias else None
    t = torch.randint(0, v, (n,))
    for i in ignore:
        t[i] = ignore_index
    return x, w, b, t


def _grads(loss, inputs, g):
    return torch.autograd.grad(loss, [i for i in inputs if i is not None], g)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.15])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_matches_unfused_float64(reduction, smoothing, bias, chunk):
    x, w, b, t = _data(23, 13, 37, bias=bias, ignore=(0, 11, 22))
    ref = F.cross_entropy(F.linear(x, w, b), t, reduction=reduction, label_smoothing=smoothing)
    got = lce(x, w, t, b, reduction=reduction, label_smoothing=smoothing, chunk_size=chunk)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert rel_err(got, ref) < 1e-13
    g = torch.randn_like(ref)
    for a, r in zip(_grads(got, (x, w, b), g), _grads(ref, (x, w, b), g)):
        assert rel_err(a, r) < 1e-12


@pytest.mark.parametrize("bias", [True, False])
def test_nan_and_inf_in_later_chunks_propagate_like_torch(bias):
    """Six chunks of 4 tokens: a NaN input row in the third chunk and an inf one in the fifth.
    Their losses and dx rows are NaN, as torch's; dW (accumulated over the chunks) and db are
    NaN as torch's are; every other row's loss and dx is the float64 unfused one."""
    x, w, b, t = _data(23, 13, 37, bias=bias, ignore=(0,))
    x.data[9, 4] = float("nan")
    x.data[17, 2] = float("inf")
    ref = F.cross_entropy(F.linear(x, w, b), t, reduction="none")
    got = lce(x, w, t, b, reduction="none", chunk_size=4)
    bad = torch.zeros(23, dtype=torch.bool)
    bad[[9, 17]] = True
    assert ref[bad].isnan().all() and torch.equal(got.isnan(), ref.isnan())
    assert rel_err(got[~bad], ref[~bad]) < 1e-13
    g = torch.rand_like(ref) + 0.5
    got_grads, ref_grads = _grads(got, (x, w, b), g), _grads(ref, (x, w, b), g)
    for a, r in zip(got_grads, ref_grads):
        assert torch.equal(a.isnan(), r.isnan())
    assert ref_grads[0][bad].isnan().all() and not ref_grads[0][~bad].isnan().any()
    assert rel_err(got_grads[0][~bad], ref_grads[0][~bad]) < 1e-12
    assert all(r.isnan().all() for r in ref_grads[1:])


@pytest.mark.parametrize("chunk", [None, 97], ids=["default-chunk", "chunk97"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_low_precision_matches_unfused(dtype, reduction, chunk):
    """1023 tokens: on the CPU the default chunk covers them all, so ``chunk_size=97`` (11
    chunks, the last one short) is what exercises the accumulation of dW across chunks."""
    x, w, b, t = _data(1023, 19, 131, dtype=dtype, bias=True, ignore=(5,))
    ref = F.cross_entropy(F.linear(x, w, b).float(), t, reduction=reduction)
    got = lce(x, w, t, b, reduction=reduction, chunk_size=chunk)
    assert got.dtype == dtype
    assert rel_err(got, ref) < TOL[dtype]
    g = torch.randn_like(ref)
    # float32 reference gradients (the unfused graph in float32 from the same 16-bit inputs)
    x32, w32, b32 = (v.detach().float().requires_grad_() for v in (x, w, b))
    ref32 = F.cross_entropy(F.linear(x32, w32, b32), t, reduction=reduction)
    for a, r in zip(_grads(got, (x, w, b), g.to(got.dtype)), _grads(ref32, (x32, w32, b32), g)):
        assert a.dtype == dtype
        # plus what rounding the exact gradient to 16 bits alone costs: a small draw of g makes
        # the mean's dx float16 subnormals (|dx| ~ 1e-7), where no 16-bit result is closer
        assert rel_err(a, r) < TOL[dtype] + rel_err(r.to(dtype), r), rel_err(a, r)


def test_module_matches_linear_plus_cross_entropy_on_3d_input():
    m = mk.nn.LinearCrossEntropy(13, 37, bias=True, ignore_index=3, label_smoothing=0.1)
    x = torch.randn(2, 7, 13, requires_grad=True)
    t = torch.randint(0, 37, (2, 7))
    t[1, 2] = 3
    ref = F.cross_entropy(F.linear(x, m.weight, m.bias).flatten(0, 1), t.flatten(), ignore_index=3,
                          label_smoothing=0.1)
    got = m(x, t)
    assert rel_err(got, ref) < 1e-6
    a = torch.autograd.grad(got, (x, m.weight, m.bias))
    r = torch.autograd.grad(ref, (x, m.weight, m.bias))
    assert all(rel_err(u, v) < 1e-5 for u, v in zip(a, r))
    none = mk.nn.LinearCrossEntropy(13, 37, reduction="none")
    assert none(x, t).shape == (2, 7)


@pytest.mark.parametrize("as_tensor", [False, True], ids=["int", "tensor"])
def test_num_items_divides_the_sum(as_tensor):
    x, w, b, t = _data(17, 11, 29, ignore=(4,))
    n = torch.tensor(40) if as_tensor else 40
    got = lce(x, w, t, b, reduction="sum", num_items=n)
    ref = F.cross_entropy(F.linear(x, w, b), t, reduction="sum") / 40
    assert rel_err(got, ref) < 1e-14
    g = torch.tensor(1.7, dtype=torch.float64)
    for a, r in zip(_grads(got, (x, w, b), g), _grads(ref, (x, w, b), g)):
        assert rel_err(a, r) < 1e-13
    # with "mean" the count given replaces the number of non-ignored tokens
    got_mean = lce(x, w, t, b, num_items=n)
    assert rel_err(got_mean, ref) < 1e-14


def test_all_ignored_gives_nan_loss_and_zero_grads_like_torch():
    x, w, b, t = _data(5, 7, 11, ignore=range(5))
    got = lce(x, w, t, b)
    ref = F.cross_entropy(F.linear(x, w, b), t)
    assert torch.isnan(got) and torch.isnan(ref)
    a = _grads(got, (x, w, b), torch.tensor(1.0, dtype=torch.float64))
    r = _grads(ref, (x, w, b), torch.tensor(1.0, dtype=torch.float64))
    for u, v in zip(a, r):
        assert torch.equal(u, v) and float(u.abs().max()) == 0


def test_frozen_weight_and_input_only_paths():
    x, w, b, t = _data(9, 7, 13)
    w.requires_grad_(False)
    (gx,) = torch.autograd.grad(lce(x, w, t), x)
    (rx,) = torch.autograd.grad(F.cross_entropy(F.linear(x, w), t), x)
    assert rel_err(gx, rx) < 1e-13
    x2 = x.detach()
    w.requires_grad_(True)
    (gw,) = torch.autograd.grad(lce(x2, w, t, reduction="sum"), w)
    (rw,) = torch.autograd.grad(F.cross_entropy(F.linear(x2, w), t, reduction="sum"), w)
    assert rel_err(gw, rw) < 1e-13
    with torch.no_grad():
        assert rel_err(lce(x, w, t), F.cross_entropy(F.linear(x, w), t)) < 1e-14


def test_second_backward_through_the_same_graph_raises():
    x, w, b, t = _data(9, 7, 13)
    loss = lce(x, w, t, b)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()
    loss = lce(x, w, t, b, reduction="none")  # recomputes: a second backward is fine
    loss.sum().backward(retain_graph=True)
    loss.sum().backward()


def test_gradient_goes_into_existing_grad():
    x, w, b, t = _data(9, 7, 13)
    w.grad = torch.ones_like(w)
    lce(x, w, t, b).backward()
    w2 = w.detach().clone().requires_grad_()
    F.cross_entropy(F.linear(x, w2, b), t).backward()
    assert rel_err(w.grad - 1, w2.grad) < 1e-13


@pytest.mark.parametrize("kwargs,match", [
    (dict(reduction="avg"), "reduction='avg'"),
    (dict(reduction="none", num_items=3), "num_items"),
    (dict(label_smoothing=1.5), "label_smoothing"),
])
def test_argument_errors(kwargs, match):
    x, w, b, t = _data(3, 4, 5)
    with pytest.raises(ValueError, match=match):
        lce(x, w, t, b, **kwargs)


def test_shape_and_dtype_errors():
    x, w, b, t = _data(3, 4, 5)
    with pytest.raises(ValueError, match="target has shape"):
        lce(x, w, t[:2])
    with pytest.raises(TypeError, match="int64"):
        lce(x, w, t.int())
    with pytest.raises(ValueError, match=r"target\[1\] = 9"):
        lce(x, w, torch.tensor([0, 9, 1]))


@pytest.mark.cuda
def test_cuda_matches_unfused_with_tensor_num_items():
    dev = torch.device("cuda")
    x = torch.randn(4099, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(32003, 64, device=dev) / 8).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, 32003, (4099,), device=dev)
    n = torch.tensor(5000, device=dev)
    got = lce(x, w, t, reduction="sum", num_items=n)
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = F.cross_entropy(F.linear(x32, w32), t, reduction="sum") / 5000
    assert rel_err(got, ref) < 1e-2
    for a, r in zip(torch.autograd.grad(got, (x, w)), torch.autograd.grad(ref, (x32, w32))):
        assert rel_err(a, r) < 3e-2


# ----------------------------------------------------------------------------------------------
# logit soft-capping (Gemma 2's final_logit_softcapping): the loss of cap * tanh(logits / cap)


def _capped(x, w, b, cap):
    return cap * torch.tanh(F.linear(x, w, b) / cap)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_softcap_matches_float64_reference(reduction, smoothing, chunk):
    # scaled up so that many logits lie in tanh's curved range: the cap matters
    x, w, b, t = _data(31, 13, 41, ignore=(0, 17, 30))
    x.data.mul_(4.0)
    cap = 3.5
    ref = F.cross_entropy(_capped(x, w, b, cap), t, reduction=reduction, label_smoothing=smoothing)
    got = lce(x, w, t, b, reduction=reduction, label_smoothing=smoothing, softcap=cap, chunk_size=chunk)
    uncapped = F.cross_entropy(F.linear(x, w, b), t, reduction=reduction, label_smoothing=smoothing)
    assert rel_err(uncapped, ref) > 1e-2  # the data exercises the cap
    assert rel_err(got, ref) < 1e-13
    g = torch.randn_like(ref)
    for a, r in zip(_grads(got, (x, w, b), g), _grads(ref, (x, w, b), g)):
        assert rel_err(a, r) < 1e-12


def test_softcap_over_cpu_sub_blocks_and_num_items():
    # V large enough that the CPU row op runs on four sub-blocks of the chunk (the tanh
    # scratch is one sub-block, reused), an ignored token in the first and in the third
    from memkern.ops.linear_cross_entropy import ROW_OP_BYTES
    v = 110411
    assert ROW_OP_BYTES // (4 * v) == 18
    x, w, b, t = _data(57, 3, v, bias=False, ignore=(3, 40))
    x.data.mul_(6.0)
    n = torch.tensor(61)
    ref = F.cross_entropy(_capped(x, w, None, 2.0), t, reduction="sum") / 61
    got = lce(x, w, t, num_items=n, softcap=2.0, chunk_size=57)
    assert rel_err(got, ref) < 1e-13
    g = torch.tensor(0.7, dtype=torch.float64)
    for a, r in zip(_grads(got, (x, w), g), _grads(ref, (x, w), g)):
        assert rel_err(a, r) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_softcap_low_precision_matches_float32_unfused(dtype):
    x, w, b, t = _data(259, 19, 131, dtype=dtype, ignore=(5,))
    x.data.mul_(3.0)
    x32, w32, b32 = (v.detach().float().requires_grad_() for v in (x, w, b))
    ref = F.cross_entropy(_capped(x32, w32, b32, 5.0), t)
    got = lce(x, w, t, b, softcap=5.0)
    assert got.dtype == dtype and rel_err(got, ref) < TOL[dtype]
    for a, r in zip(torch.autograd.grad(got, (x, w, b)), torch.autograd.grad(ref, (x32, w32, b32))):
        assert a.dtype == dtype and rel_err(a, r) < TOL[dtype], rel_err(a, r)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_softcap_propagates_nan_and_inf_like_torch(where):
    x, w, b, t = _data(9, 5, 11)
    row = {"first": 0, "middle": 4, "last": 8}[where]
    x.data[row, 2] = float("nan")
    x.data[(row + 1) % 9, 1] = float("inf")
    ref = F.cross_entropy(_capped(x, w, b, 4.0), t, reduction="none")
    got = lce(x, w, t, b, reduction="none", softcap=4.0)
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    finite = ~torch.isnan(ref)
    assert rel_err(got[finite], ref[finite]) < 1e-13


@pytest.mark.parametrize("cap", [-1.0, float("inf"), float("nan")], ids=["negative", "inf", "nan"])
def test_softcap_argument_errors(cap):
    x, w, b, t = _data(3, 4, 5)
    with pytest.raises(ValueError, match="softcap="):
        lce(x, w, t, b, softcap=cap)
