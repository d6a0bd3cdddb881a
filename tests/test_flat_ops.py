"""Cross-backend tests of the flat-buffer ops (unscale_, l2_norm, adamw_step_, sgd_step_).

Every backend that runs here (reference always; triton under TRITON_INTERPRET=1;
cpu once the C++ extension is built) goes through the public entry under
``memkern.ops.force(backend)`` and is compared with a float64 oracle that shares no code with
memkern, computed from the very values the backend saw: ``torch.optim.AdamW``/``SGD``'s own
step on float64 copies (flat_oracle.adamw_torch / sgd_torch), the float64 product for
unscale_, ``torch.linalg.vector_norm`` in float64 for l2_norm. So the ``reference`` backend's
cases test the reference too. The float64 reference is also checked against the same
oracles at rtol 1e-12, and against ``math.fsum`` and plain multiplication.

Fresh random data every run (conftest prints the seed), odd sizes, write-only outputs
poisoned with NaN, non-finite values at the first/middle/last element. The ``cuda`` variants
run the "cuda" and "triton" backends on CUDA tensors and are skipped without a GPU.
"""
from __future__ import annotations

import math

import pytest
import torch

import flat_oracle as fo
from flat_oracle import assert_bits_equal, assert_close64, bits, f64, scalar
from memkern import ops

CASES = fo.cases()
BACKEND_CASES = fo.cases(with_sizes=False)
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in fo.GRAD_DTYPES]
POSITIONS = ["first", "middle", "last"]
NON_FINITE = [pytest.param(math.nan, id="nan"), pytest.param(math.inf, id="inf"),
              pytest.param(-math.inf, id="-inf")]
N_MULTI_PROGRAM = 3 * 1024 + 5
"""Spans several Triton programs, so first/middle/last land in different ones."""
N_L2_BLOCKS = 2 * 2**16 + 3 * 1024 + 5
"""l2_norm's loops, three trips or more with "last" in a later one: three of the C++ kernel's
65536-element blocks, the last one partial with four 1024-element folds ("last" in the fourth);
17 programs of the Triton kernel's first stage, each summing eight 1024-element steps (the
last program four, "last" in the fourth)."""


def run(backend: str, op, *args):
    with ops.force(backend):
        return op(*args)


def calls(n: int) -> int:
    """Optimizer calls per test: two (the step counter and state carry over) on the small
    sizes, one on the large ones, which are there for the block and thread boundaries."""
    return 2 if n < 65537 else 1


# --------------------------------------------------------------------------------------------
# unscale_


@pytest.mark.parametrize("flag", [0.0, 1.0], ids=["flag0", "flag1"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend,device,n", CASES)
def test_unscale(backend, device, n, dtype, flag):
    dev = fo.need(backend, device)
    inv = fo.odd_multiplier()
    g = fo.scaled_grads(n, dtype, inv)
    grads, found_inf, inv_scale = g.to(dev, copy=True), scalar(flag, dev), scalar(inv, dev)

    run(backend, ops.unscale_, grads, found_inf, inv_scale)

    # bit-exact: the float32 product rounded (to nearest even) to the gradient dtype
    assert_bits_equal(grads, (g.float() * inv_scale.cpu()).to(dtype), f"unscale_ {dtype}")
    # finite data leave the flag exactly as it was (0 stays 0, 1 stays 1)
    assert_bits_equal(found_inf, scalar(flag, dev), "found_inf")
    # and the float64 oracle: within half an ulp of the gradient dtype (float32: exact,
    # since a product of two float32 values is exact in float64)
    oracle = f64(g) * inv_scale.item()
    if dtype == torch.float32:
        assert_bits_equal(grads, oracle.float(), "unscale_ vs float64 oracle")
    else:
        fi = torch.finfo(dtype)
        err = (grads.cpu().double() - oracle).abs()
        allowed = (fi.eps / 2 + 2.0**-23) * oracle.abs() + fi.smallest_normal * fi.eps
        assert bool((err <= allowed).all()), (
            f"worst error {(err / allowed).max().item():.3f}x allowed")


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend,device", BACKEND_CASES)
def test_unscale_non_finite(backend, device, dtype, value, position):
    dev = fo.need(backend, device)
    inv = fo.odd_multiplier()
    g = fo.scaled_grads(N_MULTI_PROGRAM, dtype, inv)
    i = fo.inject(g, position, value)
    grads, found_inf = g.to(dev, copy=True), scalar(0.0, dev)

    run(backend, ops.unscale_, grads, found_inf, scalar(inv, dev))

    assert found_inf.item() == 1.0
    expected = (g.float() * inv).to(dtype)  # torch: inf * s = inf, NaN stays NaN
    out = grads.cpu()
    assert torch.equal(out.isnan(), expected.isnan())
    finite_or_inf = ~expected.isnan()
    assert_bits_equal(out[finite_or_inf], expected[finite_or_inf], "unscale_ around a non-finite")
    assert math.isnan(out[i].item()) if math.isnan(value) else out[i].item() == value


# --------------------------------------------------------------------------------------------
# l2_norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend,device,n", CASES)
def test_l2_norm(backend, device, n, dtype):
    dev = fo.need(backend, device)
    g = (torch.randn(n, dtype=torch.float64) * fo.uniform(0.1, 10.0)).to(dtype)

    out = run(backend, ops.l2_norm, g.to(dev, copy=True))

    assert out.shape == () and out.dtype == torch.float32 and out.device.type == dev.type
    oracle = torch.linalg.vector_norm(f64(g))
    assert_close64(out.reshape(1), oracle.reshape(1), f"l2_norm {dtype} n={n}", magnitude=0.0)


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("value", NON_FINITE + [pytest.param("nan+inf", id="nan+inf")])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend,device", BACKEND_CASES)
def test_l2_norm_non_finite(backend, device, dtype, value, position):
    dev = fo.need(backend, device)
    g = torch.randn(N_L2_BLOCKS, dtype=torch.float64).to(dtype)
    if value == "nan+inf":  # NaN wins, wherever the inf is
        fo.inject(g, position, math.nan)
        g[(g.numel() // 2 + 1) if position != "middle" else -1] = math.inf
    else:
        fo.inject(g, position, value)

    out = run(backend, ops.l2_norm, g.to(dev, copy=True)).item()

    if value == "nan+inf" or math.isnan(value):
        assert math.isnan(out), out
    else:
        assert out == math.inf, out
    ref = torch.linalg.vector_norm(g.double()).item()
    assert math.isnan(ref) == math.isnan(out) and (math.isnan(ref) or ref == out)


@pytest.mark.parametrize("value", [1.0, math.inf, math.nan], ids=["finite", "inf", "nan"])
def test_triton_l2_norm_finish_over_several_steps(value):
    """The Triton kernel's second stage alone, on partials (squared sums) that take three of
    its BLOCK-element steps, with the largest partial, or an inf or a NaN, in the third:
    sqrt of their float64 sum (by hand: math.fsum)."""
    fo.need("triton", "cpu")
    from memkern.kernels import _common
    from memkern.kernels.l2_norm import _finish_kernel

    partials = torch.rand(2 * _common.BLOCK + 77, dtype=torch.float64).to(torch.float32)
    partials[2 * _common.BLOCK + 40] = 1e4 if value == 1.0 else value
    out = torch.empty((), dtype=torch.float32)
    _finish_kernel[(1,)](partials, out, partials.numel(), BLOCK=_common.BLOCK,
                         num_warps=_common.NUM_WARPS)
    got, expected = out.item(), math.sqrt(math.fsum(partials.double().tolist()))
    if math.isnan(value):
        assert math.isnan(got)
    elif math.isinf(value):
        assert got == math.inf
    else:
        assert abs(got - expected) <= 1e-6 * expected, (got, expected)


# --------------------------------------------------------------------------------------------
# adamw_step_


def _adamw_step_and_check(backend, dev, dtype, state, step, hyper, *, with_optionals, it):
    """One step on the backend and on a float64 oracle started from the same state."""
    n = state[0].numel()
    g, params, mult_t, found_inf = fo.step_inputs(n, dtype, dev, with_optionals)
    before = [f64(t) for t in state]
    oracle, oracle_step = fo.adamw_torch(*before, g, step, fo.cpu_clone(mult_t),
                                         fo.cpu_clone(found_inf), *hyper.values())
    step_before = step.item()

    run(backend, ops.adamw_step_, *state, g.to(dev, copy=True), params, step, mult_t, found_inf,
        *hyper.values())

    what = f"adamw_step_ {dtype} n={n} step {step_before:.0f} {hyper}"
    magnitudes = fo.adamw_magnitudes(*before, f64(g), scalar(step_before, "cpu"),
                                     fo.cpu_clone(mult_t), hyper, oracle[2])
    for name, actual, expected, mag in zip(("master", "exp_avg", "exp_avg_sq"), state, oracle,
                                           magnitudes):
        assert_close64(actual, expected, f"{what}: {name} (call {it})", magnitude=mag)
    assert step.item() == step_before + 1 == oracle_step
    if params is not None:  # written from the float32 master in the same pass: bit-exact
        assert_bits_equal(params, state[0].to(dtype), f"{what}: params")
    if found_inf is not None:
        assert found_inf.item() == 0.0


def _adamw_state(n, dev):
    master = torch.randn(n) * fo.uniform(0.02, 1.0)
    exp_avg = torch.randn(n) * 0.1
    exp_avg_sq = torch.rand(n) + 1e-3
    return [t.to(dev) for t in (master, exp_avg, exp_avg_sq)]


@pytest.mark.parametrize("optionals", ["all", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend,device,n", CASES)
def test_adamw_step(backend, device, n, dtype, optionals):
    dev = fo.need(backend, device)
    hyper = fo.adamw_hyper()
    state = _adamw_state(n, dev)
    step = scalar(fo.randint(0, 50), dev)
    for it in range(calls(n)):
        _adamw_step_and_check(backend, dev, dtype, state, step, hyper,
                              with_optionals=optionals == "all", it=it)


@pytest.mark.parametrize(
    "beta1,beta2",
    # beta 0 (0**t), both torch.lerp formulas (weight 1 - beta1 < 0.5 or not), usual values
    [(0.0, 0.0), (0.0, 0.999), (0.3, 0.5), (0.5, 0.9), (0.9, 0.999), (0.99, 0.9999)],
)
@pytest.mark.parametrize("backend,device", BACKEND_CASES)
def test_adamw_step_betas(backend, device, beta1, beta2):
    dev = fo.need(backend, device)
    dtype = torch.bfloat16
    hyper = dict(lr=fo.uniform(0.01, 0.1), beta1=beta1, beta2=beta2, eps=1e-3, weight_decay=0.1)
    state = _adamw_state(1023, dev)
    step = scalar(fo.choice([0, fo.randint(1, 50)]), dev)
    for it in range(2):
        _adamw_step_and_check(backend, dev, dtype, state, step, hyper, with_optionals=True, it=it)


STEP_BITS_CASES = [pytest.param("triton", "cpu", id="triton-cpu"),
                   pytest.param("cuda", "cuda", marks=pytest.mark.cuda, id="cuda"),
                   pytest.param("triton", "cuda", marks=pytest.mark.cuda, id="triton-cuda")]
"""The backends held to the C++ CPU kernel's bits: they run csrc/math's operations in its
order (the CUDA kernel the same functions, the Triton kernels the same operations)."""


def _same_steps_as_cpu(backend, dev, op, state, g, multiplier, hyper, what, steps=2):
    """``steps`` calls of ``op`` on the C++ CPU kernel and on ``backend`` from the same
    ``state`` (the step counter last), gradients ``g`` and multiplier: the same bits."""
    mult = scalar(multiplier, "cpu")
    on_cpu = [None if t is None else t.clone() for t in state[:-1]]
    on_cpu += [g.clone(), fo.poison(g.numel(), g.dtype, "cpu"), state[-1].clone()]
    on_dev = [None if t is None else t.to(dev, copy=True) for t in on_cpu]
    for _ in range(steps):
        run("cpu", op, *on_cpu, mult, None, *hyper.values())
        run(backend, op, *on_dev, mult.to(dev), None, *hyper.values())
    names = ["master"] + ["state"] * (len(state) - 2) + ["grads", "params", "step"]
    for name, a, b in zip(names, on_dev, on_cpu):
        if b is not None:
            assert_bits_equal(a.cpu(), b, f"{what}: {name}")


@pytest.mark.parametrize("beta1", [0.9, 0.3], ids=["lerp-from-start", "lerp-from-end"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend,device", STEP_BITS_CASES)
def test_adamw_step_equals_cpu_bits(backend, device, dtype, beta1):
    """The CUDA kernel runs the C++ CPU kernel's functions (csrc/math/adamw.h), which the tests
    above hold to torch in float64, and the Triton kernel the same operations (``tl.fma`` where
    they fuse a product and a sum; the interpreter's fma rounds once too): the same bits. The
    one place they may differ is the step's float64 factors, ``beta ** t`` by the C library's
    ``pow`` or by repeated squaring, a last-bit difference in float64 that the rounding to
    float32 removes unless the value lies within 2**-29 of a float32 rounding boundary: on
    these steps (t <= 51) it never does. Over odd sizes whose vector trips, blocks and scalar
    tail all run, from an odd multiplier, with an inf and a NaN gradient in later trips and two
    steps so that the step counter is the backend's."""
    dev = fo.need(backend, device)
    fo.need("cpu", "cpu")
    hyper = fo.adamw_hyper() | {"beta1": beta1}
    for n in (7, 2053) + ((fo.BIG,) if backend == "cuda" else ()):
        multiplier = fo.odd_multiplier()
        g = fo.scaled_grads(n, dtype, multiplier)
        g[n // 2], g[-1] = math.inf, math.nan
        state = _adamw_state(n, "cpu") + [scalar(fo.randint(0, 50), "cpu")]
        _same_steps_as_cpu(backend, dev, ops.adamw_step_, state, g, multiplier, hyper,
                           f"adamw_step_ {backend} {dtype} n={n} beta1={beta1}")


@pytest.mark.parametrize("variant", ["plain", "wd", "momentum", "nesterov"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend,device", STEP_BITS_CASES)
def test_sgd_step_equals_cpu_bits(backend, device, dtype, variant):
    """csrc/math/sgd.h on the CPU, the same functions on CUDA, the same operations in Triton:
    the same bits, from the first step (the buffer started from d) to the next, with an inf
    and a NaN gradient and an infinite master weight."""
    dev = fo.need(backend, device)
    fo.need("cpu", "cpu")
    momentum, dampening, nesterov, weight_decay, _ = SGD_VARIANTS[variant]()
    hyper = dict(lr=fo.uniform(0.01, 0.5), momentum=momentum, dampening=dampening,
                 weight_decay=weight_decay, nesterov=nesterov)
    for n in (7, 2053) + ((fo.BIG,) if backend == "cuda" else ()):
        multiplier = fo.odd_multiplier()
        g = fo.scaled_grads(n, dtype, multiplier)
        g[n // 2], g[-1] = math.inf, math.nan
        master = torch.randn(n) * fo.uniform(0.02, 1.0)
        master[n // 3] = -math.inf
        state = [master, fo.poison(n, torch.float32, "cpu") if momentum else None, scalar(0, "cpu")]
        _same_steps_as_cpu(backend, dev, ops.sgd_step_, state, g, multiplier, hyper,
                           f"sgd_step_ {backend} {dtype} n={n} {variant}")


# --------------------------------------------------------------------------------------------
# sgd_step_

SGD_VARIANTS = {
    # name: (momentum, dampening, nesterov, weight_decay, optional tensors given)
    "plain": lambda: (0.0, 0.0, False, 0.0, False),
    "wd": lambda: (0.0, 0.0, False, fo.uniform(0.01, 0.5), False),
    "momentum": lambda: (fo.uniform(0.5, 0.95), fo.uniform(0.0, 0.5), False,
                         fo.uniform(0.01, 0.5), True),
    "nesterov": lambda: (fo.uniform(0.5, 0.95), 0.0, True, fo.uniform(0.01, 0.5), True),
}
SGD_CASES = [("plain", "later"), ("wd", "first"), ("momentum", "first"), ("momentum", "later"),
             ("nesterov", "first"), ("nesterov", "later")]
SGD_BIG_CASES = [("momentum", "first"), ("nesterov", "later")]
"""The size past 2**20 (compiled backends) runs these only: they take every branch."""
SGD_PARAMS = [
    pytest.param(*p.values, variant, start, marks=p.marks, id=f"{p.id}-{variant}-{start}")
    for p in CASES for variant, start in SGD_CASES
    if p.values[2] != fo.BIG or (variant, start) in SGD_BIG_CASES
]


def _sgd_step_and_check(backend, dev, dtype, master, buf, step, hyper, *, with_optionals, it):
    n = master.numel()
    g, params, mult_t, found_inf = fo.step_inputs(n, dtype, dev, with_optionals)
    mag_master, mag_buf = fo.sgd_magnitudes(f64(master), f64(buf), f64(g), step,
                                            fo.cpu_clone(mult_t), hyper)
    oracle_master, oracle_buf = fo.sgd_torch(master, buf, g, step, fo.cpu_clone(mult_t),
                                             fo.cpu_clone(found_inf), *hyper)
    step_before = step.item()

    run(backend, ops.sgd_step_, master, buf, g.to(dev, copy=True), params, step, mult_t,
        found_inf, *hyper)

    what = f"sgd_step_ {dtype} n={n} step {step_before:.0f} {hyper}"
    assert_close64(master, oracle_master, f"{what}: master (call {it})", magnitude=mag_master)
    if buf is not None:
        assert_close64(buf, oracle_buf, f"{what}: momentum_buffer (call {it})", magnitude=mag_buf)
    assert step.item() == step_before + 1
    if params is not None:
        assert_bits_equal(params, master.to(dtype), f"{what}: params")
    if found_inf is not None:
        assert found_inf.item() == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend,device,n,variant,start", SGD_PARAMS)
def test_sgd_step(backend, device, n, variant, start, dtype):
    dev = fo.need(backend, device)
    momentum, dampening, nesterov, weight_decay, with_optionals = SGD_VARIANTS[variant]()
    hyper = (fo.uniform(0.01, 0.5), momentum, dampening, weight_decay, nesterov)
    master = (torch.randn(n) * fo.uniform(0.02, 1.0)).to(dev)
    buf = None
    if momentum != 0.0:
        # On the first step the buffer is initialised from d, whatever it holds: poison it.
        buf = (fo.poison(n, torch.float32, dev) if start == "first"
               else (torch.randn(n) * 0.1).to(dev))
    step = scalar(0 if start == "first" else fo.randint(1, 50), dev)
    for it in range(calls(n)):  # "first": the initialisation, then an ordinary momentum step
        _sgd_step_and_check(backend, dev, dtype, master, buf, step, hyper,
                            with_optionals=with_optionals, it=it)


@pytest.mark.parametrize("momentum", [0.0, 0.9], ids=["plain", "momentum"])
@pytest.mark.parametrize("backend,device", BACKEND_CASES)
def test_sgd_step_keeps_an_infinite_master_without_weight_decay(backend, device, momentum):
    """weight_decay = 0 adds no decay term: an infinite master weight stays infinite, as in
    torch (0 * inf would make it NaN; the C++ CPU kernel once did)."""
    dev = fo.need(backend, device)
    n = 37
    master = torch.randn(n)
    master[3], master[-1] = math.inf, -math.inf
    buf = (torch.randn(n) * 0.1) if momentum else None
    g = torch.randn(n)
    step = scalar(fo.randint(1, 50), "cpu")
    hyper = (0.1, momentum, 0.0, 0.0, False)
    oracle_master, _ = fo.sgd_torch(master, buf, g, step, None, None, *hyper)
    on_dev = [t.to(dev) if t is not None else None for t in (master, buf, g, step)]
    run(backend, ops.sgd_step_, on_dev[0], on_dev[1], on_dev[2], None, on_dev[3], None, None,
        *hyper)
    assert oracle_master[3] == math.inf and oracle_master[-1] == -math.inf
    assert_close64(on_dev[0].cpu(), oracle_master, f"sgd_step_ {backend}: master")


# --------------------------------------------------------------------------------------------
# skipped steps and non-finite gradients in the optimizers


def _optimizer_args(op: str, n: int, dtype, dev, *, step0: int, found_inf, beta1=None):
    g = fo.scaled_grads(n, dtype, None)
    fo.inject(g, fo.choice(POSITIONS), math.inf)  # what a skipped step usually sees
    common = dict(grads=g.to(dev, copy=True), params=fo.poison(n, dtype, dev),
                  step=scalar(step0, dev), grad_multiplier=scalar(fo.odd_multiplier(), dev),
                  found_inf=found_inf)
    if op == "adamw_step_":
        master, exp_avg, exp_avg_sq = _adamw_state(n, dev)
        hyper = fo.adamw_hyper()
        if beta1 is not None:
            hyper["beta1"] = beta1
        return (master, exp_avg, exp_avg_sq, common["grads"], common["params"], common["step"],
                common["grad_multiplier"], found_inf, *hyper.values())
    master = (torch.randn(n) * 0.5).to(dev)
    buf = (torch.randn(n) * 0.1).to(dev)
    return (master, buf, common["grads"], common["params"], common["step"],
            common["grad_multiplier"], found_inf, 0.1, 0.9, 0.1, 0.01, False)


@pytest.mark.parametrize("step0", [0, 17])
@pytest.mark.parametrize("op", ["adamw_step_", "sgd_step_"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend,device", BACKEND_CASES)
def test_skipped_step_is_bit_identical(backend, device, dtype, op, step0):
    dev = fo.need(backend, device)
    flag = fo.choice([1.0, 2.5, math.inf])  # any non-zero found_inf skips
    args = _optimizer_args(op, 2053, dtype, dev, step0=step0, found_inf=scalar(flag, dev))
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]

    run(backend, getattr(ops, op), *args)

    for i, (a, b) in enumerate(zip(args, before)):
        if isinstance(a, torch.Tensor):  # params (NaN-poisoned) and step included
            assert torch.equal(bits(a), bits(b)), f"{op}: argument {i} changed on a skipped step"


OPTIMIZERS = [pytest.param("adamw_step_", 0.9, id="adamw-beta1=0.9"),
              # torch.lerp's other formula, g - (g - m) * beta1: an inf gradient gives m = NaN
              pytest.param("adamw_step_", 0.3, id="adamw-beta1=0.3"),
              pytest.param("sgd_step_", None, id="sgd")]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # interpreter
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("value", [pytest.param(math.nan, id="nan"),
                                   pytest.param(math.inf, id="inf")])
@pytest.mark.parametrize("op,beta1", OPTIMIZERS)
@pytest.mark.parametrize("backend,device", BACKEND_CASES)
def test_optimizer_non_finite_grads_propagate(backend, device, op, beta1, value, position):
    """Without found_inf a non-finite gradient goes through the math as in torch."""
    dev = fo.need(backend, device)
    args = list(_optimizer_args(op, N_MULTI_PROGRAM, torch.float32, dev, step0=fo.randint(0, 9),
                                found_inf=None, beta1=beta1))
    gi = 3 if op == "adamw_step_" else 2
    args[gi][args[gi].isinf()] = 1.0
    fo.inject(args[gi], position, value)
    inputs = [fo.cpu_clone(a) if isinstance(a, torch.Tensor) else a for a in args]
    del inputs[gi + 1]  # params: checked against master below
    if op == "adamw_step_":
        oracle, _ = fo.adamw_torch(*inputs)
    else:
        oracle = fo.sgd_torch(*inputs)

    run(backend, getattr(ops, op), *args)

    names = (("master", "exp_avg", "exp_avg_sq") if op == "adamw_step_"
             else ("master", "momentum_buffer"))
    for i, name in enumerate(names):
        assert_close64(args[i], oracle[i], f"{op} {name} with {value} at {position}")
    assert_bits_equal(args[gi + 1], args[0].to(args[gi + 1].dtype), "params")


# --------------------------------------------------------------------------------------------
# empty buffers


@pytest.mark.parametrize("backend,device", BACKEND_CASES)
def test_empty_buffers(backend, device):
    dev = fo.need(backend, device)
    e = torch.empty(0, device=dev)
    found_inf = scalar(0.0, dev)
    run(backend, ops.unscale_, e.clone(), found_inf, scalar(0.5, dev))
    assert found_inf.item() == 0.0
    norm = run(backend, ops.l2_norm, e.to(torch.bfloat16))
    assert norm.shape == () and norm.dtype == torch.float32 and norm.item() == 0.0
    for flag, advanced in ((None, True), (0.0, True), (1.0, False)):
        fi = None if flag is None else scalar(flag, dev)
        step = scalar(5.0, dev)
        run(backend, ops.adamw_step_, e.clone(), e.clone(), e.clone(), e.clone(), e.clone(), step,
            None, fi, 1e-3, 0.9, 0.999, 1e-8, 0.01)
        assert step.item() == (6.0 if advanced else 5.0)
        step = scalar(0.0, dev)
        run(backend, ops.sgd_step_, e.clone(), e.clone(), e.clone(), None, step, None, fi,
            0.1, 0.9, 0.0, 0.0, False)
        assert step.item() == (1.0 if advanced else 0.0)


# --------------------------------------------------------------------------------------------
# the float64 reference against independent oracles


@pytest.mark.parametrize("case", ["random", "beta1=0", "no-decay", "multiplier"])
def test_adamw_reference_matches_torch_optim(case):
    hyper = fo.adamw_hyper()
    if case == "beta1=0":
        hyper["beta1"] = 0.0
    if case == "no-decay":
        hyper["weight_decay"] = 0.0
    n = 257
    master = torch.randn(n, dtype=torch.float64)
    exp_avg = torch.randn(n, dtype=torch.float64) * 0.1
    exp_avg_sq = torch.rand(n, dtype=torch.float64) + 1e-3
    step0 = fo.randint(0, 50)
    step = scalar(step0, "cpu")
    p = torch.nn.Parameter(master.clone())
    opt = torch.optim.AdamW([p], lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]),
                            eps=hyper["eps"], weight_decay=hyper["weight_decay"], foreach=False)
    opt.state[p] = {"step": torch.tensor(float(step0)), "exp_avg": exp_avg.clone(),
                    "exp_avg_sq": exp_avg_sq.clone()}
    for _ in range(5):
        mult = fo.odd_multiplier() if case == "multiplier" else None
        g = torch.randn(n, dtype=torch.float64) / (mult or 1.0)
        p.grad = g * mult if mult is not None else g.clone()
        opt.step()
        ops.adamw_step_.reference(master, exp_avg, exp_avg_sq, g, None, step,
                                  None if mult is None else scalar(mult, "cpu"), None,
                                  *hyper.values())
        st = opt.state[p]
        assert_close64(master, p.detach(), "master vs torch.optim.AdamW", rtol=1e-12)
        assert_close64(exp_avg, st["exp_avg"], "exp_avg vs torch.optim.AdamW", rtol=1e-12)
        assert_close64(exp_avg_sq, st["exp_avg_sq"], "exp_avg_sq vs torch.optim.AdamW", rtol=1e-12)
        assert step.item() == st["step"].item()


@pytest.mark.parametrize(
    "momentum,dampening,nesterov,weight_decay",
    [(0.0, 0.0, False, 0.0), (0.0, 0.0, False, 0.1), (0.9, 0.0, False, 0.0),
     (0.9, 0.3, False, 0.05), (0.8, 0.0, True, 0.01)],
)
def test_sgd_reference_matches_torch_optim(momentum, dampening, nesterov, weight_decay):
    n, lr = 257, fo.uniform(0.01, 0.5)
    master = torch.randn(n, dtype=torch.float64)
    buf = fo.poison(n, torch.float64, "cpu") if momentum else None  # step 0 ignores it
    step = scalar(0.0, "cpu")
    p = torch.nn.Parameter(master.clone())
    opt = torch.optim.SGD([p], lr=lr, momentum=momentum, dampening=dampening,
                          weight_decay=weight_decay, nesterov=nesterov, foreach=False)
    for it in range(5):
        mult = fo.odd_multiplier() if it % 2 else None
        g = torch.randn(n, dtype=torch.float64) / (mult or 1.0)
        p.grad = g * mult if mult is not None else g.clone()
        opt.step()
        ops.sgd_step_.reference(master, buf, g, None, step,
                                None if mult is None else scalar(mult, "cpu"), None,
                                lr, momentum, dampening, weight_decay, nesterov)
        assert_close64(master, p.detach(), f"master vs torch.optim.SGD (step {it})", rtol=1e-12)
        if momentum:
            assert_close64(buf, opt.state[p]["momentum_buffer"], "momentum_buffer", rtol=1e-12)
        assert step.item() == it + 1


def test_unscale_reference_is_a_multiplication():
    g = torch.randn(1000, dtype=torch.float64) * 1000
    g[3], g[500] = math.inf, math.nan
    inv = fo.odd_multiplier()
    out, found_inf = g.clone(), scalar(0.0, "cpu")
    ops.unscale_.reference(out, found_inf, scalar(inv, "cpu"))
    expected = torch.tensor([x * inv for x in g.tolist()], dtype=torch.float64)
    assert torch.equal(bits(out), bits(expected)) and found_inf.item() == 1.0
    finite = torch.randn(1000, dtype=torch.float64)
    ops.unscale_.reference(finite, found_inf := scalar(0.0, "cpu"), scalar(inv, "cpu"))
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_l2_norm_reference_matches_fsum(dtype):
    g = (torch.randn(2**20 + 5, dtype=torch.float64) * fo.uniform(0.1, 10.0)).to(dtype)
    exact = math.sqrt(math.fsum(x * x for x in g.double().tolist()))
    out = ops.l2_norm.reference(g)
    assert out.shape == () and out.dtype == torch.promote_types(dtype, torch.float32)
    rtol = 1e-14 if dtype == torch.float64 else 1e-6
    assert abs(out.item() - exact) <= rtol * exact, (out.item(), exact)


# --------------------------------------------------------------------------------------------
# torch.library.opcheck and argument errors


def _op_args(name: str, dtype: torch.dtype, optionals: bool, n: int = 37):
    g = (torch.randn(n) * 4).to(dtype)
    mult = scalar(0.25, "cpu") if optionals else None
    found_inf = scalar(0.0, "cpu") if optionals else None
    params = torch.randn(n).to(dtype) if optionals else None
    if name == "unscale_":
        return (g, scalar(0.0, "cpu"), scalar(0.125, "cpu"))
    if name == "l2_norm":
        return (g,)
    if name == "adamw_step_":
        return (torch.randn(n), torch.randn(n) * 0.1, torch.rand(n) + 0.01, g, params,
                scalar(3.0, "cpu"), mult, found_inf, 1e-3, 0.9, 0.999, 1e-8, 0.01)
    return (torch.randn(n), torch.randn(n) * 0.1, g, params, scalar(3.0, "cpu"), mult,
            found_inf, 0.1, 0.9, 0.0, 0.01, True)


OPCHECK = [("unscale_", True), ("l2_norm", True), ("adamw_step_", True), ("adamw_step_", False),
           ("sgd_step_", True), ("sgd_step_", False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name,optionals", OPCHECK,
                         ids=[f"{n}-{'optionals' if o else 'bare'}" for n, o in OPCHECK])
def test_opcheck(name, optionals, dtype):
    torch.library.opcheck(getattr(torch.ops.memkern, name).default,
                          _op_args(name, dtype, optionals))


def _bad(name, **change):
    args = list(_op_args(name, torch.float32, True))
    for index, value in change.items():
        args[int(index[1:])] = value
    return args


BAD_INPUTS = [
    # (op, args, exception, message fragment)
    ("unscale_", lambda: _bad("unscale_", a0=torch.randn(4, 5)), ValueError,
     "grads must be a contiguous 1-D"),
    ("unscale_", lambda: _bad("unscale_", a1=torch.zeros(1, dtype=torch.float64)), ValueError,
     "found_inf must be a one-element float32"),
    ("unscale_", lambda: _bad("unscale_", a2=torch.ones(2)), ValueError,
     "inv_scale must be a one-element"),
    ("l2_norm", lambda: [torch.randn(10)[::2]], ValueError, "grads must be a contiguous 1-D"),
    ("l2_norm", lambda: [torch.arange(5)], TypeError, "grads has dtype torch.int64"),
    ("adamw_step_", lambda: _bad("adamw_step_", a1=torch.randn(36)), ValueError,
     "exp_avg has 36 elements"),
    ("adamw_step_", lambda: _bad("adamw_step_", a0=torch.randn(37).half(),
                                 a1=torch.randn(37).half(), a2=torch.rand(37).half()), TypeError,
     "master has dtype torch.float16"),
    ("adamw_step_", lambda: _bad("adamw_step_", a3=torch.randn(37, 1)), ValueError,
     "grads must be a contiguous 1-D"),
    ("adamw_step_", lambda: _bad("adamw_step_", a7=torch.zeros(1, dtype=torch.int32)), ValueError,
     "found_inf must be a one-element float32"),
    ("adamw_step_", lambda: _bad("adamw_step_", a9=1.0), ValueError, "betas must be in"),
    ("sgd_step_", lambda: _bad("sgd_step_", a1=None), ValueError, "needs a momentum_buffer"),
    ("sgd_step_", lambda: _bad("sgd_step_", a3=torch.randn(38)), ValueError,
     "params has 38 elements"),
    ("sgd_step_", lambda: _bad("sgd_step_", a9=0.5), ValueError,
     "nesterov needs momentum > 0 and dampening == 0"),
]


@pytest.mark.parametrize("case", range(len(BAD_INPUTS)),
                         ids=[f"{c[0]}-{c[3][:24]}" for c in BAD_INPUTS])
@pytest.mark.parametrize("backend", fo.cpu_backends())
def test_bad_input_raises(backend, case):
    name, make, exc, fragment = BAD_INPUTS[case]
    with pytest.raises(exc, match=fragment):
        run(backend, getattr(ops, name), *make())


@pytest.mark.parametrize("name,argument,index", [("unscale_", "grads", 0), ("l2_norm", "grads", 0),
                                                 ("adamw_step_", "master", 0),
                                                 ("adamw_step_", "grads", 3),
                                                 ("sgd_step_", "master", 0)])
def test_triton_rejects_float64(name, argument, index):
    """float64 passes the op's checks (the reference is the float64 oracle); the Triton
    kernels refuse it with an error that names the argument."""
    if "triton" not in fo.cpu_backends():
        pytest.skip("triton cannot run here")
    args = list(_op_args(name, torch.float32, True))
    if argument == "master":  # master and its same-dtype state go float64 together
        for i in (range(3) if name == "adamw_step_" else range(2)):
            args[i] = args[i].double()
    else:
        args[index] = args[index].double()
    with pytest.raises(ValueError, match=f"{argument} has dtype torch.float64"):
        run("triton", getattr(ops, name), *args)
