"""The cross-entropy row ops (memkern/ops/cross_entropy.py): ``cross_entropy_rows_`` and
``cross_entropy_block_grad_`` on every backend — reference, C++ CPU, Triton (interpreted on the
CPU; compiled on a GPU, marked cuda) and CUDA C++ (cuda) — against ``F.cross_entropy`` and its
autograd in float64 on the very (rounded) logits each kernel saw.

The C++ CPU kernels run the per-row math the CUDA kernels run
(csrc/cuda/kernels/cross_entropy_math.h): the online softmax over a row's tiles of 16 bytes,
each of 8 lanes (on the GPU: 512 threads) taking every 8th tile, the lanes merged at the end.
So the CPU cases below are sized for >= 3 tiles per lane (V = 203: 51 float32 tiles of 4 plus a
head, 6 per lane; V = 1031: 32 per lane), with the row's maximum, +inf, NaN in a later tile of
a lane than its first, rows starting at unaligned addresses (a head tile), and the first
tiles all -inf (the sum must stay 0, not NaN, until a finite logit arrives); the GPU cases are
sized the same way for 512 threads (V = 50257: 12 bfloat16 tiles of 8 per thread).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from compare import rel_err
from memkern import backend, ops
from memkern.ops import cross_entropy as ops_ce

DTYPES = [pytest.param(d, id=str(d).removeprefix("torch."))
          for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)]
# Against float64 on the very logits: float32 math (a few float32 ulps of the loss; the
# gradient rounded once to the logits' dtype).
TOL = {torch.float64: 1e-13, torch.float32: 3e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

needs_cpu_kernels = pytest.mark.skipif(not backend.runs_on("cpu", torch.device("cpu")),
                                       reason="the compiled extension is not built")
needs_triton = pytest.mark.skipif(not backend.runs_on("triton", torch.device("cpu")),
                                  reason="triton is not importable / TRITON_INTERPRET not set")
# (backend, device): each compiled kernel where it runs; the reference everywhere
KERNELS = [pytest.param("reference", "cpu", id="reference"),
           pytest.param("cpu", "cpu", marks=needs_cpu_kernels, id="cpu"),
           pytest.param("cuda", "cuda", marks=pytest.mark.cuda, id="cuda"),
           pytest.param("triton", "cuda", marks=pytest.mark.cuda, id="triton-cuda")]


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _oracle(z, t, ignore_index, smoothing, scale, cap):
    """Loss, log-sum-exp and gradient (times ``scale`` per row) of F.cross_entropy on the
    (capped) logits, in float64. The cap's derivative is 1 / cosh(z / cap)^2 (autograd's
    1 - tanh^2 of a rounded tanh loses float64's precision where tanh saturates)."""
    z64 = z.double()
    capped = (cap * torch.tanh(z64 / cap) if cap else z64.clone()).requires_grad_()
    per_row = F.cross_entropy(capped, t, reduction="none", ignore_index=ignore_index,
                              label_smoothing=smoothing)
    (grad,) = torch.autograd.grad(per_row, capped, scale.double())
    if cap:
        grad = grad * torch.cosh(z64 / cap).pow(-2)
    lse = torch.logsumexp(capped.detach(), 1).masked_fill(t == ignore_index, 0.0)
    return per_row.detach(), lse, grad


def _close(got, want, tol):
    """Within ``tol`` of the float64 oracle, plus what rounding the oracle itself to ``got``'s
    dtype costs (a gradient of 1e-26 is 0 in float16)."""
    return rel_err(got, want) < tol + rel_err(want.to(got.dtype), want)


def _rows(backend_name, *args):
    with backend.force(backend_name):
        return ops.cross_entropy_rows_(*args)


def _special_rows(z, tile):
    """Rows whose extremes fall in a later tile of a lane than its first (8 lanes of tiles of
    ``tile`` logits, or 512 on a GPU: index V - 3 is in a lane's last tile either way)."""
    V = z.shape[1]
    z[1, V - 3] = 60.0  # the row's max, far above the rest: a missing rescale shows at once
    z[2, V - 3] = float("inf")
    z[3, V // 2 + tile] = float("nan")
    z[4, : V - 2 * tile] = float("-inf")  # every lane's first tiles -inf, then finite ones
    z[5, :] = float("-inf")  # all -inf: NaN, as torch
    z[6, 0] = 50.0  # the max in the head / first tile, the rest far below
    z[6, 1:] -= 30.0
    return [1, 2, 3, 4, 5, 6]


def _random_rows(V, backend_name, device, dtype):
    """13 rows of V random logits and targets for a kernel (skips what it does not take); rows
    0, 7 and 12 (first, middle, last) ignored with ignore_index -7."""
    if device != "cuda" and V == 50257:
        pytest.skip("GPU-sized rows")
    if backend_name == "triton" and dtype == torch.float64:
        pytest.skip("the Triton kernel takes 16/32-bit logits")
    z = (torch.randn(13, V, device=device) * 3).to(dtype)
    t = torch.randint(0, V, (13,), device=device)
    t[[0, 7, 12]] = -7
    return z, t


@pytest.mark.parametrize("cap", [0.0, 7.0], ids=["nocap", "softcap"])
@pytest.mark.parametrize("smoothing", [0.0, 0.3])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend_name,device", KERNELS)
@pytest.mark.parametrize("V", [203, 1031, pytest.param(50257, marks=pytest.mark.cuda)])
def test_rows_match_float64_torch(V, backend_name, device, dtype, smoothing, cap):
    z, t = _random_rows(V, backend_name, device, dtype)
    t[1] = V - 3  # the target at the late maximum
    t[4] = V - 1  # a finite logit after the -inf ones
    # row 6's maximum is at column 0, far above the rest: a target there has a gradient of
    # softmax - 1 ~ -1e-10, below float32's resolution around 1 (a 1-in-V failure of rounding)
    t[6] = int(torch.randint(1, V, ()))
    special = _special_rows(z, 16 // z.element_size())
    scale = torch.randn(13, dtype=_acc(dtype), device=device)
    loss_ref, lse_ref, grad_ref = _oracle(z, t, -7, smoothing, scale, cap)
    out = z.clone()
    loss, lse = _rows(backend_name, out, t, scale, -7, smoothing, True, cap)
    assert loss.dtype == lse.dtype == _acc(dtype) and out.dtype == dtype
    tol = TOL[dtype] * (3 if backend_name == "triton" else 1)
    ordinary = [r for r in range(13) if r not in special]
    assert rel_err(loss[ordinary], loss_ref[ordinary]) < tol
    assert rel_err(lse[ordinary], lse_ref[ordinary]) < tol
    assert rel_err(out[ordinary], grad_ref[ordinary]) < tol
    # +inf and all -inf rows: NaN like torch, or finite once capped (to +-cap)
    finite, nan = ([1, 4, 6, 2, 5], [3]) if cap else ([1, 4, 6], [2, 3, 5])
    for r in finite:  # a late maximum, leading -inf tiles, a far first maximum
        if torch.isinf(loss_ref[r]):  # smoothing's mean of -inf logits: inf, as torch
            assert loss[r] == loss_ref[r], r
        else:
            assert abs(loss[r] - loss_ref[r]) < tol * max(1.0, abs(loss_ref[r])), r
        assert _close(out[r], grad_ref[r], tol), r
    for r in nan:  # +inf, NaN, all -inf
        assert torch.isnan(loss[r]) and torch.isnan(loss_ref[r]), r
        assert torch.equal(torch.isnan(out[r]), torch.isnan(grad_ref[r])), r
    assert torch.equal(out[[0, 7, 12]], torch.zeros(3, V, dtype=dtype, device=device))
    assert torch.equal(loss[[0, 7, 12]], torch.zeros(3, dtype=loss.dtype, device=device))
    untouched = z.clone()
    loss2, _ = _rows(backend_name, untouched, t, None, -7, smoothing, False, cap)
    assert torch.equal(untouched.isnan(), z.isnan())
    assert torch.equal(untouched[~z.isnan()], z[~z.isnan()])
    assert torch.equal(loss2.isnan(), loss.isnan())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend_name,device", KERNELS)
@pytest.mark.parametrize("V", [1, 2, 3, 5])
def test_rows_narrower_than_a_tile(V, backend_name, device, dtype):
    """Rows of fewer logits than a 16-byte tile, packed, so that most start unaligned: the head
    tile is the whole row and never reaches into the next one (the rows kernel's loss and
    gradient and the block kernel's gradient, with every other row ignored, against float64)."""
    if backend_name == "triton" and dtype == torch.float64:
        pytest.skip("the Triton kernel takes 16/32-bit logits")
    n = 37
    z = (torch.randn(n, V, device=device) * 3).to(dtype)
    t = torch.randint(0, V, (n,), device=device)
    t[1::2] = -1
    scale = torch.randn(n, dtype=_acc(dtype), device=device)
    loss_ref, lse_ref, grad_ref = _oracle(z, t, -1, 0.1, scale, 0.0)
    tol = TOL[dtype] * (3 if backend_name == "triton" else 1)
    out = z.clone()
    loss, lse = _rows(backend_name, out, t, scale, -1, 0.1, True, 0.0)
    assert rel_err(lse, lse_ref) < tol
    # one class: a loss of lse - z = 0 and a gradient of 1 - 0.1 - 0.9 = 0, each the rounding
    # of its terms (lse; the row's scale) at most
    if V > 1:
        assert rel_err(loss, loss_ref) < tol
    else:
        assert (loss.double() - loss_ref).abs().max() <= tol * lse_ref.abs().max()

    def close(got):
        if V > 1:
            return _close(got, grad_ref, tol)
        return (got.double() - grad_ref).abs().max() <= tol * scale.double().abs().max()

    assert close(out)
    assert torch.equal(out[1::2], torch.zeros_like(out[1::2]))
    block = z.clone()
    with backend.force(backend_name):
        ops.cross_entropy_block_grad_(block, lse_ref.to(_acc(dtype)), t, scale, 0, V, -1, 0.1)
    assert close(block)
    assert torch.equal(block[1::2], torch.zeros_like(block[1::2]))


@pytest.mark.parametrize("cap", [0.0, 5.0], ids=["nocap", "softcap"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend_name,device", KERNELS)
@pytest.mark.parametrize("stride", [1, 0], ids=["per-row-scale", "one-scale"])
def test_block_grad_assembles_the_float64_gradient(stride, backend_name, device, dtype,
                                                   smoothing, cap):
    """The gradient of 9 rows of 263 classes written block by block (widths 100, 100, 63; 1,
    then 262; the targets of some rows in each block and at its edges) from the rows' lse."""
    if backend_name == "triton" and dtype == torch.float64:
        pytest.skip("the Triton kernel takes 16/32-bit logits")
    V = 263
    z = (torch.randn(9, V, device=device) * 3).to(dtype)
    t = torch.tensor([0, 99, 100, 199, 200, 262, -1, 150, 37], device=device)
    scale = torch.randn(9, dtype=_acc(dtype), device=device)
    if stride == 0:
        scale = scale[:1].expand(9)
    _, lse_ref, grad_ref = _oracle(z, t, -1, smoothing, scale, cap)
    with backend.force("reference"):  # the lse of the very rounded logits, in float32
        _, lse = ops.cross_entropy_rows_(z.clone(), t, None, -1, smoothing, False, cap)
    for widths in ((100, 100, 63), (1, 262)):
        got = torch.empty_like(z)
        c0 = 0
        for w in widths:
            block = z[:, c0:c0 + w].contiguous()
            with backend.force(backend_name):
                ops.cross_entropy_block_grad_(block, lse, t, scale, c0, V, -1, smoothing, cap)
            got[:, c0:c0 + w] = block
            c0 += w
        assert rel_err(got, grad_ref) < TOL[dtype] * (3 if backend_name == "triton" else 1)
        assert torch.equal(got[6], torch.zeros(V, dtype=dtype, device=device))
    assert rel_err(lse[t != -1], lse_ref[t != -1]) < TOL[dtype]


@needs_cpu_kernels
@pytest.mark.parametrize("op", ["rows", "block"])
def test_cpu_bad_target_raises_before_writing(op):
    z = torch.randn(5, 11)
    out = z.clone()
    t = torch.tensor([3, -100, 10, 11, 0])
    with pytest.raises(ValueError, match=r"target\[3\] = 11 is not a class index in \[0, 11\) "
                                         r"nor ignore_index=-100"):
        with backend.force("cpu"):
            if op == "rows":
                ops.cross_entropy_rows_(out, t, None, -100, 0.0, True)
            else:
                ops.cross_entropy_block_grad_(out, torch.zeros(5), t, torch.ones(5), 0, 11, -100,
                                              0.0)
    assert torch.equal(out, z)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("backend_name",
                         ["reference", pytest.param("cpu", marks=needs_cpu_kernels)])
def test_rows_when_the_target_probability_underflows(dtype, backend_name):
    """Logits so spread that softmax(z)[t] underflows to 0 for most rows (loss in the
    hundreds): the loss is still exact, the gradient softmax - onehot."""
    z = (torch.randn(9, 257) * 300).to(dtype)
    t = torch.randint(0, 257, (9,))
    loss_ref, _, grad_ref = _oracle(z, t, -100, 0.0, torch.ones(9), 0.0)
    assert loss_ref.max().item() > 100
    out = z.clone()
    loss, _ = _rows(backend_name, out, t, None, -100, 0.0, True)
    tol = 1e-6 if dtype == torch.float32 else 1e-14
    assert rel_err(loss, loss_ref) < tol and rel_err(out, grad_ref) < tol


@pytest.mark.cuda
@pytest.mark.parametrize("backend_name", ["cuda", "triton"])
def test_gpu_out_of_range_targets_are_never_read(backend_name):
    """A target outside [0, V) (not ignore_index) is not checked on the GPU (a host sync) and
    never indexes the row: loss lse - eps * mean(z), no one-hot term in the gradient."""
    V = 4099
    z = torch.randn(4, V, device="cuda") * 2
    t = torch.tensor([-5, V, 10**12, 17], device="cuda")
    out = z.clone()
    loss, lse = _rows(backend_name, out, t, None, -100, 0.1, True)
    torch.cuda.synchronize()
    zd = z.double()
    want_lse = torch.logsumexp(zd, 1)
    assert rel_err(lse, want_lse) < 1e-6
    assert rel_err(loss[:3], (want_lse - 0.1 * zd.mean(1))[:3]) < 1e-6
    soft = torch.softmax(zd, 1) - 0.1 / V
    assert rel_err(out[:3], soft[:3]) < 1e-5


@pytest.mark.parametrize("call,match", [
    (lambda: ops.cross_entropy_rows_(torch.randn(2, 5), torch.tensor([1, 5]), None, -100, 0.0,
                                     True), r"target\[1\] = 5"),
    (lambda: ops.cross_entropy_rows_(torch.randn(2, 5), torch.tensor([1, 2], dtype=torch.int32),
                                     None, -100, 0.0, True), "target must be an int64"),
    (lambda: ops.cross_entropy_rows_(torch.randn(2, 5), torch.tensor([1, 2]), None, -100, 0.0, True,
                                     -1.0), "softcap=-1.0"),
    (lambda: ops.cross_entropy_block_grad_(torch.randn(2, 5), torch.zeros(2), torch.tensor([1, 2]),
                                           torch.ones(2), 3, 7, -100, 0.0),
     r"classes \[3, 8\) but num_classes=7"),
    (lambda: ops.cross_entropy_block_grad_(torch.randn(2, 5), torch.zeros(2, dtype=torch.float64),
                                           torch.tensor([1, 2]), torch.ones(2), 0, 5, -100, 0.0),
     "lse must be a contiguous torch.float32"),
])
def test_errors_name_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


@needs_cpu_kernels
def test_cpu_kernels_check_direct_calls():
    """torch.ops.memkern.* bypasses the Python checks: the C++ kernels make them too."""
    with pytest.raises(RuntimeError, match="row_scale must be a contiguous Float"):
        torch.ops.memkern.cross_entropy_rows_(torch.randn(2, 5), torch.tensor([1, 2]),
                                              torch.ones(2, dtype=torch.float64), -100, 0.0, True)
    with pytest.raises(RuntimeError, match=r"classes \[0, 5\) but num_classes=4"):
        torch.ops.memkern.cross_entropy_block_grad_(torch.randn(2, 5), torch.zeros(2),
                                                    torch.tensor([1, 2]), torch.ones(2), 0, 4,
                                                    -100, 0.0)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_triton_interpreted_matches_float64(dtype):
    """The Triton kernels (the GPU path without the CUDA build) under the interpreter: rows over
    tiles of 4096 classes (V = 9001: three tiles, the max and a NaN in the last), and blocks."""
    V = 9001
    z = (torch.randn(5, V) * 3).to(dtype)
    z[1, V - 2] = 40.0
    z[2, V - 10] = float("nan")
    t = torch.tensor([3, V - 2, 5, -100, 8000])
    scale = torch.randn(5)
    loss_ref, lse_ref, grad_ref = _oracle(z, t, -100, 0.1, scale, 6.0)
    out = z.clone()
    loss, lse = _rows("triton", out, t, scale, -100, 0.1, True, 6.0)
    ok = [0, 1, 3, 4]
    tol = 3 * TOL[dtype]
    assert rel_err(loss[ok], loss_ref[ok]) < tol and rel_err(out[ok], grad_ref[ok]) < tol
    assert torch.isnan(loss[2]) and torch.isnan(out[2]).all()
    block = z[:, 4000:9001].contiguous()
    with backend.force("triton"):
        ops.cross_entropy_block_grad_(block, lse, t, scale, 4000, V, -100, 0.1, 6.0)
    assert rel_err(block[ok], grad_ref[ok, 4000:]) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=needs_triton, id="interpreted"),
                                    pytest.param("cuda", marks=pytest.mark.cuda, id="cuda")])
def test_triton_rows_over_several_tiles(device, dtype, smoothing):
    """A vocabulary of three Triton tiles (the last one short), so the online softmax rescales
    its running sum twice, against F.cross_entropy in float64 on the very (rounded) logits. Per
    row, in a later tile: the row's max (the first tiles' sum must be rescaled to it), the
    target, an inf or a NaN (the row is NaN, as in torch); a row whose whole first tile is
    -inf (masked classes: exp(-inf - -inf) must not turn the sum into NaN); an ignored row."""
    from memkern.kernels.cross_entropy import MAX_BLOCK_V

    V = 2 * MAX_BLOCK_V + 77
    rows = 7
    z = (torch.randn(rows, V) * 3).to(dtype)
    t = torch.randint(0, V, (rows,))
    last = 2 * MAX_BLOCK_V  # the first column of the third tile
    z[1, last + 40] = 30.0  # the max, far above the first tiles' (their exps shrink ~e^-20)
    z[2, MAX_BLOCK_V + 9] = 25.0  # the max in the second tile, the target in the third
    t[2] = last + 3
    z[3, last + 70] = math.inf
    z[4, last + 1] = math.nan
    z[5, :MAX_BLOCK_V] = -math.inf
    t[5] = MAX_BLOCK_V + 100
    t[6] = -100
    scale = torch.randn(rows)
    zr = z.double().requires_grad_()
    per_row = F.cross_entropy(zr, t, reduction="none", label_smoothing=smoothing)
    (grad,) = torch.autograd.grad(per_row, zr, scale.double())
    out = z.to(device, copy=True)
    loss, _ = _rows("triton", out, t.to(device), scale.to(device), -100, smoothing, True)
    loss, out = loss.cpu(), out.cpu()
    per_row = per_row.detach()
    finite, nan = per_row.isfinite(), per_row.isnan()  # 3, 4: NaN; 5 with smoothing: inf
    assert finite[[0, 1, 2, 6]].all() and nan[[3, 4]].all()
    assert rel_err(loss[finite], per_row[finite]) < 1e-6
    assert torch.equal(loss.isnan(), nan)
    assert torch.equal(loss[~finite & ~nan], per_row[~finite & ~nan].float())
    kept = [0, 1, 2, 5, 6]
    assert _close(out[kept], grad[kept], 2 * TOL[dtype])
    for r in (3, 4):
        assert torch.equal(out[r].isnan(), grad[r].isnan()), r
    assert torch.equal(out[6], torch.zeros_like(out[6]))


# ----------------------------------------------------------------------------------------------
# per-row statistics (outputs/stats) and the entropy's gradient term

EVERY_STAT = ops_ce.ROW_ENTROPY | ops_ce.ROW_IS_TOP1 | ops_ce.ROW_MEAN_LOGIT
STAT_TOL = {torch.float64: 1e-13, torch.float32: 3e-6, torch.bfloat16: 3e-6, torch.float16: 3e-6}
"""Against float64 on the very logits: the statistics are float32 math whatever the logits'
dtype (no gradient rounded to 16 bits)."""


def _stats_oracle(z, t, ignore_index, cap):
    """Entropy (torch.special.entr of the float64 softmax: 0 log 0 = 0), argmax == target,
    mean of the (capped) logits, 0 for ignored rows — the rows of ``stats``."""
    z64 = z.double()
    capped = cap * torch.tanh(z64 / cap) if cap else z64
    valid = t != ignore_index
    entropy = torch.special.entr(torch.softmax(capped, 1)).sum(1)
    top1 = (capped.argmax(1) == t).double()
    return [torch.where(valid, s, 0.0) for s in (entropy, top1, capped.mean(1))]


def _assert_stats(stats, want, rows, tol):
    """Row by row: within ``tol`` (relative, or absolute below 1), NaN where the oracle is, the
    same infinity; is-top-1 exactly."""
    for k in (ops_ce.ENTROPY_ROW, ops_ce.MEAN_LOGIT_ROW):
        for r in rows:
            got, ref = stats[k, r].double().cpu(), want[k][r]
            if torch.isnan(ref) or torch.isinf(ref):
                assert torch.equal(got.isnan(), ref.isnan()) and (got.isnan() or got == ref), (k, r)
            else:
                assert abs(got - ref) <= tol * max(1.0, abs(ref)), (k, r, got, ref)
    assert torch.equal(stats[ops_ce.IS_TOP1_ROW, rows].double().cpu(),
                       want[ops_ce.IS_TOP1_ROW][rows])


def _statistic_rows(z, t, tile):
    """_special_rows, targets on its extremes, and ties for the maximum: the target at the
    first of two equal maxima (top-1) and at the second (not: argmax takes the first)."""
    V = z.shape[1]
    special = _special_rows(z, tile)
    t[1] = V - 3  # at the late maximum
    t[2] = V - 3  # at the +inf
    t[3] = V // 2 + tile  # at the NaN: argmax's choice in a row with one
    t[6] = 0  # at the maximum in the head tile
    z[8, 5] = z[8, V - 2] = 40.0  # a tie: the target at the second, in a later tile
    t[8] = V - 2
    z[9, V - 7] = z[9, V - 2] = 40.0  # a tie in later tiles: the target at the first
    t[9] = V - 7
    z[10, V - 1] = float("nan")  # a NaN after the target at the maximum: argmax is the NaN
    z[10, V // 3] = 30.0
    t[10] = V // 3
    return special + [8, 9, 10]


@pytest.mark.parametrize("cap", [0.0, 7.0], ids=["nocap", "softcap"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend_name,device", KERNELS)
@pytest.mark.parametrize("V", [203, 1031, pytest.param(50257, marks=pytest.mark.cuda)])
def test_row_statistics_match_float64_torch(V, backend_name, device, dtype, cap):
    """Entropy, is-top-1 and mean logit of each row with the loss and gradient (rows sized for
    >= 3 tiles per lane, the extremes and ties in later tiles), against float64 torch; then
    each statistic alone, the other rows of ``stats`` untouched, the loss unchanged."""
    z, t = _random_rows(V, backend_name, device, dtype)
    special = _statistic_rows(z, t, 16 // z.element_size())
    want = _stats_oracle(z.cpu(), t.cpu(), -7, cap)
    acc = _acc(dtype)
    stats = torch.full((3, 13), 7.0, dtype=acc, device=device)
    out = z.clone()
    loss, _ = _rows(backend_name, out, t, torch.ones(13, dtype=acc, device=device), -7, 0.0,
                    True, cap, EVERY_STAT, stats)
    _assert_stats(stats, want, list(range(13)), STAT_TOL[dtype])
    assert torch.equal(stats[:, [0, 7, 12]], torch.zeros(3, 3, dtype=acc, device=device))
    assert stats[ops_ce.IS_TOP1_ROW, [1, 2, 3, 6, 9]].tolist() == [1.0] * 5
    assert stats[ops_ce.IS_TOP1_ROW, [8, 10]].tolist() == [0.0] * 2
    loss_ref, _, _ = _oracle(z, t, -7, 0.0, torch.ones(13, dtype=acc, device=device), cap)
    ordinary = [r for r in range(13) if r not in special]
    assert rel_err(loss[ordinary], loss_ref[ordinary]) < TOL[dtype]
    for bit, k in ((ops_ce.ROW_ENTROPY, ops_ce.ENTROPY_ROW),
                   (ops_ce.ROW_IS_TOP1, ops_ce.IS_TOP1_ROW),
                   (ops_ce.ROW_MEAN_LOGIT, ops_ce.MEAN_LOGIT_ROW)):
        alone = torch.full((3, 13), 7.0, dtype=acc, device=device)
        _rows(backend_name, z.clone(), t, None, -7, 0.0, False, cap, bit, alone)
        assert torch.equal(alone[k].isnan(), stats[k].isnan())
        assert torch.equal(alone[k].nan_to_num(), stats[k].nan_to_num()), bit
        others = [j for j in range(3) if j != k]
        assert (alone[others] == 7.0).all(), bit


def _entropy_grad_oracle(z, t, lse_scale, entropy_scale, cap):
    """The gradient of lse_scale * CE + entropy_scale * entropy per row, in float64 autograd,
    the cap's derivative as 1 / cosh^2; a row's -inf logits (p = 0 without a cap) are left
    out of its softmax (they add nothing to either) and get 0."""
    z64 = z.double()
    grad = torch.zeros_like(z64)
    for r in range(z.shape[0]):
        keep = z64[r] > -math.inf if not cap else torch.ones_like(z64[r], dtype=torch.bool)
        zr = z64[r, keep]
        capped = (cap * torch.tanh(zr / cap) if cap else zr.clone()).requires_grad_()
        logp = torch.log_softmax(capped, 0)
        columns = keep.nonzero()[:, 0]
        hit = (columns == t[r]).nonzero()
        loss = -logp[hit[0, 0]] if len(hit) else capped.sum() * 0
        entropy = -(logp.exp() * logp).sum()
        (g,) = torch.autograd.grad(lse_scale[r].double() * loss
                                   + entropy_scale[r].double() * entropy, capped)
        if cap:
            g = g * torch.cosh(zr / cap).pow(-2)
        grad[r, keep] = g
    return grad


@pytest.mark.parametrize("cap", [0.0, 5.0], ids=["nocap", "softcap"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend_name,device", KERNELS + [
    pytest.param("triton", "cpu", marks=needs_triton, id="triton-interpreted")])
def test_block_grad_with_the_entropy_term_matches_float64(backend_name, device, dtype, cap):
    """The gradient of ``row_scale * loss + entropy_scale * entropy`` (the entropy's term:
    -p (log p + entropy)) written block by block (widths 100, 100, 63 of 263 classes) from the
    rows' lse and entropy, against float64 autograd; a row with -inf logits (p = 0: no NaN),
    an ignored row, the maximum and the target in the last block."""
    if backend_name == "triton" and dtype == torch.float64:
        pytest.skip("the Triton kernel takes 16/32-bit logits")
    V = 263
    z = (torch.randn(9, V, device=device) * 3).to(dtype)
    t = torch.tensor([0, 99, 100, 199, 200, 262, -1, 150, 250], device=device)
    z[4, :120] = float("-inf")  # the first blocks' logits -inf
    z[8, 240] = 20.0  # the maximum in the last block
    acc = _acc(dtype)
    scale = torch.randn(9, dtype=acc, device=device)
    entropy_scale = torch.randn(9, dtype=acc, device=device)
    stats = torch.zeros(3, 9, dtype=acc, device=device)
    with backend.force("reference"):  # lse and entropy of the very rounded logits
        _, lse = ops.cross_entropy_rows_(z.clone(), t, None, -1, 0.0, False, cap,
                                         ops_ce.ROW_ENTROPY, stats)
    entropy = stats[ops_ce.ENTROPY_ROW].contiguous()
    want = _entropy_grad_oracle(z.cpu(), t.cpu(), scale.cpu(), entropy_scale.cpu(), cap)
    want[6] = 0.0
    got = torch.empty_like(z)
    c0 = 0
    for w in (100, 100, 63):
        block = z[:, c0:c0 + w].contiguous()
        with backend.force(backend_name):
            ops.cross_entropy_block_grad_(block, lse, t, scale, c0, V, -1, 0.0, cap, entropy,
                                          entropy_scale)
        got[:, c0:c0 + w] = block
        c0 += w
    assert _close(got.cpu(), want, TOL[dtype] * (3 if backend_name == "triton" else 1))
    assert torch.equal(got[4, :120].cpu(), torch.zeros(120, dtype=dtype))
    assert not got.isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=needs_triton, id="interpreted"),
                                    pytest.param("cuda", marks=pytest.mark.cuda, id="cuda")])
def test_triton_row_statistics_over_several_tiles(device, dtype):
    """The Triton rows kernel's statistics over three tiles of MAX_BLOCK_V classes (the
    moment rescaled twice; is-top-1's second read of the columns before a late target)."""
    from memkern.kernels.cross_entropy import MAX_BLOCK_V

    V = 2 * MAX_BLOCK_V + 77
    z = (torch.randn(13, V) * 3).to(dtype)
    t = torch.randint(0, V, (13,))
    t[[0, 7, 12]] = -7
    _statistic_rows(z, t, MAX_BLOCK_V)
    want = _stats_oracle(z, t, -7, 0.0)
    stats = torch.zeros(3, 13, device=device)
    _rows("triton", z.to(device), t.to(device), None, -7, 0.0, False, 0.0, EVERY_STAT, stats)
    _assert_stats(stats, want, list(range(13)), 3 * STAT_TOL[dtype])


@pytest.mark.parametrize("call,match", [
    (lambda: ops.cross_entropy_rows_(torch.randn(2, 5), torch.tensor([1, 2]), None, -100, 0.0,
                                     True, 0.0, 8, torch.zeros(3, 2)), "outputs=8 must be a mask"),
    (lambda: ops.cross_entropy_rows_(torch.randn(2, 5), torch.tensor([1, 2]), None, -100, 0.0,
                                     True, 0.0, 1), "pass stats exactly when outputs is not 0"),
    (lambda: ops.cross_entropy_rows_(torch.randn(2, 5), torch.tensor([1, 2]), None, -100, 0.0,
                                     True, 0.0, 1, torch.zeros(2, 3)),
     r"stats must be a torch.float32 tensor of shape \(3, 2\)"),
    (lambda: ops.cross_entropy_block_grad_(torch.randn(2, 5), torch.zeros(2), torch.tensor([1, 2]),
                                           torch.ones(2), 0, 5, -100, 0.0, 0.0, torch.zeros(2)),
     "entropy and entropy_scale go together"),
])
def test_statistics_errors_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@needs_cpu_kernels
def test_cpu_kernels_check_direct_statistics_calls():
    with pytest.raises(RuntimeError, match="pass stats exactly when outputs is not 0"):
        torch.ops.memkern.cross_entropy_rows_(torch.randn(2, 5), torch.tensor([1, 2]), None,
                                              -100, 0.0, True, 0.0, 2)
    with pytest.raises(RuntimeError, match="entropy and entropy_scale go together"):
        torch.ops.memkern.cross_entropy_block_grad_(torch.randn(2, 5), torch.zeros(2),
                                                    torch.tensor([1, 2]), torch.ones(2), 0, 5,
                                                    -100, 0.0, 0.0, None, torch.ones(2))
