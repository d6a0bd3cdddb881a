"""``memkern::adamw8bit_step_`` on every backend against the float64 oracle of the quantized
algorithm (the op's ``reference()`` run on float64 master and absmax: dequantize, update and
requantize in float64), and the reference itself against ``torch.optim.AdamW``. The map, skipped
steps, non-finite gradients, empty buffers and bad input: test_state8bit_ops.py.

Fresh random data every run (conftest prints the seed), odd sizes (none a multiple of the
QBLOCK-element block), outputs poisoned, NaN/inf injected at the first/middle/last element.
"""
from __future__ import annotations

import pytest
import torch

import flat_oracle as fo
from flat_oracle import scalar
from memkern import ops
from memkern.kernels.state8bit import QBLOCK, num_blocks

CASES = fo.cases()
BACKEND_CASES = fo.cases(with_sizes=False)
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in fo.GRAD_DTYPES]


def random_state(n: int, dev) -> list[torch.Tensor]:
    """master, m codes, m absmax, v codes, v absmax."""
    return fo.quantized_state(n, (torch.int8, torch.uint8), dev)


def step_and_check(backend, dev, dtype, state, step, hyper, *, with_optionals, it):
    def magnitudes(master, moments, g, step_before, multiplier):
        m, v = moments
        _, _, new_v = ops.adamw.update(master, m, v, g, step_before, multiplier,
                                       *hyper.values())
        return fo.adamw_magnitudes(master, m, v, g, step_before, multiplier, hyper, new_v)

    fo.check_8bit_step("adamw8bit_step_", backend, dev, dtype, state, step,
                       tuple(hyper.values()), ("exp_avg", "exp_avg_sq"), magnitudes,
                       with_optionals=with_optionals, it=it)


@pytest.mark.parametrize("optionals", ["all", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend,device,n", CASES)
def test_adamw8bit_step(backend, device, n, dtype, optionals):
    dev = fo.need(backend, device)
    hyper = fo.adamw_hyper()
    state = random_state(n, dev)
    step = scalar(fo.randint(0, 50), dev)
    for it in range(2 if n < 65537 else 1):
        step_and_check(backend, dev, dtype, state, step, hyper,
                       with_optionals=optionals == "all", it=it)


@pytest.mark.parametrize("beta1,beta2", [(0.0, 0.0), (0.3, 0.5), (0.9, 0.999), (0.99, 0.9999)])
@pytest.mark.parametrize("backend,device", BACKEND_CASES)
def test_adamw8bit_step_betas_from_zero_state(backend, device, beta1, beta2):
    """Both torch.lerp branches, beta 0, and the first step from the all-zero state (absmax 0:
    the zero-block branch of the map)."""
    dev = fo.need(backend, device)
    n = 1023
    state = [torch.randn(n), torch.zeros(n, dtype=torch.int8), torch.zeros(num_blocks(n)),
             torch.zeros(n, dtype=torch.uint8), torch.zeros(num_blocks(n))]
    state = [t.to(dev) for t in state]
    hyper = dict(lr=fo.uniform(0.01, 0.1), beta1=beta1, beta2=beta2, eps=1e-3, weight_decay=0.1)
    step = scalar(0, dev)
    for it in range(2):
        step_and_check(backend, dev, torch.bfloat16, state, step, hyper, with_optionals=True,
                       it=it)


@pytest.mark.cuda
@pytest.mark.parametrize("beta1", [0.9, 0.3], ids=["lerp-from-start", "lerp-from-end"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_adamw8bit_step_cuda_equals_cpu_bits(dtype, beta1):
    """The CUDA kernel runs the C++ CPU kernel's element math (csrc/math/adamw.h, state8bit.h),
    which the tests above hold to the float64 oracle: both give the same codes, absmax and
    master bits. Sizes with whole blocks and a partial last one, an all-zero block (zero codes)
    and a block with an inf gradient (NaN absmax) in later blocks, over two steps."""
    dev = fo.need("cuda", "cuda")
    fo.need("cpu", "cpu")
    hyper = fo.adamw_hyper() | {"beta1": beta1}
    for n in (7, 3 * QBLOCK + 5, fo.BIG):
        state = random_state(n, "cpu")
        multiplier = fo.odd_multiplier()
        g = fo.scaled_grads(n, dtype, multiplier)
        if n > 2 * QBLOCK:
            g[QBLOCK:2 * QBLOCK] = 0.0
            state[1][QBLOCK:2 * QBLOCK] = 0
            state[3][QBLOCK:2 * QBLOCK] = 0
            g[-QBLOCK] = float("inf")
        step, mult = scalar(fo.randint(0, 50), "cpu"), scalar(multiplier, "cpu")
        on_cpu = state + [g, fo.poison(n, dtype, "cpu"), step]
        on_gpu = [t.to(dev, copy=True) for t in on_cpu]
        for _ in range(2):
            with ops.force("cpu"):
                ops.adamw8bit_step_(*on_cpu, mult, None, *hyper.values())
            with ops.force("cuda"):
                ops.adamw8bit_step_(*on_gpu, mult.to(dev), None, *hyper.values())
        names = ("master", "exp_avg", "exp_avg_absmax", "exp_avg_sq", "exp_avg_sq_absmax",
                 "grads", "params", "step")
        for name, a, b in zip(names, on_gpu, on_cpu):
            fo.assert_bits_equal(a, b, f"adamw8bit_step_ {dtype} n={n} beta1={beta1}: {name}")


# ------------------------------------------------------------------- the reference itself


def test_reference_follows_torch_adamw():
    """From the zero state the first step is exactly torch.optim.AdamW's (zero is exact in the
    map); over 30 steps the 8-bit master stays within 2% of torch's travelled distance."""
    n = 2 * QBLOCK + 9
    w0 = torch.randn(n, dtype=torch.float64)
    p = torch.nn.Parameter(w0.clone())
    torch_opt = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    state = [w0.clone(), torch.zeros(n, dtype=torch.int8),
             torch.zeros(num_blocks(n), dtype=torch.float64), torch.zeros(n, dtype=torch.uint8),
             torch.zeros(num_blocks(n), dtype=torch.float64)]
    step = torch.zeros(1)
    for t in range(30):
        g = torch.randn(n, dtype=torch.float64) * (1 + torch.arange(n) / n)
        p.grad = g.clone()
        torch_opt.step()
        ops.adamw8bit_step_.reference(*state, g, None, step, None, None, 1e-2, 0.9, 0.999,
                                      1e-8, 0.1)
        if t == 0:
            assert torch.allclose(state[0], p.detach(), rtol=1e-15, atol=0)
            m = fo.dequantize64(state[1], state[2])
            # within the map's coarsest step, 1/127 of the block's absmax
            step_bound = state[2].repeat_interleave(QBLOCK)[:n] / 127
            assert ((m - torch_opt.state[p]["exp_avg"]).abs() <= step_bound).all()
    moved = (p.detach() - w0).norm()
    # Measured over 200 seeds: median 1.0%, max 1.27% of the distance travelled (the 8-bit
    # moments' rounding); 2% holds that with margin, while a wrong update is off by tens of %.
    assert (state[0] - p.detach()).norm() <= 0.02 * moved
