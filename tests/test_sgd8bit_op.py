"""``memkern::sgd8bit_step_`` on every backend against the float64 oracle of the quantized
algorithm (the op's ``reference()`` run on float64 master and absmax: dequantize, update and
requantize in float64), and the reference itself against ``torch.optim.SGD`` step by step.
The map (shared with AdamW's first moment), skipped steps, non-finite gradients, empty buffers
and bad input: test_state8bit_ops.py.

Fresh random data every run (conftest prints the seed), odd sizes (none a multiple of the
block), outputs poisoned, NaN/inf injected at the first/middle/last element.
"""
from __future__ import annotations

import pytest
import torch

import flat_oracle as fo
from flat_oracle import scalar
from memkern import ops
from memkern.kernels.state8bit import QBLOCK, SIGNED_CODES, num_blocks

CASES = fo.cases()
BACKEND_CASES = fo.cases(with_sizes=False)
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in fo.GRAD_DTYPES]
VARIANTS = {
    # name: momentum, dampening, nesterov, weight_decay
    "momentum": lambda: (fo.uniform(0.5, 0.95), fo.uniform(0.0, 0.5), False,
                         fo.choice([0.0, fo.uniform(0.01, 0.5)])),
    "nesterov": lambda: (fo.uniform(0.5, 0.95), 0.0, True, fo.uniform(0.01, 0.5)),
}


def random_state(n: int, dev) -> list[torch.Tensor]:
    """master, momentum codes, momentum absmax."""
    return fo.quantized_state(n, (torch.int8,), dev)


def step_and_check(backend, dev, dtype, state, step, hyper, *, with_optionals, it):
    def magnitudes(master, moments, g, step_before, multiplier):
        return fo.sgd_magnitudes(master, moments[0], g, step_before, multiplier, hyper)

    fo.check_8bit_step("sgd8bit_step_", backend, dev, dtype, state, step, hyper, ("momentum",),
                       magnitudes, with_optionals=with_optionals, it=it)


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
            torch_opt.state[p]["momentum_buffer"] = fo.dequantize64(codes, absmax)
        torch_opt.step()
        ops.sgd8bit_step_.reference(master, codes, absmax, g, None, step, None, None,
                                    *hyper.values())
        assert torch.allclose(master, p.detach(), rtol=1e-13, atol=1e-15), f"step {t}"
        expected = torch_opt.state[p]["momentum_buffer"]
        stored = fo.dequantize64(codes, absmax)
        bound = absmax.repeat_interleave(QBLOCK)[:n] / SIGNED_CODES
        assert ((stored - expected).abs() <= bound).all(), f"step {t}"
        assert torch.allclose(absmax, fo.block_max(expected.abs()), rtol=1e-14, atol=0), f"step {t}"
    assert step.item() == 30
