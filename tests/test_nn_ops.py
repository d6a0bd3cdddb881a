"""The ops behind memkern.nn (memkern/ops/{activation,swiglu,dropout,norm,
linear_cross_entropy}.py; the cross-entropy row ops are test_nn_cross_entropy_ops.py's):
reference vs float64 torch math, Triton vs the reference (each test
twice: under TRITON_INTERPRET=1 on the CPU, and compiled for real on a GPU, marked cuda),
torch.library.opcheck on each op, and the argument checks.

Fresh random data every run (conftest prints the seed), odd sizes, outputs compared against an
oracle computed in float64 from the very inputs the op saw.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from compare import rel_err
from layer_oracle import norm64
from memkern import backend, ops
from memkern._extension import compiled
from memkern.ops import cross_entropy as ce
from memkern.ops.dropout import keep_mask, philox4x32

LOW = [pytest.param(d, id=str(d).removeprefix("torch."))
       for d in (torch.float32, torch.bfloat16, torch.float16)]
KINDS = ["gelu", "gelu_tanh", "relu", "silu"]
# Triton vs reference: fp32 agree to a few float32 ulps (different exp/erf); 16-bit outputs
# are both rounded once from float32 and may differ by one rounding step.
TRITON_TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}

# The interpreter evaluates exp() of large arguments in numpy, which warns on the (correct)
# overflow to inf.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

needs_triton = pytest.mark.skipif(not backend.runs_on("triton", torch.device("cpu")),
                                  reason="triton is not importable / TRITON_INTERPRET not set")



def _f64(*ts):
    return [t.double() for t in ts]


# ----------------------------------------------------------------------------------------------
# reference vs independent float64 math


def _act64(x, kind):
    if kind == "gelu":
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    if kind == "gelu_tanh":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    if kind == "relu":
        return torch.where(x > 0, x, torch.zeros_like(x))
    return x * torch.sigmoid(x)


@pytest.mark.parametrize("kind", KINDS)
def test_activation_reference_matches_float64_math(kind):
    x = torch.randn(7, 13, dtype=torch.float64) * 3
    g = torch.randn_like(x)
    assert rel_err(ops.act_forward.reference(x, kind), _act64(x, kind)) < 1e-14
    xr = x.clone().requires_grad_()
    (expected,) = torch.autograd.grad(_act64(xr, kind), xr, g)
    assert rel_err(ops.act_backward.reference(g, x, kind), expected) < 1e-13


def test_swiglu_reference_matches_float64_autograd():
    a = torch.randn(5, 31, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, 31, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, 31, dtype=torch.float64)
    h = a * torch.sigmoid(a) * b
    da, db = torch.autograd.grad(h, (a, b), g)
    assert rel_err(ops.swiglu_forward.reference(a.detach(), b.detach()), h) < 1e-15
    ra, rb = ops.swiglu_backward.reference(g, a.detach(), b.detach())
    assert rel_err(ra, da) < 1e-14 and rel_err(rb, db) < 1e-14


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_norm_reference_matches_float64_autograd(rms, affine):
    x = (torch.randn(9, 37, dtype=torch.float64) * 2 + 0.5).requires_grad_()
    w = (torch.randn(37, dtype=torch.float64) if affine else None)
    b = (torch.randn(37, dtype=torch.float64) if affine and not rms else None)
    params = [p.requires_grad_() for p in (w, b) if p is not None]
    if rms:
        y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)
        y = y * w if w is not None else y
    else:
        y = F.layer_norm(x, (37,), w, b, 1e-6)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x] + params, g)
    wd = None if w is None else w.detach()
    bd = None if b is None else b.detach()
    ry, mean, rstd = ops.norm_forward.reference(x.detach(), wd, bd, 1e-6, rms)
    assert rel_err(ry, y) < 1e-14
    assert mean.shape == ((0,) if rms else (9,)) and rstd.shape == (9,)
    dx, dw, db = ops.norm_backward.reference(g, x.detach(), wd, mean, rstd, rms)
    assert rel_err(dx, grads[0]) < 1e-12
    if affine:
        assert rel_err(dw, grads[1]) < 1e-13
        if not rms:
            assert rel_err(db, grads[2]) < 1e-13
    else:
        assert dw.numel() == 0 and db.numel() == 0


def test_linear_cross_entropy_ops_match_unfused_float64():
    """The forward op's loss, lse and gradients of the summed loss (23 tokens in chunks of 5,
    the last of 3), and the backward op's weight and bias gradients of a weighted sum (37
    classes in blocks of 4, the last of 1), against F.cross_entropy in float64."""
    x = torch.randn(23, 13, dtype=torch.float64, requires_grad=True)
    w = torch.randn(37, 13, dtype=torch.float64, requires_grad=True)
    b = torch.randn(37, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 37, (23,))
    t[-1] = -100
    logits = F.linear(x, w, b)
    per_row = F.cross_entropy(logits, t, reduction="none")
    gsum = torch.autograd.grad(per_row.sum(), (x, w, b), retain_graph=True)
    loss, lse, dx, dw, db, stats = ops.linear_cross_entropy_forward(
        x.detach(), w.detach(), b.detach(), t, -100, 0.0, 5, True, True, True)
    assert rel_err(loss, per_row) < 1e-14 and stats.numel() == 0  # no statistics asked
    assert rel_err(lse[:-1], torch.logsumexp(logits, 1)[:-1]) < 1e-14 and lse[-1] == 0
    for got, want in zip((dx, dw, db), gsum):
        assert rel_err(got, want) < 1e-13
    gl = torch.randn(23, dtype=torch.float64)
    grl = torch.autograd.grad(per_row, (w, b), gl)
    for got, want in zip(ops.linear_cross_entropy_backward(gl, x.detach(), w.detach(), b.detach(),
                                                           t, lse, -100, 0.0, 4, True, True), grl):
        assert rel_err(got, want) < 1e-13


def test_linear_cross_entropy_loop_statistics_and_entropy_grad_match_float64():
    """The forward loop's per-token statistics (23 tokens in chunks of 5, the last of 3: a tie
    for the maximum, a peaked row, a +inf logit in the later chunks) and the backward loop's
    gradients of ``g1 * loss + g2 * entropy`` (37 classes in blocks of 4, the last of 1: each
    block's logits gradient weighted for both, the input gradient summed across the blocks),
    against F.cross_entropy, argmax and the entropy of the softmax in float64."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(23, 13, dtype=torch.float64, generator=gen)
    w = torch.randn(37, 13, dtype=torch.float64, generator=gen)
    b = torch.randn(37, dtype=torch.float64, generator=gen)
    t = torch.randint(0, 37, (23,), generator=gen)
    # classes 9 and 34 tie, exactly (small integers: any order of the GEMM's sums)
    w[9] = w[34] = torch.randint(-3, 4, (13,), generator=gen).double()
    b[9] = b[34] = 0.5
    x[16] = x[18] = 2 * w[9]  # chunk 4: the tied maximum; the target at the first of the two
    t[16], t[18] = 9, 34  # ... and at the second
    x[17] *= 60  # a peaked row: entropy ~ 0
    t[-1] = -100
    every = ce.ROW_ENTROPY | ce.ROW_IS_TOP1 | ce.ROW_MEAN_LOGIT
    special = x.clone()
    special[21, 0] = float("inf")  # +inf and -inf logits: NaN as torch, argmax the first +inf
    for inputs in (x, special):
        loss, lse, _, _, _, stats = ops.linear_cross_entropy_forward(
            inputs, w, b, t, -100, 0.0, 5, False, False, False, 0.0, every)
        z = F.linear(inputs, w, b)
        valid = t != -100
        want = (torch.special.entr(torch.softmax(z, 1)).sum(1), (z.argmax(1) == t).double(),
                z.mean(1))
        for k, ref in zip((ce.ENTROPY_ROW, ce.IS_TOP1_ROW, ce.MEAN_LOGIT_ROW), want):
            ref = torch.where(valid, ref, 0.0)
            assert torch.equal(stats[k].isnan(), ref.isnan()), k
            assert rel_err(stats[k].nan_to_num(), ref.nan_to_num()) < 1e-13, k
        assert stats[ce.IS_TOP1_ROW, 16] == 1.0 and stats[ce.IS_TOP1_ROW, 18] == 0.0
        assert stats[ce.ENTROPY_ROW, 17] < 1e-3
    assert stats[ce.IS_TOP1_ROW, 21] == float(F.linear(special, w, b)[21].argmax() == t[21])
    assert torch.isnan(stats[ce.ENTROPY_ROW, 21]) and torch.isnan(loss[21])
    xr, wr, br = (a.clone().requires_grad_() for a in (x, w, b))
    z = F.linear(xr, wr, br)
    per_row = F.cross_entropy(z, t, reduction="none")
    entropy = -(torch.softmax(z, 1) * torch.log_softmax(z, 1)).sum(1)
    g1, g2 = torch.randn(23, dtype=torch.float64), torch.randn(23, dtype=torch.float64)
    g2[-1] = 0.0  # the ignored token's entropy has no gradient
    want = torch.autograd.grad((g1 * per_row + g2 * entropy).sum(), (xr, wr, br))
    _, lse, _, _, _, stats = ops.linear_cross_entropy_forward(
        x, w, b, t, -100, 0.0, 5, False, False, False, 0.0, ce.ROW_ENTROPY)
    got = ops.linear_cross_entropy_backward(g1, x, w, b, t, lse, -100, 0.0, 4, True, True, 0.0,
                                            stats[ce.ENTROPY_ROW].contiguous(), g2, True)
    for g, ref in zip((got[2], got[0], got[1]), want):
        assert rel_err(g, ref) < 1e-12


def test_dropout_reference_mask_and_scale():
    x = torch.randn(3, 1001, dtype=torch.float64)
    seed = torch.randint(0, 1 << 62, (), dtype=torch.int64)
    y = ops.dropout.reference(x, seed, 0.3)
    keep = keep_mask(seed, x.numel(), 0.3).view(x.shape)
    assert torch.equal(y[keep], x[keep] * (1 / 0.7))
    assert torch.equal(y[~keep], torch.zeros_like(y[~keep]))
    assert abs(keep.double().mean().item() - 0.7) < 0.03
    again = ops.dropout.reference(torch.randn_like(x), seed, 0.3)
    assert torch.equal(again != 0, keep), "the mask is a function of (seed, index) only"
    other = keep_mask(seed + 1, x.numel(), 0.3)
    assert not torch.equal(other, keep.view(-1))
    assert bool(keep_mask(seed, 10, 0.0).all()) and not bool(keep_mask(seed, 10, 1.0).any())


def test_philox_reference_known_answer():
    # Philox4x32-10 known-answer vector of Random123 (kat_vectors): counter 0, key 0.
    words = philox4x32(torch.tensor(0), torch.tensor([0]))
    assert [int(w) for w in words] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


@pytest.mark.skipif(not backend.runs_on("cpu", torch.device("cpu")), reason="memkern._C not built")
def test_cpu_dropout_equals_the_reference_over_three_of_its_chunks():
    """The reference draws its mask in chunks of _REFERENCE_CHUNK counters (4 elements each);
    over three of them (the last one short) it must still be the C++ kernel's mask, which
    computes each element's counter directly: a counter restarting at a chunk boundary would
    repeat the first chunk's mask. A NaN and an inf in the third chunk stay where they are
    kept and become 0 where they are dropped."""
    from memkern.ops.dropout import _REFERENCE_CHUNK

    numel = 2 * 4 * _REFERENCE_CHUNK + 4 * 77 + 3
    x = torch.randn(numel)
    x[numel - 5], x[numel - 100] = math.nan, math.inf
    seed = torch.randint(0, 1 << 62, (), dtype=torch.int64)
    y = torch.ops.memkern.dropout(x, seed, 0.37)
    want = ops.dropout.reference(x, seed, 0.37)
    assert torch.equal(y.view(torch.int32), want.view(torch.int32))
    third = slice(2 * 4 * _REFERENCE_CHUNK, numel)
    assert not torch.equal(y[third][:1000] != 0, y[:1000] != 0)  # not the first chunk's mask


@pytest.mark.skipif(not backend.runs_on("cpu", torch.device("cpu")), reason="memkern._C not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=str)
@pytest.mark.parametrize("numel", [1, 7, 1023, 65537])
@pytest.mark.parametrize("p", [0.0, 0.37, 0.999, 1.0])
def test_cpu_dropout_kernel_bit_identical_to_reference(numel, dtype, p):
    x = torch.randn(numel).mul(3).to(dtype)
    x[0], x[numel // 2], x[-1] = math.nan, math.inf, -math.inf
    seed = torch.randint(0, 1 << 62, (), dtype=torch.int64)
    y = torch.ops.memkern.dropout(x, seed, p)  # the C++ kernel (CPU dispatch key)
    want = ops.dropout.reference(x, seed, p)
    assert torch.equal(y.isnan(), want.isnan())  # kept NaN stays NaN, dropped NaN becomes 0
    assert torch.equal(y.nan_to_num(0.0), want.nan_to_num(0.0))
    # hand-written oracle: kept elements are x / (1 - p) (to the dtype's rounding), dropped 0
    keep = keep_mask(seed, numel, p)
    assert torch.equal(y != 0, keep & (x != 0))
    if p < 1.0 and bool(keep.any()):
        want_kept = x[keep].double() / (1 - p)
        finite = torch.isfinite(want_kept)
        assert torch.equal(y[keep].isnan(), want_kept.isnan())
        if bool(finite.any()):
            assert rel_err(y[keep][finite], want_kept[finite]) <= torch.finfo(dtype).eps


# ----------------------------------------------------------------------------------------------
# Triton kernels (interpreted on the CPU) vs the reference


def _triton(op, *args):
    with ops.force("triton"):
        return op(*args)


# Every Triton test runs twice: interpreted on the CPU (CI), and compiled for real on a GPU
# (marked cuda), so that on a GPU machine each kernel, dtype and shape is a test of its own.
DEVICES = [pytest.param("cpu", marks=needs_triton, id="interpreted"),
           pytest.param("cuda", marks=pytest.mark.cuda, id="cuda")]
# The wide shape on the GPU only: the interpreter takes seconds per call on it.
DEVICE_SHAPES = [pytest.param("cpu", (7, 131), marks=needs_triton, id="interpreted-7x131"),
                 pytest.param("cuda", (7, 131), marks=pytest.mark.cuda, id="cuda-7x131"),
                 pytest.param("cuda", (37, 4099), marks=pytest.mark.cuda, id="cuda-37x4099")]


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("device, shape", DEVICE_SHAPES)
def test_triton_activation_matches_reference(device, shape, kind, dtype):
    x = (torch.randn(shape, device=device) * 4).to(dtype)
    g = torch.randn(shape, device=device).to(dtype)
    rows, cols = shape
    x[0, 0], x[rows // 2, cols // 2], x[-1, -1] = math.nan, math.inf, -math.inf
    y = _triton(ops.act_forward, x, kind)
    ref = ops.act_forward.reference(x, kind)
    finite = torch.isfinite(ref)
    # torch's CPU erf-GELU returns NaN at +inf (its CUDA kernel, and the kernel here, give inf)
    quirk = torch.isposinf(x) if kind == "gelu" else torch.zeros_like(x, dtype=torch.bool)
    assert torch.equal(torch.isnan(y)[~quirk], torch.isnan(ref)[~quirk])
    assert bool(torch.isposinf(y[quirk]).all())
    assert rel_err(y[finite], ref[finite]) <= TRITON_TOL[dtype]
    dx = _triton(ops.act_backward, g, x, kind)
    rdx = ops.act_backward.reference(g, x, kind)
    finite = torch.isfinite(rdx) & torch.isfinite(x)
    assert rel_err(dx[finite], rdx[finite]) <= TRITON_TOL[dtype]
    at_nan = torch.isnan(x)  # NaN stays NaN; ReLU passes the gradient there, as torch does
    assert torch.equal(dx[at_nan].float().nan_to_num(7.0), rdx[at_nan].float().nan_to_num(7.0))


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("device, shape", DEVICE_SHAPES)
def test_triton_swiglu_matches_reference(device, shape, dtype):
    a, b, g = (torch.randn(shape, device=device).mul(3).to(dtype) for _ in range(3))
    got = _triton(ops.swiglu_forward, a, b)
    assert rel_err(got, ops.swiglu_forward.reference(a, b)) <= TRITON_TOL[dtype]
    for got, want in zip(_triton(ops.swiglu_backward, g, a, b),
                         ops.swiglu_backward.reference(g, a, b)):
        assert rel_err(got, want) <= TRITON_TOL[dtype]


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("numel", [1, 7, 1023, 4099])
@pytest.mark.parametrize("device", DEVICES)
def test_triton_dropout_bit_identical_to_reference(device, numel, dtype):
    x = torch.randn(numel, device=device).to(dtype)
    seed = torch.randint(0, 1 << 62, (), dtype=torch.int64, device=device)
    y = _triton(ops.dropout, x, seed, 0.37)
    assert torch.equal(y, ops.dropout.reference(x, seed, 0.37))


@pytest.mark.parametrize("rows", ["one-per-program", "several-per-program"])
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("device", DEVICES)
def test_triton_norm_matches_reference(device, rms, affine, dtype, rows):
    """The backward's programs each sum dW/db over a range of rows: with more rows than
    programs (several-per-program) that accumulation runs, and the last range is short."""
    from memkern.kernels.norm import _sm_count

    programs = 4 * _sm_count(torch.empty(0, device=device))  # what norm_backward launches
    n = 13 if rows == "one-per-program" else 3 * programs + 5
    x = (torch.randn(n, 67, device=device) * 2 + 1).to(dtype)
    w = torch.randn(67, device=device) if affine else None
    b = torch.randn(67, device=device) if affine and not rms else None
    dy = torch.randn(n, 67, device=device).to(dtype)
    y, mean, rstd = _triton(ops.norm_forward, x, w, b, 1e-5, rms)
    ry, rmean, rrstd = ops.norm_forward.reference(x, w, b, 1e-5, rms)
    assert rel_err(y, ry) <= TRITON_TOL[dtype]
    assert rel_err(rstd, rrstd) < 1e-6
    if not rms:
        assert rel_err(mean, rmean) < 1e-6
    got = _triton(ops.norm_backward, dy, x, w, rmean, rrstd, rms)
    want = ops.norm_backward.reference(dy, x, w, rmean, rrstd, rms)
    assert rel_err(got[0], want[0]) <= max(TRITON_TOL[dtype], 1e-5)
    if affine:
        assert rel_err(got[1], want[1]) < 1e-5 and rel_err(got[2], want[2]) < 1e-5


# ----------------------------------------------------------------------------------------------
# the C++ CPU norm kernels (csrc/cpu/norm.cpp) vs float64 math

needs_cpu_kernels = pytest.mark.skipif(not compiled.has_cpu,
                                       reason="the C++ CPU kernels are not built")
# Outputs in x's dtype: one rounding of a float32 result (float64: a few float64 ulps).
CPU_NORM_TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3,
                torch.float64: 1e-13}
DTYPES = LOW + [pytest.param(torch.float64, id="float64")]


def _norm_inputs(rows, D, dtype, affine, rms):
    x = (torch.randn(rows, D) * 2 + 0.5).to(dtype)
    wdtype = torch.float32 if affine == "float32" else dtype
    w = None if affine == "none" else (torch.randn(D) * 0.5 + 1).to(wdtype)
    b = None if w is None or rms else torch.randn(D).to(wdtype)
    return x, w, b, torch.randn(rows, D).to(dtype)


@needs_cpu_kernels
@pytest.mark.parametrize("rows", [1, 3 * 32 + 5], ids=["one-row", "several-chunks"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("affine", ["none", "same-dtype", "float32"])
def test_cpu_norm_kernels_match_float64(rms, affine, dtype, rows):
    """The C++ kernels through the dispatcher (the path memkern's norm layers take on the CPU)
    against float64 autograd of the same inputs: D odd, rows over several of the backward's
    fixed-size chunks of weight-gradient partial sums, a weight of x's dtype or float32."""
    x, w, b, dy = _norm_inputs(rows, 1031, dtype, affine, rms)
    stat_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    stat_tol = 1e-13 if dtype == torch.float64 else 1e-6
    y, mean, rstd = torch.ops.memkern.norm_forward(x, w, b, 1e-5, rms)
    y64, mean64, rstd64, (dx64, dw64, db64) = norm64(x, w, b, 1e-5, rms, dy)
    assert y.dtype == dtype and rstd.dtype == mean.dtype == stat_dtype
    assert rel_err(y, y64) <= CPU_NORM_TOL[dtype]
    assert rel_err(rstd, rstd64) < stat_tol
    if rms:
        assert mean.shape == (0,)
    else:
        assert rel_err(mean, mean64) < stat_tol
    dx, dw, db = torch.ops.memkern.norm_backward(dy, x, w, mean, rstd, rms)
    assert dx.dtype == dtype
    assert rel_err(dx, dx64) <= max(CPU_NORM_TOL[dtype], 1e-5)
    if w is None:
        assert dw.numel() == 0 and db.numel() == 0
        return
    assert dw.dtype == db.dtype == stat_dtype
    assert rel_err(dw, dw64) < max(stat_tol, 1e-5)
    assert rel_err(db, dy.double().sum(0)) < max(stat_tol, 1e-5)  # dy.sum(0) even without a bias
    if b is not None:
        assert rel_err(db, db64) < max(stat_tol, 1e-5)


@needs_cpu_kernels
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_cpu_norm_kernels_keep_a_non_finite_value_in_its_row(rms):
    """A NaN or inf input leaves a non-finite value in its own row (and a NaN makes the whole
    weight gradient, a sum over rows, NaN); every other row is exactly what it is without the
    two rows."""
    x, w, b, dy = _norm_inputs(70, 67, torch.float32, "same-dtype", rms)
    x[3, 5], x[40, 0] = float("nan"), float("inf")
    y, mean, rstd = torch.ops.memkern.norm_forward(x, w, b, 1e-5, rms)
    dx, dw, db = torch.ops.memkern.norm_backward(dy, x, w, mean, rstd, rms)
    bad = torch.zeros(70, dtype=torch.bool)
    bad[[3, 40]] = True
    for out in (y, dx):
        assert not out[bad].isfinite().all(dim=1).any(), "each such row holds a non-finite value"
    assert not dw.isfinite().any() and db.isfinite().all()  # the NaN row's sum is NaN everywhere
    y_ok, mean_ok, rstd_ok = torch.ops.memkern.norm_forward(x[~bad], w, b, 1e-5, rms)
    dx_ok, _, _ = torch.ops.memkern.norm_backward(dy[~bad], x[~bad], w, mean_ok, rstd_ok, rms)
    assert torch.equal(y[~bad], y_ok) and torch.equal(rstd[~bad], rstd_ok)
    assert torch.equal(dx[~bad], dx_ok)


NORM_BACKWARD_KERNELS = [pytest.param("cpu", marks=needs_cpu_kernels, id="cpp"),
                         pytest.param("triton", marks=needs_triton, id="triton-interpreted")]


@pytest.mark.parametrize("kernel", NORM_BACKWARD_KERNELS)
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_norm_backward_sums_a_later_rows_non_finite_gradient(kernel, rms):
    """The weight and bias gradients are sums over rows in a loop: the C++ kernel's tasks of
    32 rows, the Triton kernel's programs of 5 rows (70 rows on the CPU). A NaN and an inf in
    dy, each in a later trip of both loops (row 67: the third task, its fourth row; the
    Triton program of rows 65-69, its third), reach their columns of dw and db as in float64
    autograd, and only their own rows of dx; everything else is as finite as the oracle."""
    x, w, b, dy = _norm_inputs(70, 67, torch.float32, "same-dtype", rms)
    dy[67, 7], dy[48, 2] = float("nan"), float("inf")
    with backend.force(kernel):
        y, mean, rstd = ops.norm_forward(x, w, b, 1e-5, rms)
        dx, dw, db = ops.norm_backward(dy, x, w, mean, rstd, rms)
    _, _, _, (dx64, dw64, db64) = norm64(x, w, b, 1e-5, rms, dy)
    for name, got, want in (("dw", dw, dw64), ("db", db, dy.double().sum(0))):
        assert torch.equal(got.isnan(), want.isnan()), name
        assert torch.equal(got.isinf(), want.isinf()), name
        assert want[7].isnan() and want[2].isinf() and want.isfinite().sum() == 65, name
        finite = want.isfinite()
        assert torch.equal(got[~finite & ~want.isnan()], want[~finite & ~want.isnan()].float())
        assert rel_err(got[finite], want[finite]) < 1e-5, name
    bad = torch.zeros(70, dtype=torch.bool)
    bad[[48, 67]] = True
    assert not dx[bad].isfinite().any(), "the two rows hold no finite value"
    assert rel_err(dx[~bad], dx64[~bad]) < 1e-5


@needs_cpu_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_cpu_activation_kernels_match_float64(kind, dtype):
    """act_forward/act_backward through the dispatcher on the CPU against float64 math and
    autograd of the same inputs, NaN included (it stays NaN; ReLU's gradient at NaN is 0)."""
    x = (torch.randn(37, 129) * 3).to(dtype)
    g = torch.randn(37, 129).to(dtype)
    x[4, 9] = float("nan")
    x64 = x.double().requires_grad_()
    y64 = _act64(x64, kind)
    (dx64,) = torch.autograd.grad(y64, x64, g.double())
    y = torch.ops.memkern.act_forward(x, kind)
    dx = torch.ops.memkern.act_backward(g, x, kind)
    finite = x.isfinite()
    assert y.dtype == dx.dtype == dtype
    assert y[4, 9].isnan()
    assert dx[4, 9] == g[4, 9] if kind == "relu" else dx[4, 9].isnan()  # torch's convention
    tol = CPU_NORM_TOL[dtype] if dtype != torch.float64 else 1e-12
    assert rel_err(y[finite], y64.detach()[finite]) <= tol
    assert rel_err(dx[finite], dx64[finite]) <= max(tol, 1e-5 if dtype == torch.float32 else tol)


@needs_cpu_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_swiglu_kernels_match_float64(dtype):
    """swiglu_forward/backward through the dispatcher on the CPU against float64 autograd of
    silu(gate) * up; an odd size over several parallel tasks; NaN/inf propagate."""
    n = 3 * 2**15 + 11
    gate, up, g = (torch.randn(n) * 3).to(dtype), torch.randn(n).to(dtype), torch.randn(n).to(dtype)
    gate[5], up[2**15 + 1] = float("nan"), float("inf")
    a64, b64 = gate.double().requires_grad_(), up.double().requires_grad_()
    h64 = F.silu(a64) * b64
    da64, db64 = torch.autograd.grad(h64, (a64, b64), g.double())
    h = torch.ops.memkern.swiglu_forward(gate, up)
    da, db = torch.ops.memkern.swiglu_backward(g, gate, up)
    assert h.dtype == da.dtype == db.dtype == dtype
    assert torch.equal(h.isnan(), h64.isnan()) and torch.equal(h.isinf(), h64.isinf())
    ok = h64.detach().isfinite() & da64.isfinite() & db64.isfinite()
    tol = CPU_NORM_TOL[dtype] if dtype != torch.float64 else 1e-12
    assert rel_err(h[ok], h64.detach()[ok]) <= tol
    assert rel_err(da[ok], da64[ok]) <= max(tol, 1e-5 if dtype == torch.float32 else tol)
    assert rel_err(db[ok], db64[ok]) <= max(tol, 1e-5 if dtype == torch.float32 else tol)
    assert da[5].isnan() and db[5].isnan()


# ----------------------------------------------------------------------------------------------
# opcheck: schema, fake implementation, aliasing — for every nn op


def _opcheck_cases():
    x = torch.randn(5, 17)
    g = torch.randn(5, 17)
    seed = torch.tensor(12345, dtype=torch.int64)
    y, mean, rstd = ops.norm_forward.reference(x, torch.randn(17), torch.randn(17), 1e-5, False)
    _, _, rrstd = ops.norm_forward.reference(x, torch.randn(17), None, 1e-5, True)
    t = torch.randint(0, 17, (5,))
    w = torch.randn(11, 17)
    tt = torch.randint(0, 11, (5,))
    return [
        ("act_forward", (x, "gelu_tanh")),
        ("act_backward", (g, x, "silu")),
        ("swiglu_forward", (x, g)),
        ("swiglu_backward", (g, x, g.clone())),
        ("dropout", (x, seed, 0.25)),
        ("norm_forward", (x, torch.randn(17), torch.randn(17), 1e-5, False)),
        ("norm_forward", (x.bfloat16(), torch.randn(17), None, 1e-5, True)),  # float32 weight
        ("norm_backward", (g, x, torch.randn(17), mean, rstd, False)),
        ("norm_backward", (g, x, None, torch.empty(0), rrstd, True)),
        ("cross_entropy_rows_", (torch.randn(5, 17), t, None, -100, 0.1, True)),
        ("cross_entropy_rows_", (torch.randn(5, 17), t, torch.randn(5), -100, 0.0, True, 3.0)),
        ("cross_entropy_block_grad_", (torch.randn(5, 7), torch.randn(5), t, torch.randn(5), 4,
                                       17, -100, 0.1, 2.0)),
        ("linear_cross_entropy_forward", (x, w, torch.randn(11), tt, -100, 0.0, 2, True, True,
                                          True)),
        ("linear_cross_entropy_backward", (torch.randn(5), x, w, None, tt, torch.randn(5), -100,
                                           0.0, 3, True, True)),
        ("linear_cross_entropy_forward", (x, w, None, tt, -100, 0.1, 3, True, True, False, 2.5)),
        ("cross_entropy_rows_", (torch.randn(5, 17), t, None, -100, 0.0, True, 0.0,
                                 ce.ROW_ENTROPY | ce.ROW_IS_TOP1 | ce.ROW_MEAN_LOGIT,
                                 torch.zeros(3, 5))),
        ("cross_entropy_block_grad_", (torch.randn(5, 7), torch.randn(5), t, torch.randn(5), 4,
                                       17, -100, 0.0, 0.0, torch.rand(5), torch.randn(5))),
        ("linear_cross_entropy_forward", (x, w, None, tt, -100, 0.0, 2, True, False, False, 0.0,
                                          ce.ROW_ENTROPY | ce.ROW_IS_TOP1)),
        ("linear_cross_entropy_backward", (torch.randn(5), x, w, torch.randn(11), tt,
                                           torch.randn(5), -100, 0.0, 3, True, True, 0.0,
                                           torch.rand(5), torch.randn(5), True)),
    ]


@pytest.mark.parametrize("name,args", _opcheck_cases(),
                         ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_opcheck(device, name, args):
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(getattr(torch.ops.memkern, name).default, args)


def test_every_nn_op_is_opchecked():
    assert {op.name for op in ops.NN_OPS} == {name for name, _ in _opcheck_cases()}


def _layer_opcheck_cases():
    """The layer ops, with inputs that need gradients: opcheck also runs their C++ autograd
    (the Autograd-key kernel) eagerly and traced by AOTAutograd, against each other."""
    def leaf(*shape, dtype=torch.float32):
        return torch.randn(*shape, dtype=dtype, requires_grad=True)

    x = leaf(2, 3, 17)
    return [
        ("linear_layer", (x, leaf(11, 17), leaf(11), False)),
        ("linear_layer", (x, leaf(17, 11), None, True)),
        ("norm_layer", (x, leaf(17), leaf(17), 1, 1e-5, False)),
        ("norm_layer", (x, leaf(17), None, 1, 1e-6, True)),
        ("modulated_norm_layer", (x, leaf(2, 17), leaf(2, 17), 1e-6)),
        ("modulated_norm_layer", (leaf(3, 17, dtype=torch.float64),
                                  leaf(3, 17, dtype=torch.float64),
                                  leaf(3, 17, dtype=torch.float64), 1e-5)),
        ("mlp_layer", (x, leaf(13, 17), leaf(13), leaf(11, 13), None, "gelu", "activation",
                       False)),
        ("mlp_layer", (x, leaf(17, 13), None, leaf(13, 11), leaf(11), "silu", "full", True)),
        ("swiglu_layer", (x, leaf(13, 17), None, leaf(13, 17), leaf(13), leaf(11, 13), None,
                          "none")),
        ("dropout_layer", (x, torch.tensor(12345, dtype=torch.int64), 0.25)),
        ("swiglu_unit_layer", (leaf(2, 3, 13), leaf(2, 3, 13))),
        ("lora_layer", (leaf(2, 3, 11), x, leaf(5, 17), leaf(11, 5), leaf(11), 0.5, 0.25,
                        torch.tensor(12345, dtype=torch.int64))),
        ("lora_layer", (leaf(2, 3, 11), x, leaf(5, 17), leaf(11, 5), None, 2.0, 0.0, None)),
        ("linear_cross_entropy_layer", (leaf(6, 17), leaf(11, 17), leaf(11),
                                        torch.randint(0, 11, (6,)), None, None, "mean", -100,
                                        0.1, 4, 8, 0.0)),
        ("linear_log_prob_layer", (leaf(6, 17), leaf(11, 17), leaf(11),
                                   torch.randint(0, 11, (6,)), ce.ROW_ENTROPY | ce.ROW_MEAN_LOGIT,
                                   -100, 4, 8, 0.0)),
    ]


@pytest.mark.parametrize("name,args", _layer_opcheck_cases(),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_layer_op_opcheck(name, args):
    if not compiled.has_cpu:
        pytest.skip("the layer ops' kernels are the compiled extension's")
    torch.library.opcheck(getattr(torch.ops.memkern, name).default, args)


def test_every_layer_op_is_opchecked():
    layer_ops = {name for name in ops.__all__ if name.endswith("_layer")}
    assert layer_ops == {name for name, _ in _layer_opcheck_cases()}


# ----------------------------------------------------------------------------------------------
# argument checks: the error names the argument and says what to do


@pytest.mark.parametrize("call,match", [
    (lambda: ops.act_forward(torch.randn(3), "tanh"), "kind='tanh'"),
    (lambda: ops.act_backward(torch.randn(3), torch.randn(4), "gelu"), "grad has shape"),
    (lambda: ops.act_forward(torch.randn(4, 3).t(), "gelu"), "contiguous"),
    (lambda: ops.swiglu_forward(torch.randn(3), torch.randn(3, dtype=torch.float16)),
     "up has dtype"),
    (lambda: ops.dropout(torch.randn(3), torch.tensor(1.0), 0.5), "seed must be an int64"),
    (lambda: ops.dropout(torch.randn(3), torch.tensor(1), 1.5), "p=1.5"),
    (lambda: ops.norm_forward(torch.randn(3, 4, 5), None, None, 1e-5, False), "x must be 2-D"),
    (lambda: ops.norm_forward(torch.randn(3, 4), torch.randn(5), None, 1e-5, False),
     "weight has shape"),
    (lambda: ops.norm_forward(torch.randn(3, 4), torch.randn(4), torch.randn(4), 1e-5, True),
     "takes no bias"),
    (lambda: ops.linear_cross_entropy_forward(torch.randn(3, 4), torch.randn(5, 6), None,
                                              torch.tensor([0, 1, 2]), -100, 0.0, 2, True, True,
                                              True),
     "same H"),
    (lambda: ops.linear_cross_entropy_forward(torch.randn(3, 4).bfloat16(),
                                              torch.randn(5, 4).bfloat16(), None,
                                              torch.tensor([0, 1, 2]), -100, 0.0, 2, True,
                                              True, False),
     "compute 16-bit weight gradients with linear_cross_entropy_backward"),
])
def test_errors_name_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()
