"""What the two 8-bit optimizer-step ops (``memkern::adamw8bit_step_``,
``memkern::sgd8bit_step_``) share, on every backend: the block-wise 8-bit map (the reference's
quantizer against the float64 oracle of flat_oracle.py, written from the map's definition, and
against hand-computed codes), skipped steps, non-finite gradients confined to their block,
empty buffers, the op contract and bad input. Each op's own update is tested against its
float64 oracle in test_adamw8bit_op.py and test_sgd8bit_op.py.

Fresh random data every run (conftest prints the seed), odd sizes (none a multiple of the
QBLOCK-element block), NaN/inf injected at the first/middle/last element.
"""
from __future__ import annotations

import math

import pytest
import torch

import flat_oracle as fo
from flat_oracle import QBLOCK, assert_bits_equal, assert_close64, f64, scalar
from memkern import ops
from memkern.kernels import state8bit
from memkern.ops import adamw8bit

BACKEND_CASES = fo.cases(with_sizes=False)
OPS = {
    # op: the code dtypes of its state (after master), a plain step's hyper-parameters
    "adamw8bit_step_": ((torch.int8, torch.uint8), (0.01, 0.9, 0.999, 1e-8, 0.01)),
    "sgd8bit_step_": ((torch.int8,), (0.05, 0.9, 0.1, 0.01, False)),
}
OP_NAMES = sorted(OPS)


def run(backend: str, op: str, *args) -> None:
    with ops.force(backend):
        getattr(ops, op)(*args)


def code_pairs(state: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (codes, absmax) pairs of a state list [master, codes, absmax, ...]."""
    return list(zip(state[1::2], state[2::2]))


# ------------------------------------------------------------------- the map itself


def test_constants_agree_with_the_oracle():
    assert state8bit.QBLOCK == fo.QBLOCK
    assert (state8bit.SIGNED_CODES, state8bit.SIGNED_POWER) == fo.CODE_MAPS[torch.int8]
    assert (state8bit.UNSIGNED_CODES, state8bit.UNSIGNED_POWER) == fo.CODE_MAPS[torch.uint8]


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8], ids=["int8", "uint8"])
def test_reference_quantizer_equals_the_float64_oracle(dtype):
    """Random blocks of values over many decades, an all-zero block, blocks holding NaN, inf
    and a subnormal absmax: the reference's codes and absmax are the oracle's, bit for bit."""
    n = 7 * QBLOCK + 77
    x = torch.randn(n, dtype=torch.float64) * 10 ** (6 * torch.rand(n, dtype=torch.float64) - 3)
    if dtype == torch.uint8:
        x = x.abs()
    x[QBLOCK:2 * QBLOCK] = 0.0
    x[2 * QBLOCK + fo.randint(0, QBLOCK - 1)] = math.nan
    x[3 * QBLOCK + fo.randint(0, QBLOCK - 1)] = math.inf
    x[4 * QBLOCK:5 * QBLOCK] *= 1e-310
    codes, absmax = torch.empty(n, dtype=dtype), torch.empty(fo.blocks_of(n), dtype=torch.float64)
    adamw8bit.quantize(x, codes, absmax)
    expected_codes, expected_absmax = fo.quantize64(x, dtype)
    assert_bits_equal(codes, expected_codes, f"{dtype} codes")
    assert_bits_equal(absmax, expected_absmax, f"{dtype} absmax")
    back = adamw8bit.dequantize(codes, absmax, torch.float64)
    # subnormal values (the 1e-310 block) hold fewer bits: an absolute error of rtol * tiny
    assert_close64(back, fo.dequantize64(codes, absmax), f"{dtype} dequantized", rtol=1e-15,
                   magnitude=torch.finfo(torch.float64).tiny)


def test_map_by_hand():
    """Dequantize and quantize on hand-computed codes and values."""
    absmax = torch.tensor([2.0], dtype=torch.float64)
    m_codes = torch.tensor([127, -127, 64, 0, 1, -100], dtype=torch.int8)
    expected = [2.0, -2.0, 2 * (64 / 127) ** 2, 0.0, 2 / 127**2, -2 * (100 / 127) ** 2]
    got = adamw8bit.dequantize(m_codes, absmax, torch.float64)
    assert torch.allclose(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-15, atol=0)
    v_codes = torch.tensor([255, 128, 1, 0], dtype=torch.uint8)
    got = adamw8bit.dequantize(v_codes, torch.tensor([3.0], dtype=torch.float64), torch.float64)
    expected = [3.0, 3 * (128 / 255) ** 4, 3 / 255**4, 0.0]
    assert torch.allclose(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-15, atol=0)

    # quantize: x = s * (k / 127)**2 (slightly off) gives code k; the largest |x| gives 127
    x = torch.tensor([-0.5, 0.5 * (10.2 / 127) ** 2, -0.5 * (99.8 / 127) ** 2, 0.0],
                     dtype=torch.float64)
    codes, scale = torch.empty(4, dtype=torch.int8), torch.empty(1, dtype=torch.float64)
    adamw8bit.quantize(x, codes, scale)
    assert codes.tolist() == [-127, 10, -100, 0] and scale.item() == 0.5
    v = torch.tensor([4.0, 4 * (200.4 / 255) ** 4, 4e-12], dtype=torch.float64)
    vcodes = torch.empty(3, dtype=torch.uint8)
    adamw8bit.quantize(v, vcodes, scale)
    # 4e-12 / 4 = 1e-12: (1e-12) ** 0.25 * 255 = 0.255 -> 0
    assert vcodes.tolist() == [255, 200, 0] and scale.item() == 4.0


# Relative values |x| / absmax between the root-space midpoint of codes k and k + 1,
# ((k + 1/2) / C) ** p, and the midpoint where the code switches: for m (p = 2) the midpoint of
# the two values, for v (p = 4) the midpoint of the values' square roots. Both maps are convex:
# rounding the root to the nearest integer gives k + 1 there, the rule gives k; just above the
# switching midpoint, k + 1. In units of (|c| / C) ** 2 (|m| / absmax, or sqrt(v / absmax))
# the midpoints are (k^2 + k + 1/4) / C^2 (root space) and (k^2 + k + 1/2) / C^2 (switch).
M_KS = (0, 1, 5, 40, 126)
M_BETWEEN = [(k * k + k + 0.375) / 127**2 for k in M_KS]
M_ABOVE = [(k * k + k + 0.625) / 127**2 for k in M_KS]
V_KS = (0, 1, 3, 20, 100, 254)
V_BETWEEN = [((k * k + k + 0.375) / 255**2) ** 2 for k in V_KS]
# also below the midpoint of the values themselves, (k^4 + (k + 1)^4) / 2 / 255^4, where a
# rule of nearest value would still give k
V_ABOVE = [((k * k + k + 0.625) / 255**2) ** 2 for k in V_KS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_reference_code_is_the_nearest_value(dtype):
    """Between the root-space and the switching midpoint of two codes (m: of their values; v:
    of their values' square roots) the lower code is taken; just above it the upper one: both
    maps, both signs."""
    scale = 0.75
    m = torch.tensor([1.0] + M_BETWEEN + [-r for r in M_BETWEEN] + M_ABOVE
                     + [-r for r in M_ABOVE], dtype=torch.float64) * scale
    codes, absmax = torch.empty(m.numel(), dtype=torch.int8), torch.empty(1, dtype=dtype)
    adamw8bit.quantize(m.to(dtype), codes, absmax)
    above = [k + 1 for k in M_KS]
    assert codes.tolist() == [127, *M_KS, *(-k for k in M_KS), *above, *(-k for k in above)]
    v = torch.tensor([1.0] + V_BETWEEN + V_ABOVE, dtype=torch.float64) * scale
    vcodes = torch.empty(v.numel(), dtype=torch.uint8)
    adamw8bit.quantize(v.to(dtype), vcodes, absmax)
    assert vcodes.tolist() == [255, *V_KS, *(k + 1 for k in V_KS)]


@pytest.mark.parametrize("backend,device", BACKEND_CASES)
def test_code_is_the_nearest_value_on_every_backend(backend, device):
    """The same values through adamw8bit_step_ with betas (0, 0), which stores m = g and
    v = g * g: in each of the two blocks (the second one partial), an element with |g| = 1 sets
    both absmax to 1, the others are random below 1/2."""
    dev = fo.need(backend, device)
    n = QBLOCK + 101
    g = torch.rand(n, dtype=torch.float64) - 0.5
    m_at, v_at = [], []
    for start in (0, QBLOCK):
        g[start] = -1.0
        m_rel = M_BETWEEN + [-r for r in M_BETWEEN] + M_ABOVE + [-r for r in M_ABOVE]
        m_at += range(start + 1, start + 1 + len(m_rel))
        g[m_at[-len(m_rel):]] = torch.tensor(m_rel, dtype=torch.float64)
        v_rel = V_BETWEEN + V_ABOVE
        v_at += range(m_at[-1] + 1, m_at[-1] + 1 + len(v_rel))
        g[v_at[-len(v_rel):]] = torch.tensor(v_rel, dtype=torch.float64).sqrt()
    state = [torch.randn(n)]
    for dtype in (torch.int8, torch.uint8):
        state += [torch.zeros(n, dtype=dtype), torch.zeros(fo.blocks_of(n))]
    state = [t.to(dev) for t in state]
    run(backend, "adamw8bit_step_", *state, g.to(torch.float32).to(dev), None,
        scalar(0.0, dev), None, None, 0.01, 0.0, 0.0, 1e-8, 0.0)
    m_codes, m_absmax, v_codes, v_absmax = (t.cpu() for t in state[1:])
    assert m_absmax.tolist() == [1.0, 1.0] and v_absmax.tolist() == [1.0, 1.0]
    above = [k + 1 for k in M_KS]
    expected_m = [*M_KS, *(-k for k in M_KS), *above, *(-k for k in above)]
    assert m_codes[m_at].tolist() == expected_m * 2
    expected_v = [*V_KS, *(k + 1 for k in V_KS)]
    assert v_codes[v_at].tolist() == expected_v * 2


@pytest.mark.parametrize("backend,device", BACKEND_CASES)
def test_tiny_and_subnormal_absmax_on_every_backend(backend, device):
    """Blocks whose absmax lies far below 1 keep the map: adamw8bit_step_ with betas (0, 0)
    stores m = g and v = g * g (float32); per block g's scale puts m's or v's absmax at 1e-20,
    1e-32 (below 2^-100, where the CPU kernel's factor C^2 / absmax would overflow), 1e-40
    (subnormal) or 1e-64 (v underflows to zero), the last block partial. Codes and absmax are
    the float64 oracle's (codes up to a float32 rounding at a code boundary)."""
    dev = fo.need(backend, device)
    n = 5 * QBLOCK + 37
    scales = torch.tensor([1e-10, 1e-16, 1e-20, 1e-32, 1e-40, 1.0], dtype=torch.float64)
    g = ((torch.rand(n, dtype=torch.float64) * 2 - 1)
         * scales.repeat_interleave(QBLOCK)[:n]).to(torch.float32)
    g[3] = 0.0
    state = [torch.randn(n)]
    for dtype in (torch.int8, torch.uint8):
        state += [torch.zeros(n, dtype=dtype), torch.zeros(fo.blocks_of(n))]
    state = [t.to(dev) for t in state]
    run(backend, "adamw8bit_step_", *state, g.to(dev), None, scalar(0.0, dev), None, None,
        0.01, 0.0, 0.0, 1e-8, 0.0)
    m_codes, m_absmax, v_codes, v_absmax = (t.cpu() for t in state[1:])
    for what, codes, absmax, values, dtype in (("m", m_codes, m_absmax, g, torch.int8),
                                               ("v", v_codes, v_absmax, g * g, torch.uint8)):
        expected_codes, expected_absmax = fo.quantize64(values, dtype)
        assert_bits_equal(absmax, expected_absmax.to(torch.float32), f"{what} absmax")
        fo.assert_codes_close(codes, expected_codes, f"{what} codes")
        assert codes.abs().max().item() == fo.CODE_MAPS[dtype][0], f"{what}: no full-scale code"


def test_blocks_are_independent():
    x = torch.randn(3 * QBLOCK + 5, dtype=torch.float64)
    x[QBLOCK:2 * QBLOCK] *= 1e-6  # a block of tiny values keeps its own scale
    codes, scale = torch.empty(x.numel(), dtype=torch.int8), torch.empty(4, dtype=torch.float64)
    adamw8bit.quantize(x, codes, scale)
    for b in range(4):
        assert scale[b].item() == x[b * QBLOCK:(b + 1) * QBLOCK].abs().max().item()
    back = adamw8bit.dequantize(codes, scale, torch.float64)
    # the square map: relative error of one code step around |c|, at most 2/|c| + 1/|c|**2
    err = (back - x).abs() / scale.repeat_interleave(QBLOCK)[:x.numel()]
    assert err.max().item() <= 1 / 127  # coarsest step: (c + 0.5)**2 - c**2 over 127**2


def test_requantizing_dequantized_state_is_exact():
    """What the optimizer's checkpoints rely on: float32 values read back from codes quantize
    to the same codes and absmax."""
    n = 5 * QBLOCK + 17
    for dtype, values in ((torch.int8, torch.randn(n)), (torch.uint8, torch.rand(n) ** 6)):
        codes, absmax = torch.empty(n, dtype=dtype), torch.empty(fo.blocks_of(n))
        adamw8bit.quantize(values, codes, absmax)
        again_codes, again_absmax = torch.empty_like(codes), torch.empty_like(absmax)
        adamw8bit.quantize(adamw8bit.dequantize(codes, absmax, torch.float32), again_codes,
                           again_absmax)
        assert_bits_equal(again_codes, codes, f"{dtype} codes")
        assert_bits_equal(again_absmax, absmax, f"{dtype} absmax")


# ------------------------------------------------------------------- both ops, every backend


@pytest.mark.parametrize("step0", [0.0, 7.0], ids=["step0", "step7"])
@pytest.mark.parametrize("backend,device", BACKEND_CASES)
@pytest.mark.parametrize("op", OP_NAMES)
def test_skipped_step_is_bit_identical(op, backend, device, step0):
    """found_inf set (and an inf in the gradients): nothing is written, the counter included."""
    dev = fo.need(backend, device)
    codes, hyper = OPS[op]
    n = 3 * 1024 + 5
    state = fo.quantized_state(n, codes, dev)
    params = torch.randn(n).to(torch.bfloat16).to(dev)
    before = [t.clone() for t in (*state, params)]
    step = scalar(step0, dev)
    g = torch.randn(n)
    fo.inject(g, fo.choice(["first", "middle", "last"]), math.inf)
    run(backend, op, *state, g.to(dev), params, step, scalar(0.5, dev), scalar(1.0, dev), *hyper)
    for i, (a, b) in enumerate(zip((*state, params), before)):
        assert_bits_equal(a, b, f"{op} skipped step: argument {i}")
    assert step.item() == step0


NON_FINITE = [pytest.param(math.nan, id="nan"), pytest.param(math.inf, id="inf"),
              pytest.param(-math.inf, id="-inf")]


# The Triton interpreter runs the kernel in numpy, which warns when the injected inf meets
# inf in a division: that NaN is the poison this test expects.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("position", ["first", "middle", "last"])
@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize("backend,device", BACKEND_CASES)
@pytest.mark.parametrize("op", OP_NAMES)
def test_non_finite_grad_poisons_its_block_only(op, backend, device, value, position):
    """A non-finite gradient: its element's master follows the float64 oracle (NaN/inf as the
    update makes them), its block's absmax becomes NaN with zero codes in every state buffer;
    every other block is untouched by it, and the next step reads the block back as NaN."""
    dev = fo.need(backend, device)
    codes_dtypes, hyper = OPS[op]
    n = 3 * 1024 + 5
    state = fo.quantized_state(n, codes_dtypes, dev)
    g = torch.randn(n)
    i = fo.inject(g, position, value)
    oracle = fo.oracle_state(state)
    run(backend, op, *state, g.to(dev), None, scalar(3.0, dev), None, None, *hyper)
    getattr(ops, op).reference(*oracle, f64(g), None, scalar(3.0, "cpu"), None, None, *hyper)
    assert_close64(state[0], oracle[0], f"{op}: master with {value} at {i}", rtol=1e-5)
    block = i // QBLOCK
    for k, ((codes, absmax), (_, oracle_absmax)) in enumerate(zip(code_pairs(state),
                                                                  code_pairs(oracle))):
        what = f"{op} state buffer {k}"
        codes, absmax = codes.cpu(), absmax.cpu()
        assert math.isnan(absmax[block].item()), f"{what}: block {block} absmax not NaN"
        assert not codes[block * QBLOCK:(block + 1) * QBLOCK].any(), f"{what}: codes not zeroed"
        others = torch.ones(absmax.numel(), dtype=torch.bool)
        others[block] = False
        assert absmax[others].isfinite().all(), f"{what}: NaN spread to another block"
        assert_close64(absmax, oracle_absmax, f"{what}: absmax", magnitude=0.0)
        back = fo.dequantize64(codes, absmax)
        assert back[block * QBLOCK:min(n, (block + 1) * QBLOCK)].isnan().all(), what


@pytest.mark.parametrize("backend,device", BACKEND_CASES)
@pytest.mark.parametrize("op", OP_NAMES)
def test_empty_buffers(op, backend, device):
    dev = fo.need(backend, device)
    codes, hyper = OPS[op]
    e = torch.empty(0, device=dev)
    state = [e.clone()]
    for dtype in codes:
        state += [e.to(dtype), e.clone()]
    step = scalar(2.0, dev)
    run(backend, op, *state, e.clone(), None, step, None, None, *hyper)
    assert step.item() == 3.0


# ------------------------------------------------------------------- op contract, bad input


def _op_args(op: str, dtype: torch.dtype, optionals: bool, n: int = 101):
    codes, hyper = OPS[op]
    state = fo.quantized_state(n, codes, "cpu")
    g = (torch.randn(n) * 4).to(dtype)
    return (*state, g, torch.randn(n).to(dtype) if optionals else None, scalar(3.0, "cpu"),
            scalar(0.25, "cpu") if optionals else None, scalar(0.0, "cpu") if optionals else None,
            *hyper)


@pytest.mark.parametrize("optionals", [True, False], ids=["optionals", "bare"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("op", OP_NAMES)
def test_opcheck(op, dtype, optionals):
    torch.library.opcheck(getattr(torch.ops.memkern, op).default, _op_args(op, dtype, optionals))


BAD_INPUTS = [  # op, {argument index: value}, error, message fragment
    ("adamw8bit_step_", {1: torch.zeros(101, dtype=torch.uint8)}, TypeError,
     "exp_avg has dtype torch.uint8"),
    ("adamw8bit_step_", {3: torch.zeros(101, dtype=torch.float32)}, TypeError,
     "exp_avg_sq has dtype torch.float32"),
    ("adamw8bit_step_", {2: torch.zeros(101)}, ValueError,
     "exp_avg_absmax must hold one value per block"),
    ("adamw8bit_step_", {4: torch.zeros(fo.blocks_of(101) + 1)}, ValueError,
     "exp_avg_sq_absmax must hold one value per block"),
    ("adamw8bit_step_", {1: torch.zeros(100, dtype=torch.int8)}, ValueError,
     "exp_avg has 100 elements"),
    ("adamw8bit_step_", {5: torch.randn(101, 1)}, ValueError, "grads must be a contiguous 1-D"),
    ("adamw8bit_step_", {11: 1.0}, ValueError, "betas must be in"),
    ("sgd8bit_step_", {9: 0.0}, ValueError, "momentum must be > 0, got 0.0"),
    ("sgd8bit_step_", {1: torch.zeros(101, dtype=torch.uint8)}, TypeError,
     "momentum_buffer has dtype torch.uint8"),
    ("sgd8bit_step_", {1: torch.zeros(100, dtype=torch.int8)}, ValueError,
     "momentum_buffer has 100 elements"),
    ("sgd8bit_step_", {2: torch.zeros(101)}, ValueError,
     "momentum_absmax must hold one value per block"),
    ("sgd8bit_step_", {3: torch.randn(101, 1)}, ValueError, "grads must be a contiguous 1-D"),
    ("sgd8bit_step_", {12: True}, ValueError, "nesterov needs momentum > 0 and dampening == 0"),
    ("sgd8bit_step_", {8: -1.0}, ValueError, "lr, momentum and weight_decay must be >= 0"),
]


@pytest.mark.parametrize("case", range(len(BAD_INPUTS)),
                         ids=[f"{c[0]}-{c[3][:30]}" for c in BAD_INPUTS])
@pytest.mark.parametrize("backend", fo.cpu_backends())
def test_bad_input_raises(backend, case):
    """Each error names the op called (not the 32-bit op whose checks it shares) and what was
    wrong."""
    op, change, exc, fragment = BAD_INPUTS[case]
    args = list(_op_args(op, torch.float32, True))
    for index, value in change.items():
        args[index] = value
    with pytest.raises(exc, match=fragment) as raised:
        run(backend, op, *args)
    assert f"memkern.{op}: " in str(raised.value)
