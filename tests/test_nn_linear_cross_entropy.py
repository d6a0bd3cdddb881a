"""memkern.nn.LinearCrossEntropy / memkern.nn.functional.linear_cross_entropy against the
unfused ``F.cross_entropy(F.linear(x, W, b), t)`` in float64: every reduction with its
gradients, ignore_index (default and not), label_smoothing, bias, num_items (int and tensor),
soft-capping, on odd sizes whose chunkings take >= 3 chunks of tokens and >= 3 blocks of classes
with a short last one; 16-bit inputs against the float32 unfused graph. Also: no host read in
forward or backward, torch.compile with ignored targets, what is kept between forward and
backward, the loops' C++ kernels and Python references bit for bit, and the CUDA path
(``cuda``-marked). Without the compiled extension the function is torch's own loss: the tests
of memkern's algorithm skip there, the comparisons with torch test that fallback.
The memory and speed at N=4096, V=32000, H=512 are in test_nn_memory.py and benchmarks/.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import memkern as mk
from compare import rel_err
from conftest import needs_layer_extension, runs_cpp_autograd
from host_reads import HostReadSpy
from memkern.nn.functional import linear_cross_entropy as lce
from memkern.ops import linear_cross_entropy as lce_ops
from memkern.ops.cross_entropy import ENTROPY_ROW, ROW_ENTROPY, ROW_IS_TOP1, ROW_MEAN_LOGIT

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
LOW = [torch.float32, torch.bfloat16, torch.float16]
LOW_IDS = ["float32", "bfloat16", "float16"]


def _data(n, h, v, dtype=torch.float64, bias=True, ignore=(), ignore_index=-100, device="cpu"):
    x = torch.randn(n, h, dtype=dtype, device=device, requires_grad=True)
    w = (torch.randn(v, h, dtype=dtype, device=device) / h ** 0.5).requires_grad_()
    b = torch.randn(v, dtype=dtype, device=device, requires_grad=True) if bias else None
    t = torch.randint(0, v, (n,), device=device)
    t[t == ignore_index] = (ignore_index + 1) % v  # only the chosen rows are ignored
    for i in ignore:
        t[i] = ignore_index
    return x, w, b, t


def _grads(loss, inputs, g):
    return torch.autograd.grad(loss, [i for i in inputs if i is not None], g)


@needs_layer_extension
def test_every_call_runs_the_cpp_autograd():
    """The one autograd, memkern::linear_cross_entropy_layer's C++ node: eager calls through the
    entry point and through the op (an int num_items), while saved tensors are recorded, under
    a forced backend (which reaches only the ops called from Python)."""
    from memkern.profile import SavedTensorsRecorder
    for dtype in (torch.float32, torch.bfloat16):  # the gradients-in-forward and split paths
        x, w, b, t = _data(5, 7, 11, dtype=dtype)
        for reduction in ("mean", "sum", "none"):
            for context, items in ((contextlib.nullcontext, None), (contextlib.nullcontext, 3),
                                   (SavedTensorsRecorder, None),
                                   (lambda: mk.ops.force("reference"), None)):
                with context():
                    node = lce(x, w, t, b, reduction=reduction,
                               num_items=None if reduction == "none" else items).grad_fn
                if reduction == "none":  # the [N] loss viewed as target's shape
                    node = node.next_functions[0][0]
                assert runs_cpp_autograd(node), node.name()


@needs_layer_extension
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("value", [-1, 37, 10**12])
def test_out_of_range_target_raises_a_clear_error(where, value):
    """On the CPU a target outside [0, V) that is not ignore_index raises, naming the value and
    the range, before any gradient is written; ignore_index itself is fine anywhere."""
    x, w, b, t = _data(23, 13, 37, ignore=(4,))
    t[{"first": 0, "middle": 11, "last": 22}[where]] = value
    for reduction in ("mean", "sum", "none"):
        with pytest.raises(ValueError, match=rf"= {value} is not a class index in \[0, 37\) "
                                             r"nor ignore_index=-100"):
            lce(x, w, t, b, reduction=reduction, chunk_size=5)
    t[t == value] = 7
    t[t == -100] = -3
    assert torch.isfinite(lce(x, w, t, b, ignore_index=-3))


# 23 tokens, 37 classes: (chunk_size, vocab_block) giving 1 chunk/block each, 5 chunks (the last
# of 3) and 6 blocks (the last of 2), 23 and 37 of one each
SIZES = [(64, 64), (5, 7), (1, 1)]
SIZE_IDS = ["one-block", "chunks5-blocks7", "rows-and-classes-one-by-one"]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.15])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("ignore_index", [-100, 3], ids=["ignore-100", "ignore3"])
@pytest.mark.parametrize("sizes", SIZES, ids=SIZE_IDS)
def test_matches_unfused_float64(reduction, smoothing, bias, ignore_index, sizes):
    """ignore_index=3 is a class index: its rows must be ignored, not trained towards class 3."""
    x, w, b, t = _data(23, 13, 37, bias=bias, ignore=(0, 11, 22), ignore_index=ignore_index)
    ref = F.cross_entropy(F.linear(x, w, b), t, reduction=reduction, label_smoothing=smoothing,
                          ignore_index=ignore_index)
    got = lce(x, w, t, b, reduction=reduction, label_smoothing=smoothing,
              ignore_index=ignore_index, chunk_size=sizes[0], vocab_block=sizes[1])
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert rel_err(got, ref) < 1e-13
    g = torch.randn_like(ref)
    for a, r in zip(_grads(got, (x, w, b), g), _grads(ref, (x, w, b), g)):
        assert rel_err(a, r) < 1e-12


@pytest.mark.parametrize("bias", [True, False])
def test_nan_and_inf_in_later_chunks_propagate_like_torch(bias):
    """Six chunks of 4 tokens: a NaN input row in the third chunk and an inf one in the fifth
    (eight blocks of 5 classes in the backward). Their losses and dx rows are NaN, as torch's;
    dW and db are NaN as torch's are; every other row's loss and dx is the float64 unfused
    one."""
    x, w, b, t = _data(23, 13, 37, bias=bias, ignore=(0,))
    x.data[9, 4] = float("nan")
    x.data[17, 2] = float("inf")
    ref = F.cross_entropy(F.linear(x, w, b), t, reduction="none")
    got = lce(x, w, t, b, reduction="none", chunk_size=4, vocab_block=5)
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


@pytest.mark.parametrize("sizes", [(None, None), (97, 29)], ids=["default", "chunks11-blocks5"])
@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_low_precision_matches_unfused(dtype, reduction, sizes):
    """1023 tokens, 131 classes: the defaults take one chunk and one block on the CPU, so
    (97, 29) — 11 chunks and 5 blocks, each last one short — exercises the loops; one token in
    a hundred ignored with ignore_index=-1."""
    x, w, b, t = _data(1023, 19, 131, dtype=dtype, bias=True, ignore=range(5, 1023, 100),
                       ignore_index=-1)
    ref = F.cross_entropy(F.linear(x, w, b).float(), t, reduction=reduction, ignore_index=-1)
    got = lce(x, w, t, b, reduction=reduction, ignore_index=-1, chunk_size=sizes[0],
              vocab_block=sizes[1])
    assert got.dtype == dtype
    assert rel_err(got, ref) < TOL[dtype]
    g = torch.randn_like(ref)
    # float32 reference gradients (the unfused graph in float32 from the same 16-bit inputs)
    x32, w32, b32 = (v.detach().float().requires_grad_() for v in (x, w, b))
    ref32 = F.cross_entropy(F.linear(x32, w32, b32), t, reduction=reduction, ignore_index=-1)
    for a, r in zip(_grads(got, (x, w, b), g.to(got.dtype)), _grads(ref32, (x32, w32, b32), g)):
        assert a.dtype == dtype
        # plus what rounding the exact gradient to 16 bits alone costs: a small draw of g makes
        # the mean's dx float16 subnormals (|dx| ~ 1e-7), where no 16-bit result is closer
        assert rel_err(a, r) < TOL[dtype] + rel_err(r.to(dtype), r), rel_err(a, r)


@pytest.mark.parametrize("input_grad", [True, False], ids=["x-trainable", "x-frozen"])
def test_frozen_weight_with_a_trainable_bias_gives_the_bias_its_gradient(input_grad):
    """bfloat16, the weight frozen (``requires_grad=False``) and the bias trained: db (and dx)
    as the float32 unfused graph from the same inputs gives them."""
    x, w, b, t = _data(203, 19, 131, dtype=torch.bfloat16, ignore=(5,))
    w.requires_grad_(False)
    x.requires_grad_(input_grad)
    x32, w32, b32 = (v.detach().float().requires_grad_(v.requires_grad) for v in (x, w, b))
    ref = F.cross_entropy(F.linear(x32, w32, b32), t)
    got = lce(x, w, t, b, chunk_size=97, vocab_block=29)
    trained = [(x, x32)] * input_grad + [(b, b32)]
    grads = torch.autograd.grad(got, [v for v, _ in trained])
    expected = torch.autograd.grad(ref, [r for _, r in trained])
    for a, r in zip(grads, expected):
        assert a.dtype == torch.bfloat16
        tol = TOL[torch.bfloat16] + rel_err(r.bfloat16(), r)
        assert rel_err(a, r) < tol, rel_err(a, r)


@needs_layer_extension
def test_float16_weight_gradient_survives_a_small_incoming_gradient():
    """float16, an incoming gradient of 1e-3 (times 1 / 1000 tokens for the mean): folded into
    the float16 logits gradient the factor would underflow it (torch's own float16 unfused
    graph loses ~3% of dW that way); memkern applies it to each block's float32 dW, so dW and db
    stay within one float16 rounding of the float32 graph."""
    x, w, b, t = _data(1000, 19, 131, dtype=torch.float16, ignore=(5,))
    x32, w32, b32 = (v.detach().float().requires_grad_() for v in (x, w, b))
    ref = F.cross_entropy(F.linear(x32, w32, b32), t)
    got = lce(x, w, t, b, chunk_size=300, vocab_block=50)
    g = torch.tensor(1e-3)
    for a, r in list(zip(_grads(got, (x, w, b), g.half()), _grads(ref, (x32, w32, b32), g)))[1:]:
        assert rel_err(a, r) < 2e-3 + rel_err(r.half(), r), rel_err(a, r)


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


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
@pytest.mark.parametrize("as_tensor", [False, True], ids=["int", "tensor"])
def test_num_items_divides_the_sum(as_tensor, dtype):
    x, w, b, t = _data(17, 11, 29, ignore=(4,), ignore_index=7)
    ref = F.cross_entropy(F.linear(x, w, b), t, reduction="sum", ignore_index=7) / 40
    xs, ws, bs = (v.detach().to(dtype).requires_grad_() for v in (x, w, b))
    n = torch.tensor(40) if as_tensor else 40
    tol = 1e-13 if dtype == torch.float64 else TOL[dtype]
    g = torch.tensor(1.7, dtype=torch.float64)
    want = _grads(ref, (x, w, b), g)
    for reduction in ("sum", "mean"):  # with "mean" the count given replaces the token count
        got = lce(xs, ws, t, bs, reduction=reduction, num_items=n, ignore_index=7, chunk_size=5,
                  vocab_block=7)
        assert rel_err(got, ref) < tol
        for a, r in zip(_grads(got, (xs, ws, bs), g.to(dtype)), want):
            assert rel_err(a, r) < 10 * tol


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
def test_all_ignored_gives_nan_loss_and_zero_grads_like_torch(dtype):
    x, w, b, t = _data(5, 7, 11, dtype=dtype, ignore=range(5))
    got = lce(x, w, t, b, chunk_size=2, vocab_block=4)
    ref = F.cross_entropy(F.linear(x, w, b), t)
    assert torch.isnan(got) and torch.isnan(ref)
    a = _grads(got, (x, w, b), torch.tensor(1.0, dtype=dtype))
    r = _grads(ref, (x, w, b), torch.tensor(1.0, dtype=dtype))
    for u, v in zip(a, r):
        assert torch.equal(u, v) and float(u.abs().max()) == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
def test_frozen_weight_and_input_only_paths(dtype):
    x, w, b, t = _data(9, 7, 13)
    x16, w16 = x.detach().to(dtype), w.detach().to(dtype)
    x64, w64 = x16.double(), w16.double()
    tol = 1e-13 if dtype == torch.float64 else TOL[dtype]
    (gx,) = torch.autograd.grad(lce(x16.requires_grad_(), w16, t, chunk_size=4, vocab_block=5), x16)
    (rx,) = torch.autograd.grad(F.cross_entropy(F.linear(x64.requires_grad_(), w64), t), x64)
    assert rel_err(gx, rx) < tol
    x16.requires_grad_(False)
    (gw,) = torch.autograd.grad(lce(x16, w16.requires_grad_(), t, reduction="sum", chunk_size=4,
                                    vocab_block=5), w16)
    (rw,) = torch.autograd.grad(F.cross_entropy(F.linear(x64.detach(), w64.requires_grad_()), t,
                                                reduction="sum"), w64)
    assert rel_err(gw, rw) < tol
    with torch.no_grad():
        assert rel_err(lce(x16, w16, t), F.cross_entropy(F.linear(x64, w64), t)) < tol


@needs_layer_extension
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_second_backward_through_the_same_graph_raises(reduction, dtype):
    x, w, b, t = _data(9, 7, 13, dtype=dtype)
    loss = lce(x, w, t, b, reduction=reduction).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


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
    (dict(chunk_size=0), "chunk_size=0"),
    (dict(vocab_block=-2), "vocab_block=-2"),
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


@needs_layer_extension
def test_out_of_range_target_error_names_its_index():
    x, w, b, t = _data(3, 4, 5)
    with pytest.raises(ValueError, match=r"target\[1\] = 9"):
        lce(x, w, torch.tensor([0, 9, 1]))


# ----------------------------------------------------------------------------------------------
# logit soft-capping (Gemma 2's final_logit_softcapping): the loss of cap * tanh(logits / cap)


def _capped(x, w, b, cap):
    return cap * torch.tanh(F.linear(x, w, b) / cap)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("sizes", SIZES, ids=SIZE_IDS)
def test_softcap_matches_float64_reference(reduction, smoothing, sizes):
    # scaled up so that many logits lie in tanh's curved range: the cap matters
    x, w, b, t = _data(31, 13, 41, ignore=(0, 17, 30))
    x.data.mul_(4.0)
    cap = 3.5
    ref = F.cross_entropy(_capped(x, w, b, cap), t, reduction=reduction, label_smoothing=smoothing)
    got = lce(x, w, t, b, reduction=reduction, label_smoothing=smoothing, softcap=cap,
              chunk_size=sizes[0], vocab_block=sizes[1])
    uncapped = F.cross_entropy(F.linear(x, w, b), t, reduction=reduction, label_smoothing=smoothing)
    assert rel_err(uncapped, ref) > 1e-2  # the data exercises the cap
    assert rel_err(got, ref) < 1e-13
    g = torch.randn_like(ref)
    for a, r in zip(_grads(got, (x, w, b), g), _grads(ref, (x, w, b), g)):
        assert rel_err(a, r) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_softcap_low_precision_matches_float32_unfused(dtype):
    x, w, b, t = _data(259, 19, 131, dtype=dtype, ignore=(5,))
    x.data.mul_(3.0)
    x32, w32, b32 = (v.detach().float().requires_grad_() for v in (x, w, b))
    ref = F.cross_entropy(_capped(x32, w32, b32, 5.0), t)
    got = lce(x, w, t, b, softcap=5.0, chunk_size=100, vocab_block=50)
    assert got.dtype == dtype and rel_err(got, ref) < TOL[dtype]
    for a, r in zip(torch.autograd.grad(got, (x, w, b)), torch.autograd.grad(ref, (x32, w32, b32))):
        assert a.dtype == dtype and rel_err(a, r) < TOL[dtype], rel_err(a, r)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_nan_and_inf_propagate_like_torch(where):
    """A NaN input makes its token's loss NaN, an inf input too (its logits are +-inf), in the
    chunk and block where they fall; the other tokens are untouched."""
    x, w, b, t = _data(9, 5, 11)
    row = {"first": 0, "middle": 4, "last": 8}[where]
    x.data[row, 2] = float("nan")
    x.data[(row + 1) % 9, 1] = float("inf")
    for cap in (None, 4.0):
        logits = F.linear(x, w, b) if cap is None else _capped(x, w, b, cap)
        ref = F.cross_entropy(logits, t, reduction="none")
        got = lce(x, w, t, b, reduction="none", softcap=cap, chunk_size=2, vocab_block=3)
        assert torch.equal(torch.isnan(got), torch.isnan(ref))
        finite = ~torch.isnan(ref)
        assert rel_err(got[finite], ref[finite]) < 1e-13


@pytest.mark.parametrize("cap", [-1.0, float("inf"), float("nan")], ids=["negative", "inf", "nan"])
def test_softcap_argument_errors(cap):
    x, w, b, t = _data(3, 4, 5)
    with pytest.raises(ValueError, match="softcap="):
        lce(x, w, t, b, softcap=cap)


# ----------------------------------------------------------------------------------------------
# no host synchronisation, torch.compile, what is kept between forward and backward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("reduction,items", [("mean", False), ("mean", True), ("sum", True),
                                             ("sum", False), ("none", False)],
                         ids=["mean", "mean-num_items", "sum-num_items", "sum", "none"])
def test_no_host_read_in_forward_or_backward(reduction, items, dtype, monkeypatch):
    """No .item()/.cpu()/bool() of a tensor anywhere in the call and its backward, with ignored
    tokens, soft-capping and (or not) a tensor num_items (the spy sees every aten op the C++
    autograd and the Python Function run, and each row op as a whole)."""
    if not mk.compiled.has_cpu:
        pytest.skip("without the compiled extension the reference backend checks the targets' "
                    "range on the host (memkern.ops.cross_entropy._check_target_range)")
    x, w, b, t = _data(29, 7, 41, dtype=dtype, ignore=(3, 17), ignore_index=5)
    n = torch.tensor(31) if items else None
    with HostReadSpy(monkeypatch) as spy:
        loss = lce(x, w, t, b, reduction=reduction, ignore_index=5, num_items=n, softcap=9.0,
                   chunk_size=10, vocab_block=16)
        loss.backward(torch.ones_like(loss))
    assert x.grad is not None and w.grad is not None and b.grad is not None
    assert spy.reads == [], spy.reads


def test_the_spy_sees_a_host_read(monkeypatch):
    """The no-host-read test's oracle: the spy does catch a read made by the code it watches."""
    x, w, b, t = _data(5, 7, 11)
    with HostReadSpy(monkeypatch) as spy:
        int((t != -100).sum())
    assert spy.reads


COMPILERS = [pytest.param("cpu", "aot_eager", id="cpu-aot_eager"),
             pytest.param("cuda", "inductor", marks=pytest.mark.cuda, id="cuda-inductor")]


@pytest.mark.parametrize("device,compiler", COMPILERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compiled_matches_eager_and_float64_with_ignored_targets(reduction, dtype, device,
                                                                  compiler):
    """torch.compile(fullgraph=True) with a non-default ignore_index and ignored tokens (the
    case where Liger's loss goes wrong under compile): the compiled loss and gradients equal the
    eager ones and both match the float64 unfused graph."""
    torch._dynamo.reset()
    x, w, b, t = _data(37, 11, 53, dtype=dtype, ignore=(0, 5, 6, 36), ignore_index=2,
                       device=device)

    def f(x, w, b, t):
        return lce(x, w, t, b, reduction=reduction, ignore_index=2, chunk_size=8, vocab_block=16)

    compiled = torch.compile(f, fullgraph=True, backend=compiler)
    x64, w64, b64 = (v.detach().double().requires_grad_() for v in (x, w, b))
    ref = F.cross_entropy(F.linear(x64, w64, b64), t, reduction=reduction, ignore_index=2)
    g = torch.randn_like(ref)
    got = {name: fn(x, w, b, t) for name, fn in (("eager", f), ("compiled", compiled))}
    grads = {name: _grads(v, (x, w, b), g.to(dtype)) for name, v in got.items()}
    tol = TOL[dtype] if dtype != torch.float32 else 1e-5
    assert rel_err(got["compiled"], got["eager"]) < tol
    for a, c, r in zip(grads["eager"], grads["compiled"], _grads(ref, (x64, w64, b64), g)):
        assert rel_err(c, a) < tol and rel_err(a, r) < tol and rel_err(c, r) < tol


@needs_layer_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_kept_between_forward_and_backward_is_per_token_or_the_weight_gradient(dtype):
    """After the forward, what the graph holds: 16-bit (split) dx and the float32 log-sum-exp
    of each token — never a [tokens, classes] or (split) a [classes, hidden] tensor; float32
    (gradients in the forward) also the weight gradient that backward hands over."""
    from memkern.profile import allocation_stats
    N, H, V = 300, 16, 5000
    x, w, _, t = _data(N, H, V, dtype=dtype, bias=False, ignore=(7,))
    stats = allocation_stats(lambda: lce(x, w, t))
    loss = stats.result
    per_token = N * H * x.element_size() + N * 4
    weight_grad = V * H * w.element_size()
    if dtype == torch.bfloat16:
        assert stats.retained <= per_token + 1024, (stats.retained, per_token)
    else:
        assert stats.retained <= per_token + weight_grad + 1024, (stats.retained, per_token)
    loss.backward()
    assert w.grad.dtype == dtype and x.grad.dtype == dtype


@needs_layer_extension
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_recorded_saved_bytes_are_what_the_node_keeps(dtype, reduction, bias):
    """memkern.profile's recorders count what the node keeps for backward, the gradients it
    computed in forward and hands over included (saved variables, which the saved-tensor hooks
    see), counted by hand: float32 "mean" dx, dW (and db); split x, the int64 targets, the
    float32 log-sum-exp and dx; the parameters are not counted."""
    from memkern.profile import saved_bytes
    N, H, V = 37, 24, 53
    module = mk.nn.LinearCrossEntropy(H, V, bias=bias, reduction=reduction, dtype=dtype)
    x = torch.randn(N, H, dtype=dtype, requires_grad=True)
    t = torch.randint(0, V, (N,))
    if dtype == torch.float32 and reduction == "mean":
        kept = N * H * 4 + V * H * 4 + V * 4 * bias
    else:
        kept = 2 * N * H * x.element_size() + N * 8 + N * 4
    assert saved_bytes(module, x, t) == kept


# ----------------------------------------------------------------------------------------------
# the twins: C++ and Python, bit for bit


@needs_layer_extension
@pytest.mark.parametrize("statistics", [False, True], ids=["loss", "statistics"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cpp_and_python_loops_are_bit_identical(dtype, statistics):
    """The loop ops' C++ kernels (which the node runs) against their Python references in
    memkern.ops.linear_cross_entropy (which memkern.profile.plan runs): the same ATen calls in
    the same order, so the same results bit for bit; with ``statistics``, the per-token
    statistics and the backward with the entropy's term and the input gradient."""
    x, w, b, t = _data(41, 9, 67, dtype=dtype, ignore=(3, 40))
    x, w, b = x.detach(), w.detach(), b.detach()
    every = ROW_ENTROPY | ROW_IS_TOP1 | ROW_MEAN_LOGIT
    forward_args = (x, w, b, t, -100, 0.1, 16, True, dtype == torch.float32,
                    dtype == torch.float32, 6.0, every if statistics else 0)
    cpp_forward = torch.ops.memkern.linear_cross_entropy_forward(*forward_args)
    for a, p in zip(cpp_forward, lce_ops.forward_impl(*forward_args)):
        assert torch.equal(a, p)
    entropy = (cpp_forward[5][ENTROPY_ROW].contiguous(), torch.rand(41), True) if statistics else ()
    backward_args = (torch.rand(41), x, w, b, t, cpp_forward[1], -100, 0.1, 24, True, True, 6.0,
                     *entropy)
    for a, p in zip(torch.ops.memkern.linear_cross_entropy_backward(*backward_args),
                    lce_ops.backward_impl(*backward_args)):
        assert torch.equal(a, p)


@pytest.mark.skipif(not mk.compiled.has_cpu, reason="the compiled extension is not built")
def test_cpp_and_python_block_sizes_agree(monkeypatch):
    from memkern import _C
    shapes = [(1, 1, 1, 4), (23, 37, 13, 8), (4096, 32000, 512, 4), (16384, 50304, 768, 2),
              (4096, 128256, 4096, 2), (7, 1_000_003, 3, 2), (1 << 20, 64, 64, 2)]
    for n, v, h, size in shapes:
        for weight_grad in (False, True):
            for split in (False, True):
                args = (n, v, h, size, weight_grad, split)
                cpp = _C.linear_cross_entropy_block_sizes(*args)
                assert tuple(cpp) == lce_ops.block_sizes(*args)
    monkeypatch.setenv(lce_ops.CHUNK_ENV, "333")
    monkeypatch.setenv(lce_ops.VOCAB_BLOCK_ENV, "77")
    assert tuple(_C.linear_cross_entropy_block_sizes(*shapes[3], True, True)) == (333, 77)
    assert lce_ops.block_sizes(*shapes[3], True, True) == (333, 77)
    monkeypatch.setenv(lce_ops.VOCAB_BLOCK_ENV, "none")
    for sizes in (_C.linear_cross_entropy_block_sizes, lce_ops.block_sizes):
        with pytest.raises(ValueError, match="MEMKERN_LCE_VOCAB_BLOCK='none'"):
            sizes(*shapes[3], True, True)


def test_block_sizes_bound_the_blocks():
    """The rule, by hand: the backward block holds as many bytes as x (at least 8 MiB); the
    forward block adds the weight gradient when the backward computes it (split), else takes
    the larger of the two; multiples of 64 tokens and 128 classes."""
    MiB = 1 << 20
    # 16384 x 50304 x 768 bfloat16: x is 24 MiB -> 768 classes; 24 MiB + 73.7 MiB -> 1018 rows
    assert lce_ops.block_sizes(16384, 50304, 768, 2, True, True) == (960, 768)
    # no weight gradient: the forward block is x's size too
    assert lce_ops.block_sizes(16384, 50304, 768, 2, False, True) == (192, 768)
    # 4096 x 32000 x 512 float32, gradients in the forward: max(8 MiB, 62.5 MiB) -> 512 rows;
    # x is 8 MiB -> 512 classes
    assert lce_ops.block_sizes(4096, 32000, 512, 4, True, False) == (512, 512)
    # tiny: 8 MiB covers everything
    assert lce_ops.block_sizes(23, 37, 13, 8, True, True) == (23, 37)
    # 100 tokens at the GPT-2 vocab: the 8 MiB floor -> 83 rows -> 64; 41943 classes -> 41856
    assert 8 * MiB // (2 * 50304) == 83
    assert lce_ops.block_sizes(100, 50304, 64, 2, False, True) == (64, 41856)


# ----------------------------------------------------------------------------------------------
# CUDA: the C++ layer on the GPU (CUDA row kernels, cuBLAS GEMMs), against float64


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cuda_matches_float64(reduction, dtype):
    x, w, b, t = _data(4099, 64, 32003, dtype=dtype, device="cuda",
                       ignore=range(0, 4099, 97), ignore_index=11)
    x.data.mul_(2.0)
    n = torch.tensor(5000, device="cuda") if reduction == "sum" else None
    got = lce(x, w, t, b, reduction=reduction, ignore_index=11, num_items=n,
              label_smoothing=0.05, chunk_size=1000, vocab_block=3000)
    x64, w64, b64 = (v.detach().double().requires_grad_() for v in (x, w, b))
    ref = F.cross_entropy(F.linear(x64, w64, b64), t, ignore_index=11, label_smoothing=0.05,
                          reduction="sum" if n is not None else reduction)
    ref = ref / 5000 if n is not None else ref
    assert rel_err(got, ref) < TOL[dtype]
    g = torch.randn_like(ref)
    for a, r in zip(_grads(got, (x, w, b), g.to(dtype)), _grads(ref, (x64, w64, b64), g)):
        assert a.dtype == dtype and rel_err(a, r) < 2 * TOL[dtype]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cuda_peak_is_the_gradients_and_one_block(dtype):
    """On the GPU, forward + backward allocate no more above the inputs than the two gradients,
    one block of logits of the size block_sizes picks (16-bit: x's bytes in the backward, the
    weight gradient plus that in the forward), the per-token float32 loss and lse, and 1 MiB of
    small tensors; and after the forward the graph keeps per-token tensors (and, float32, the
    weight gradient) only."""
    N, H, V = 2049, 128, 50257
    x, w, _, t = _data(N, H, V, dtype=dtype, bias=False, device="cuda", ignore=(5,))
    size = x.element_size()
    grads = (N + V) * H * size
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = lce(x, w, t)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - start
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    chunk, vocab = lce_ops.block_sizes(N, V, H, size, True, dtype == torch.bfloat16)
    block = max(chunk * V, N * vocab) * size if dtype == torch.bfloat16 else chunk * V * size
    assert peak <= grads + block + 8 * N + (1 << 20), (peak, grads, block)
    if dtype == torch.bfloat16:
        assert kept <= N * H * size + 8 * N + 4096, kept
    else:
        assert kept <= (N + V) * H * size + 8 * N + 4096, kept


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cuda_no_host_sync(dtype):
    x, w, b, t = _data(1031, 32, 5003, dtype=dtype, device="cuda", ignore=(3, 500))
    n = torch.tensor(1000, device="cuda")
    lce(x, w, t, b, num_items=n).backward()  # warm-up: cuBLAS handles, allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for reduction in ("mean", "sum", "none"):
            loss = lce(x, w, t, b, reduction=reduction,
                       num_items=n if reduction == "sum" else None, chunk_size=300,
                       vocab_block=1000)
            loss.backward(torch.ones_like(loss))
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.cuda
def test_cuda_out_of_range_targets_do_not_crash():
    """On the GPU targets are not checked (that needs a host sync) and never used as an index:
    such a token's loss is its log-sum-exp (no one-hot term), its gradient the softmax."""
    x, w, b, t = _data(257, 16, 3001, device="cuda", dtype=torch.float32)
    t[5], t[100], t[256] = -7, 3001, 10**12
    loss = lce(x, w, t, b, reduction="none", chunk_size=64, vocab_block=1000)
    loss.sum().backward()
    torch.cuda.synchronize()
    z = F.linear(x.detach().double(), w.detach().double(), b.detach().double())
    bad = torch.tensor([5, 100, 256], device="cuda")
    assert rel_err(loss.detach()[bad], torch.logsumexp(z[bad], 1)) < 1e-5
    good = torch.ones(257, dtype=torch.bool, device="cuda")
    good[bad] = False
    ref = F.cross_entropy(z[good], t[good], reduction="none")
    assert rel_err(loss.detach()[good], ref) < 1e-5
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()
