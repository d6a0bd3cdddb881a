"""Weights written into the model after the optimizer exists are never lost: every flat-buffer
optimizer (FusedAdamW, FusedSGD, ShardedOptimizer with the device buffer, one process's offload,
gradients streamed to the host), float32 and bfloat16 weights, takes them as the new masters at
its next step (issue 45: with offload the host copy of a float32 master was kept and the
written weights silently overwritten).

Oracles: torch's own optimizers, whose parameters are what a write changes (float32 copies as
masters), with tolerance; and, bit for bit, the run that loads the optimizer's state and then
the model's weights saved with it (the order tests/scripts/kill_resume_train.py resumes in)
against the uninterrupted run — written weights that agree with the masters change nothing.
"""
from __future__ import annotations

import copy

import pytest
import torch

import memkern as mk
from compare import params_rel_err

MODES = {
    "FusedAdamW": lambda params: mk.optim.FusedAdamW(params, lr=1e-2, eps=1e-3),
    "FusedSGD": lambda params: mk.optim.FusedSGD(params, lr=0.05, momentum=0.9),
    "device": lambda params: mk.optim.ShardedOptimizer(params, lr=1e-2, eps=1e-3),
    "offload": lambda params: mk.optim.ShardedOptimizer(params, lr=1e-2, eps=1e-3,
                                                        offload="cpu", bucket_size_mb=1e-3),
    "host": lambda params: mk.optim.ShardedOptimizer(params, lr=1e-2, eps=1e-3,
                                                     gradients="host", bucket_size_mb=1e-3),
}


def make_model(seed: int, dtype: torch.dtype) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(13, 33), torch.nn.Tanh(),
                               torch.nn.Linear(33, 5)).to(dtype)


def loss_of(model, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    x, y = torch.randn(8, 13, generator=g), torch.randn(8, 5, generator=g)
    return torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)


def window(model, opt, seed: int) -> None:
    loss = loss_of(model, seed)
    if isinstance(opt, mk.optim.ShardedOptimizer):
        opt.backward(loss)
    else:
        loss.backward()
    opt.step()
    opt.zero_grad()


def written(model, seed: int) -> dict[str, torch.Tensor]:
    """New weights for every parameter (what a checkpoint of another run would hold)."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in
            model.state_dict().items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_weights_loaded_into_the_model_are_the_next_step_s_masters(mode, dtype):
    """After a window, ``model.load_state_dict`` with new weights; the next window steps from
    them, as torch's optimizer steps from its parameters (float32 copies of them here, the
    moments carried over from the first window)."""
    model = make_model(0, dtype)
    opt = MODES[mode](model.parameters())
    ref = make_model(0, torch.float32)
    ref_opt = (torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9) if mode == "FusedSGD"
               else torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-3))
    window(model, opt, 1)
    loss_of(ref, 1).backward()  # the gradients of the same weights (before the step)
    ref_opt.step()
    ref_opt.zero_grad()
    new = written(model, 2)
    model.load_state_dict(new)
    ref.load_state_dict({k: v.float() for k, v in new.items()})
    window(model, opt, 3)
    # the reference's gradient at the 16-bit weights the model holds, as memkern's is
    dtype_ref = copy.deepcopy(ref).to(dtype)
    loss_of(dtype_ref, 3).backward()
    for p, q in zip(ref.parameters(), dtype_ref.parameters()):
        p.grad = q.grad.float()
    ref_opt.step()
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the weights' rounding
    assert params_rel_err([p.float() for p in model.parameters()], ref) <= tolerance, mode
    # and far from where the optimizer would have gone without the write
    assert params_rel_err([p.float() for p in model.parameters()],
                          [v.float() for v in new.values()]) < 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_state_then_weights_resumes_bit_for_bit(mode, dtype):
    """The optimizer's state loaded first, the model's weights saved with it after (weights
    that agree with the masters): the run continues bit for bit as the uninterrupted one."""
    model = make_model(0, dtype)
    opt = MODES[mode](model.parameters())
    for w in range(2):
        window(model, opt, 10 + w)
    saved_state = copy.deepcopy(opt.state_dict())
    saved_weights = copy.deepcopy(model.state_dict())
    for w in range(2, 4):
        window(model, opt, 10 + w)
    resumed = make_model(5, dtype)
    resumed_opt = MODES[mode](resumed.parameters())
    window(resumed, resumed_opt, 99)  # its own state, replaced by the load
    resumed_opt.load_state_dict(saved_state)
    resumed.load_state_dict(saved_weights)
    for w in range(2, 4):
        window(resumed, resumed_opt, 10 + w)
    for p, q in zip(resumed.parameters(), model.parameters()):
        assert torch.equal(p, q), mode


def test_a_write_between_the_last_backward_and_the_step_is_taken():
    """One process's offload steps buckets during the window's last backward, from the masters
    of then: weights written after that backward, before ``step()``, undo those steps and are
    the masters of the step, as with the step taken after the verdict."""
    runs = []
    for overlapped in (True, False):
        model = make_model(0, torch.float32)
        opt = MODES["offload"](model.parameters())
        if not overlapped:
            opt._overlap = None
        window(model, opt, 1)
        opt.backward(loss_of(model, 2))
        if overlapped:
            opt._overlap._wait_jobs()
            assert opt._overlap._speculated, "no bucket was stepped before step()"
        with torch.no_grad():
            model[0].weight.mul_(0.5)
        assert opt.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    for p, q in zip(*runs):
        assert torch.equal(p, q)
