"""The compiled kernels of the layer ops — dropout, SwiGLU, LayerNorm/RMSNorm, the activations —
on the CPU (csrc/cpu) and on CUDA (csrc/cuda, csrc/any_device), through the dispatcher.

The CPU and CUDA kernels share their per-element and per-row math (csrc/cuda/kernels/*_math.h),
so the CPU cases here test the math a GPU runs; the ``cuda`` cases test the GPU's loops,
indexing and reductions against the same oracles, and against the CPU kernel (bit for bit for
the dropout masks). Oracles: float64 torch (autograd of the definitions, layer_oracle.py), the
Python reference of the dropout mask (itself tied to the Random123 known-answer vector in
test_nn_ops.py), and a known-answer vector through each kernel. Sizes are odd and large enough
for three or more trips of every loop (the CPU's 16-lane row sums, the GPU's thread loop over a
row and grid-stride loops), with NaN/inf or the row's largest value in a later trip.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from compare import rel_err
from layer_oracle import norm64
from memkern import ops
from memkern._extension import compiled
from memkern.ops.dropout import keep_mask

DEVICES = [
    pytest.param("cpu", id="cpu", marks=pytest.mark.skipif(
        not compiled.has_cpu, reason="the C++ CPU kernels are not built")),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not compiled.has_cuda, reason="memkern._C was built without its CUDA kernels")]),
]
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch."))
          for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)]
# An output of x's dtype is one rounding of a float32 result (float64: a few ulps of a float64
# one); float32 results built from exp/sqrt/division carry a few float32 ulps more.
TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float64: 1e-12}
GRAD_TOL = {**TOL, torch.float32: 1e-5}

# Elements past which the CUDA elementwise kernels' grids stride (at most 8 blocks of 256
# threads per multiprocessor, 132 on an H100/H200; the SwiGLU kernels take 4 elements per
# thread, the dropout kernel 4 per Philox counter): three times that, and some.
GRID_STRIDE_3 = 3 * 132 * 8 * 256 * 4 + 13


# ----------------------------------------------------------------------------------------------
# dropout


# Philox4x32-10 known-answer vector of Random123 (kat_vectors): counter 0, key 0.
PHILOX_KAT = (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_kernel_philox_known_answer(device):
    """Seed 0, four elements: element k's mask word is word k of counter 0. At p = w / 2**32
    the threshold is w itself, so the element is kept exactly when its word is >= w: kept at
    the published word, dropped one above it."""
    x = torch.ones(4, device=device)
    seed = torch.zeros((), dtype=torch.int64, device=device)
    for k, word in enumerate(PHILOX_KAT):
        kept = torch.ops.memkern.dropout(x, seed, word / 2**32)
        dropped = torch.ops.memkern.dropout(x, seed, (word + 1) / 2**32)
        assert kept[k] != 0 and dropped[k] == 0, f"word {k} of counter 0 is not {word:#x}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [0, 1, 7, 1023, 65537, GRID_STRIDE_3])
@pytest.mark.parametrize("p", [0.0, 0.37, 1.0])
@pytest.mark.parametrize("device", DEVICES)
def test_dropout_kernel_bit_identical_to_reference(device, numel, dtype, p):
    """The mask against the Python reference's (computed on the CPU from the same seed), the
    kept values against x / (1 - p) as the contract rounds it; NaN/inf first, middle, last."""
    if device == "cpu" and numel == GRID_STRIDE_3:
        pytest.skip("the CPU kernel has no grid; 65537 covers its parallel tasks")
    x = torch.randn(numel, dtype=torch.float64).mul(3).to(dtype)
    if numel:
        x[0], x[numel // 2], x[-1] = math.nan, math.inf, -math.inf
    seed = torch.randint(0, 1 << 62, (), dtype=torch.int64)
    y = torch.ops.memkern.dropout(x.to(device), seed.to(device), p).cpu()
    keep = keep_mask(seed, numel, p)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y[~keep], torch.zeros_like(y[~keep])), "dropped: 0, even NaN/inf"
    # the contract: kept = x * (1 / (1 - p)), multiplied in float32 (float64 for float64)
    # with the scale rounded to that type, then rounded once to x's dtype
    math_type = torch.float64 if dtype == torch.float64 else torch.float32
    scale = torch.tensor(0.0 if p >= 1.0 else 1 / (1 - p), dtype=math_type)
    want = (x[keep].to(math_type) * scale).to(dtype)
    assert torch.equal(y[keep].isnan(), want.isnan())
    assert torch.equal(y[keep].nan_to_num(0.0), want.nan_to_num(0.0))


@pytest.mark.cuda
@pytest.mark.skipif(not (compiled.has_cuda and compiled.has_cpu), reason="needs both kernels")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_dropout_equals_the_cpu_kernel(dtype):
    """Same seed, same mask and values on both devices, bit for bit; the seed stays on the
    device (the kernel reads it there)."""
    x = torch.randn(3, 70001, dtype=torch.float64).to(dtype)
    seed = torch.randint(0, 1 << 62, (), dtype=torch.int64)
    on_gpu = torch.ops.memkern.dropout(x.cuda(), seed.cuda(), 0.1)
    assert torch.equal(on_gpu.cpu(), torch.ops.memkern.dropout(x, seed, 0.1))


# ----------------------------------------------------------------------------------------------
# SwiGLU


def _swiglu64(gate, up, grad):
    a64, b64 = gate.double().requires_grad_(), up.double().requires_grad_()
    h64 = F.silu(a64) * b64
    da64, db64 = torch.autograd.grad(h64, (a64, b64), grad.double())
    return h64.detach(), da64, db64


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0, 5), (1, 1), (37, 129), (GRID_STRIDE_3,)], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_kernels_match_float64(device, shape, layout, dtype):
    """swiglu_forward / backward against float64 autograd of silu(gate) * up; NaN/inf first,
    middle and last (NaN propagates, inf * 0 is NaN as in float64); a transposed input is
    taken as its values (the kernels copy it contiguous first)."""
    if device == "cpu" and len(shape) == 1:
        pytest.skip("the CPU kernel has no grid; test_nn_ops covers its parallel tasks")
    gate, up, grad = (torch.randn(shape, dtype=torch.float64).mul(s).to(dtype) for s in (3, 1, 1))
    n = gate.numel()
    if n == 1:  # one element is its own norm: away from silu's derivative's zero (gate -1.28)
        gate.abs_().add_(0.1)
    if n >= 3:
        gate.view(-1)[[0, n // 2, n - 1]] = torch.tensor([math.nan, math.inf, -math.inf]).to(dtype)
    if layout == "transposed" and gate.dim() == 2:  # the same values, column-major in memory
        gate, up, grad = (t.t().contiguous().t() for t in (gate, up, grad))
    h64, da64, db64 = _swiglu64(gate, up, grad)
    h = torch.ops.memkern.swiglu_forward(gate.to(device), up.to(device)).cpu()
    da, db = (t.cpu() for t in torch.ops.memkern.swiglu_backward(
        grad.to(device), gate.to(device), up.to(device)))
    assert h.dtype == da.dtype == db.dtype == dtype and h.shape == gate.shape
    if n == 0:
        return
    h64_r = h64.to(dtype)  # where float64 overflows the dtype, both must be inf
    for got, want in ((h, h64), (da, da64), (db, db64)):
        assert torch.equal(got.isnan(), want.to(dtype).isnan())
    ok = h64_r.isfinite() & da64.to(dtype).isfinite() & db64.to(dtype).isfinite()
    assert rel_err(h[ok], h64[ok]) <= TOL[dtype]
    assert rel_err(da[ok], da64[ok]) <= GRAD_TOL[dtype]
    assert rel_err(db[ok], db64[ok]) <= GRAD_TOL[dtype]
    assert torch.equal(h.isinf(), h64_r.isinf())


# ----------------------------------------------------------------------------------------------
# LayerNorm / RMSNorm

# Row widths: the CPU sums a row in 16 lanes; the CUDA general path gives each row up to 512
# threads (about D / 4) that loop over the row, so 4099 takes 9 trips there and 257 trips on
# the CPU. The CUDA vector path (a whole number of 16-byte vectors per row: D % 8 == 0 here)
# holds a row in 1, 2 or 4 vectors per thread, its backward from 256 vectors: 1024 in one
# (float32: 256 vectors, the backward's one-slot kernel; 16-bit: the forward's, the general
# backward), 2056 in two (257 bfloat16 vectors on 160 threads, 514 float32 on 288: part-used
# warps), 6152 in two (bfloat16, float16) or four (float32), 12296 in four (bfloat16,
# float16; float32 takes the general path there). These run on CUDA only: the CPU kernels
# have no such path, and their loops are covered by WIDTHS.
WIDTHS = [1, 67, 4099]
VECTOR_WIDTHS = [1024, 2056, 6152, 12296]
NORM_SHAPES = [pytest.param(dev.values[0], D, marks=dev.marks, id=f"{dev.id}-{D}")
               for dev in DEVICES for D in WIDTHS + (VECTOR_WIDTHS if dev.id == "cuda" else [])]


def _norm_case(rows, D, dtype, affine, rms):
    x = (torch.randn(rows, D, dtype=torch.float64) * 2 + 0.5).to(dtype)
    wdtype = {"same-dtype": dtype, "float32": torch.float32, "bfloat16": torch.bfloat16}.get(affine)
    w = None if affine == "none" else (torch.randn(D) * 0.5 + 1).to(wdtype)
    b = None if w is None or rms else torch.randn(D).to(wdtype)
    dy = torch.randn(rows, D, dtype=torch.float64).to(dtype)
    return x, w, b, dy


def _dev(t, device):
    return None if t is None else t.to(device)


@pytest.mark.parametrize("rows", [0, 3, 9001], ids=["no-rows", "3-rows", "9001-rows"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("affine", ["none", "same-dtype", "float32", "bfloat16"])
@pytest.mark.parametrize("device, D", NORM_SHAPES)
def test_norm_kernels_match_float64(device, affine, rms, dtype, D, rows):
    """norm_forward / norm_backward against float64 autograd. 9001 rows: more rows than the
    CUDA row grids hold at once (they stride), and the weight gradient's 256 chunks of 36 rows
    (summed in 8 lanes, 5 trips each, on the general path; the vector path's block of a chunk
    takes its 36 rows in turn, loading the next while it reduces one); a weight of x's dtype,
    of float32, or of another dtype (converted to the math type)."""
    if rows == 9001 and D > 2056:
        pytest.skip("9001 rows this wide are slow in float64 autograd; 9001 x 67 and "
                    "9001 x 2056 cover the chunks")
    x, w, b, dy = _norm_case(rows, D, dtype, affine, rms)
    stat_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    stat_tol = 1e-12 if dtype == torch.float64 else 2e-6
    y, mean, rstd = (t.cpu() for t in torch.ops.memkern.norm_forward(
        x.to(device), _dev(w, device), _dev(b, device), 1e-5, rms))
    assert y.dtype == dtype and rstd.dtype == mean.dtype == stat_dtype
    assert rstd.shape == (rows,) and mean.shape == ((0,) if rms else (rows,))
    dx, dw, db = (t.cpu() for t in torch.ops.memkern.norm_backward(
        dy.to(device), x.to(device), _dev(w, device), mean.to(device), rstd.to(device), rms))
    assert dx.dtype == dtype and dx.shape == x.shape
    assert dw.shape == db.shape == ((0,) if w is None else (D,))
    if w is not None:
        assert dw.dtype == db.dtype == stat_dtype
    if rows == 0:
        if w is not None:
            assert torch.equal(dw, torch.zeros(D, dtype=stat_dtype)) and torch.equal(db, dw)
        return
    y64, mean64, rstd64, (dx64, _, _) = norm64(x, w, b, 1e-5, rms, dy)
    if D == 1 and not rms:  # x - mean is exactly 0: y = b, dx = 0 in any precision
        assert torch.equal(dx, torch.zeros_like(dx))
    elif D == 1:  # dx = rstd dy (1 - xhat^2) with xhat^2 ~ 1: bounded by the terms' size
        scale = (dy.double().abs() * rstd64[:, None]).max()
        assert (dx.double() - dx64).abs().max() <= GRAD_TOL[dtype] * 10 * scale
    else:
        assert rel_err(dx, dx64) <= GRAD_TOL[dtype] * 10
    assert rel_err(y, y64) <= TOL[dtype] * 2
    assert rel_err(rstd, rstd64) <= stat_tol
    if not rms:
        assert rel_err(mean, mean64) <= stat_tol
    if w is not None:  # sums over rows, against the sums of the terms' magnitudes
        xhat64 = (x.double() - (0 if rms else mean64[:, None])) * rstd64[:, None]
        for got, terms in ((dw, dy.double() * xhat64), (db, dy.double())):
            err = (got.double() - terms.sum(0)).abs() / terms.abs().sum(0).clamp_min(1e-30)
            assert err.max() <= max(stat_tol, 1e-5)


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("device, D, nan_col, big_col", [
    *(pytest.param(dev.values[0], 4099, 3001, 2777, marks=dev.marks, id=dev.id)
      for dev in DEVICES),
    *(pytest.param(dev.values[0], 6152, 6000, 4000, marks=dev.marks, id=f"{dev.id}-vector")
      for dev in DEVICES if dev.id == "cuda")])
def test_norm_kernels_non_finite_and_largest_value_in_a_late_trip(device, D, nan_col, big_col,
                                                                    rms):
    """Rows of D: row 1 has NaN at column nan_col and row 2 +inf at the last column, row 3 its
    largest value, 1e4, at column big_col. 4099: the CUDA general path's 6th and 9th and 5th
    thread-loop trips, late lanes of the CPU's. 6152 float32 on CUDA, the vector path with four
    vectors per thread (416 threads): NaN and inf in the 4th vector, 1e4 in the 3rd. The
    non-finite rows hold a non-finite value and leave every other row exactly as without
    them; row 3 matches float64 (a sum that dropped a later trip would miss the value
    dominating its variance)."""
    x, w, b, dy = _norm_case(7, D, torch.float32, "same-dtype", rms)
    x[1, nan_col], x[2, D - 1], x[3, big_col] = math.nan, math.inf, 1e4
    args = (_dev(w, device), _dev(b, device), 1e-5, rms)
    y, mean, rstd = torch.ops.memkern.norm_forward(x.to(device), *args)
    dx, dw, db = torch.ops.memkern.norm_backward(dy.to(device), x.to(device), args[0], mean,
                                                 rstd, rms)
    y, rstd, dx, dw, db = (t.cpu() for t in (y, rstd, dx, dw, db))
    bad = torch.tensor([False, True, True, False, False, False, False])
    for out in (y, dx):
        assert not out[bad].isfinite().all(dim=1).any(), "each such row holds a non-finite value"
    assert not dw.isfinite().any() and db.isfinite().all()  # the NaN row's sum is NaN everywhere
    y_ok, mean_ok, rstd_ok = torch.ops.memkern.norm_forward(x[~bad].to(device), *args)
    dx_ok, _, _ = torch.ops.memkern.norm_backward(dy[~bad].to(device), x[~bad].to(device),
                                                  args[0], mean_ok, rstd_ok, rms)
    assert torch.equal(y[~bad], y_ok.cpu()) and torch.equal(rstd[~bad], rstd_ok.cpu())
    assert torch.equal(dx[~bad], dx_ok.cpu())
    y64, _, rstd64, (dx64, _, _) = norm64(x[3:4], w, b, 1e-5, rms, dy[3:4])
    assert rel_err(y[3:4], y64) <= 2 * TOL[torch.float32]
    assert rel_err(rstd[3:4], rstd64) <= 2e-6
    assert rel_err(dx[3:4], dx64) <= 10 * GRAD_TOL[torch.float32]


@pytest.mark.cuda
@pytest.mark.skipif(not compiled.has_cuda, reason="memkern._C was built without its CUDA kernels")
def test_cuda_norm_non_contiguous_input():
    """A transposed x (and dy) is normalised as its values: the kernel copies it contiguous."""
    x = torch.randn(131, 23, device="cuda").t()
    dy = torch.randn(131, 23, device="cuda").t()
    w = torch.randn(131, device="cuda")
    y, mean, rstd = torch.ops.memkern.norm_forward(x, w, None, 1e-5, True)
    dx, dw, _ = torch.ops.memkern.norm_backward(dy, x, w, mean, rstd, True)
    y64, _, _, (dx64, dw64, _) = norm64(x.cpu(), w.cpu(), None, 1e-5, True, dy.cpu())
    assert rel_err(y.cpu(), y64) <= 2e-6 and rel_err(dx.cpu(), dx64) <= 1e-4
    assert rel_err(dw.cpu(), dw64) <= 1e-5


# ----------------------------------------------------------------------------------------------
# activations: torch's own kernels, registered from C++ for CPU and CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not compiled.has_cuda, reason="memkern._C was built without its CUDA kernels")
@pytest.mark.parametrize("kind", ["gelu", "gelu_tanh", "relu", "silu"])
def test_cuda_activation_kernels_are_torchs(kind):
    """act_forward / act_backward on CUDA equal torch's own CUDA functions bit for bit."""
    x = (torch.randn(37, 1029, device="cuda") * 3).to(torch.bfloat16)
    g = torch.randn_like(x)
    x[5, 7] = math.nan
    assert torch.equal(torch.ops.memkern.act_forward(x, kind).isnan(),
                       ops.act_forward.reference(x, kind).isnan())
    assert torch.equal(torch.ops.memkern.act_forward(x, kind).nan_to_num(),
                       ops.act_forward.reference(x, kind).nan_to_num())
    assert torch.equal(torch.ops.memkern.act_backward(g, x, kind).nan_to_num(),
                       ops.act_backward.reference(g, x, kind).nan_to_num())
