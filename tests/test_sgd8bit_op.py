"""``memkern::sgd8bit_step_`` on every backend against the float64 oracle of the quantized
algorithm (the op's ``reference()`` run on float64 master and absmax: dequantize, update and
requantize in float64), and the reference itself against ``torch.optim.SGD`` step by step.
The map (shared with AdamW's first moment) is checked by hand in test_adamw8bit_op.py.

Fresh random data every run (conftest prints the seed), odd sizes (none a multiple of the
block), outputs poisoned, NaN/inf injected at the first/middle/last element.
"""
from __future__ import annotations

import math

import pytest
import torch

import flat_oracle as fo
from flat_oracle import assert_bits_equal, assert_close64, f64, scalar
from memkern import ops
from memkern.kernels.state8bit import QBLOCK, SIGNED_CODES, num_blocks
from memkern.ops import adamw8bit
from test_adamw8bit_op import assert_codes_close, block_max

CASES = fo.cases()
BACKEND_CASES = fo.cases(with_sizes=False)
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in fo.GRAD_DTYPES]
VARIANTS = {
    # name: momentum, dampening, nesterov, weight_decay
    "momentum": lambda: (fo.uniform(0.5, 0.95), fo.uniform(0.0, 0.5), False,
                         fo.choice([0.0, fo.uniform(0.01, 0.5)])),
    "nesterov": lambda: (fo.uniform(0.5, 0.95), 0.0, True, fo.uniform(0.01, 0.5)),
}


def run(backend: str, *args) -> None:
    with ops.force(backend):
        ops.sgd8bit_step_(*args)


def random_state(n: int, dev) -> list[torch.Tensor]:
    """master, momentum codes, momentum absmax: a buffer spread over several decades within a
    block (what the map must resolve), quantized with the reference."""
    master = torch.randn(n) * fo.uniform(0.02, 1.0)
    buf = torch.randn(n) * 0.1 * 10 ** (2 * torch.rand(n) - 2)
    state = [master, torch.empty(n, dtype=torch.int8), torch.empty(num_blocks(n))]
    adamw8bit.quantize(buf, state[1], state[2])
    return [t.to(dev) for t in state]


def oracle_copy(state: list[torch.Tensor]) -> list[torch.Tensor]:
    """The state for the float64 oracle: float64 master and absmax, the same codes."""
    master, codes, absmax = state
    return [f64(master), codes.cpu().clone(), f64(absmax)]


def step_and_check(backend, dev, dtype, state, step, hyper, *, with_optionals, it):
    n = state[0].numel()
    multiplier = fo.odd_multiplier() if with_optionals else None
    g = torch.randn(n)
    g = (g / multiplier if multiplier is not None else g).to(dtype)
    params = fo.poison(n, dtype, dev) if with_optionals else None
    mult_t = scalar(multiplier, dev) if with_optionals else None
    found_inf = scalar(0.0, dev) if with_optionals else None
    oracle = oracle_copy(state)
    before_buf = adamw8bit.dequantize(oracle[1], oracle[2], torch.float64)
    step_before = step.item()
    mag_master, mag_buf = fo.sgd_magnitudes(oracle[0], before_buf, f64(g), step.cpu(),
                                            fo.cpu_clone(mult_t), hyper)
    oracle_step = step.cpu().clone()

    run(backend, *state, g.to(dev, copy=True), params, step, mult_t, found_inf, *hyper)
    ops.sgd8bit_step_.reference(*oracle, f64(g), None, oracle_step, fo.cpu_clone(mult_t),
                                fo.cpu_clone(found_inf), *hyper)

    what = f"sgd8bit_step_ {dtype} n={n} step {step_before:.0f} {hyper} (call {it})"
    assert_close64(state[0], oracle[0], f"{what}: master", magnitude=mag_master)
    assert_codes_close(state[1], oracle[1], f"{what}: momentum codes")
    assert_close64(state[2], oracle[2], f"{what}: momentum_absmax", magnitude=block_max(mag_buf))
    assert step.item() == step_before + 1 == oracle_step.item()
    if params is not None:  # written from the float32 master in the same pass: bit-exact
        assert_bits_equal(params, state[0].to(dtype), f"{what}: params")


@pytest.mark.parametrize("start", ["first", "later"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend,device,n", CASES)
def test_sgd8bit_step(backend, device, n, dtype, variant, start):
    """``first``: the step counter is 0, the buffer is started from the gradient whatever the
    codes hold (random ones here), then an ordinary step; ``later``: two ordinary steps."""
    dev = fo.need(backend, device)
    momentum, dampening, nesterov, weight_decay = VARIANTS[variant]()
    hyper = (fo.uniform(0.01, 0.5), momentum, dampening, weight_decay, nesterov)
    state = random_state(n, dev)
    step = scalar(0 if start == "first" else fo.randint(1, 50), dev)
    # 16-bit parameters as the optimizer runs them (params written back, loss scale and found_inf
    # given); float32 ones bare (the master is the weight)
    optionals = dtype != torch.float32
    for it in range(2 if n < 65537 else 1):
        step_and_check(backend, dev, dtype, state, step, hyper, with_optionals=optionals, it=it)


@pytest.mark.parametrize("backend,device", BACKEND_CASES)
def test_sgd8bit_step_from_zero_state(backend, device):
    """The all-zero state (absmax 0: the zero-block branch of the map) at a step > 0, as after
    momentum was switched on mid-run: buf = (1 - dampening) * d."""
    dev = fo.need(backend, device)
    n = 1023
    state = [torch.randn(n).to(dev), torch.zeros(n, dtype=torch.int8, device=dev),
             torch.zeros(num_blocks(n), device=dev)]
    hyper = (0.1, 0.9, 0.25, 0.0, False)
    step = scalar(5.0, dev)
    for it in range(2):
        step_and_check(backend, dev, torch.bfloat16, state, step, hyper, with_optionals=True,
                       it=it)


@pytest.mark.parametrize("step0", [0.0, 7.0], ids=["step0", "step7"])
@pytest.mark.parametrize("backend,device", BACKEND_CASES)
def test_skipped_step_is_bit_identical(backend, device, step0):
    dev = fo.need(backend, device)
    n = 3 * 1024 + 5
    state = random_state(n, dev)
    params = torch.randn(n).to(torch.bfloat16).to(dev)
    before = [t.clone() for t in (*state, params)]
    step = scalar(step0, dev)
    g = torch.randn(n, device=dev)
    fo.inject(g, fo.choice(["first", "middle", "last"]), math.inf)
    run(backend, *state, g, params, step, scalar(0.5, dev), scalar(1.0, dev),
        0.1, 0.9, 0.0, 0.01, True)
    for name, a, b in zip(("master", "momentum_buffer", "momentum_absmax", "params"),
                          (*state, params), before):
        assert_bits_equal(a, b, f"skipped step: {name}")
    assert step.item() == step0


NON_FINITE = [pytest.param(math.nan, id="nan"), pytest.param(math.inf, id="inf"),
              pytest.param(-math.inf, id="-inf")]


@pytest.mark.parametrize("position", ["first", "middle", "last"])
@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize("backend,device", BACKEND_CASES)
def test_non_finite_grad_poisons_its_block_only(backend, device, value, position):
    """A non-finite gradient: its element's master follows the float64 oracle (NaN/inf as SGD
    makes them), its block's absmax becomes NaN with zero codes; every other block is
    untouched by it, and the next step reads the poisoned block back as NaN."""
    dev = fo.need(backend, device)
    n = 3 * 1024 + 5
    state = random_state(n, dev)
    g = torch.randn(n)
    i = fo.inject(g, position, value)
    oracle = oracle_copy(state)
    hyper = (0.05, 0.9, 0.1, 0.01, False)
    run(backend, *state, g.to(dev), None, scalar(3.0, dev), None, None, *hyper)
    ops.sgd8bit_step_.reference(*oracle, f64(g), None, scalar(3.0, "cpu"), None, None, *hyper)
    assert_close64(state[0], oracle[0], f"master with {value} at {i}", rtol=1e-5)
    codes, absmax = state[1].cpu(), state[2].cpu()
    block = i // QBLOCK
    assert math.isnan(absmax[block].item()), f"block {block} absmax not NaN"
    assert not codes[block * QBLOCK:(block + 1) * QBLOCK].any(), "codes not zeroed"
    others = torch.ones(absmax.numel(), dtype=torch.bool)
    others[block] = False
    assert absmax[others].isfinite().all(), "NaN spread to another block"
    assert_close64(state[2], oracle[2], "momentum_absmax", magnitude=0.0)
    buf = adamw8bit.dequantize(codes, absmax, torch.float32)
    assert buf[block * QBLOCK:min(n, (block + 1) * QBLOCK)].isnan().all()


@pytest.mark.parametrize("backend,device", BACKEND_CASES)
def test_empty_buffers(backend, device):
    dev = fo.need(backend, device)
    e = torch.empty(0, device=dev)
    step = scalar(2.0, dev)
    run(backend, e.clone(), e.to(torch.int8), e.clone(), e.clone(), None, step, None, None,
        1e-3, 0.9, 0.0, 0.0, False)
    assert step.item() == 3.0


# ------------------------------------------------------------------- the reference itself


@pytest.mark.parametrize("nesterov", [False, True], ids=["heavy-ball", "nesterov"])
def test_reference_steps_like_torch_sgd_from_the_stored_buffer(nesterov):
    """Every step of a 30-step run against torch.optim.SGD started from the same master and
    from the buffer the codes hold: the master equals torch's to float64 rounding (the update
    uses the exact new buffer), and the stored buffer is torch's new one to within the map's
    coarsest rounding, 1/127 of its block's absmax. The first step (counter 0) ignores the
    codes, as torch has no buffer yet."""
    n = 2 * QBLOCK + 9
    dampening = 0.0 if nesterov else 0.2
    hyper = dict(lr=0.03, momentum=0.9, dampening=dampening, weight_decay=0.1,
                 nesterov=nesterov)
    master = torch.randn(n, dtype=torch.float64)
    codes = torch.randint(-127, 128, (n,), dtype=torch.int8)  # ignored on the first step
    absmax = torch.rand(num_blocks(n), dtype=torch.float64)
    step = torch.zeros(1)
    for t in range(30):
        g = torch.randn(n, dtype=torch.float64) * (1 + torch.arange(n) / n)
        p = torch.nn.Parameter(master.clone())
        p.grad = g.clone()
        torch_opt = torch.optim.SGD([p], **hyper, foreach=False)
        if t > 0:
            torch_opt.state[p]["momentum_buffer"] = adamw8bit.dequantize(codes, absmax,
                                                                         torch.float64)
        torch_opt.step()
        ops.sgd8bit_step_.reference(master, codes, absmax, g, None, step, None, None,
                                    *hyper.values())
        assert torch.allclose(master, p.detach(), rtol=1e-13, atol=1e-15), f"step {t}"
        expected = torch_opt.state[p]["momentum_buffer"]
        stored = adamw8bit.dequantize(codes, absmax, torch.float64)
        bound = absmax.repeat_interleave(QBLOCK)[:n] / SIGNED_CODES
        assert ((stored - expected).abs() <= bound).all(), f"step {t}"
        assert torch.allclose(absmax, block_max(expected.abs()), rtol=1e-14, atol=0), f"step {t}"
    assert step.item() == 30


# ------------------------------------------------------------------- op contract, bad input


def _op_args(dtype: torch.dtype, optionals: bool, n: int = 101):
    state = random_state(n, "cpu")
    g = (torch.randn(n) * 4).to(dtype)
    return (*state, g, torch.randn(n).to(dtype) if optionals else None, scalar(3.0, "cpu"),
            scalar(0.25, "cpu") if optionals else None, scalar(0.0, "cpu") if optionals else None,
            1e-2, 0.9, 0.1, 0.01, False)


@pytest.mark.parametrize("optionals", [True, False], ids=["optionals", "bare"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_opcheck(dtype, optionals):
    torch.library.opcheck(torch.ops.memkern.sgd8bit_step_.default, _op_args(dtype, optionals))


def _bad(**change):
    args = list(_op_args(torch.float32, True))
    for index, value in change.items():
        args[int(index[1:])] = value
    return args


BAD_INPUTS = [
    (lambda: _bad(a9=0.0), ValueError, "momentum must be > 0, got 0.0"),
    (lambda: _bad(a1=torch.zeros(101, dtype=torch.uint8)), TypeError,
     "momentum_buffer has dtype torch.uint8"),
    (lambda: _bad(a1=torch.zeros(100, dtype=torch.int8)), ValueError,
     "momentum_buffer has 100 elements"),
    (lambda: _bad(a2=torch.zeros(101)), ValueError, "momentum_absmax must hold one value per block"),
    (lambda: _bad(a3=torch.randn(101, 1)), ValueError, "grads must be a contiguous 1-D"),
    (lambda: _bad(a12=True), ValueError, "nesterov needs momentum > 0 and dampening == 0"),
    (lambda: _bad(a8=-1.0), ValueError, "lr, momentum and weight_decay must be >= 0"),
]


@pytest.mark.parametrize("case", range(len(BAD_INPUTS)), ids=[c[2][:30] for c in BAD_INPUTS])
@pytest.mark.parametrize("backend", fo.cpu_backends())
def test_bad_input_raises(backend, case):
    make, exc, fragment = BAD_INPUTS[case]
    with pytest.raises(exc, match=fragment):
        run(backend, *make())
