"""FusedAdamW / FusedSGD against torch.optim.AdamW / SGD: math, param groups, LR schedulers,
state dicts (theirs and torch's), float32 master weights, GradScaler's fused-step protocol."""
import copy
import io

import pytest
import torch

import memkern as mk
from compare import params_rel_err
from host_reads import HostReadSpy


def make_model(dtype=torch.float32):
    return torch.nn.Sequential(torch.nn.Linear(13, 33), torch.nn.Tanh(),
                               torch.nn.Linear(33, 5)).to(dtype)


def groups_of(model, **second):
    """Two param groups: weights with the defaults, biases with other settings."""
    return [{"params": [model[0].weight, model[2].weight]},
            {"params": [model[0].bias, model[2].bias], **second}]


def batch(dtype=torch.float32):
    return torch.randn(17, 13, dtype=dtype), torch.randn(17, 5, dtype=dtype)


def train(model, opt, data, scheduler=None):
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()



def assert_params_close(a, b, rtol):
    err = params_rel_err(a, b)
    assert err <= rtol, f"relative difference {err:.2e} > {rtol:.0e}"


def test_fused_adamw_equals_torch_adamw_after_100_steps():
    """Both optimizers get the same gradients (spanning 5 orders of magnitude, some exactly
    zero) for 100 steps: what is compared is the update rule, not the chaos of a training run
    whose rounding differences feed back through the model."""
    ours = make_model()
    theirs, start = copy.deepcopy(ours), copy.deepcopy(ours)
    grads = [[torch.randn_like(p) * 10.0 ** torch.empty(()).uniform_(-4, 1)
              for p in ours.parameters()] for _ in range(100)]
    for step in grads[::7]:
        step[1].zero_()
    for model, opt in ((ours, mk.optim.FusedAdamW(groups_of(ours, lr=3e-3, weight_decay=0.0),
                                                   lr=1e-2, betas=(0.8, 0.99), weight_decay=0.05)),
                       (theirs, torch.optim.AdamW(groups_of(theirs, lr=3e-3, weight_decay=0.0),
                                                  lr=1e-2, betas=(0.8, 0.99), weight_decay=0.05))):
        for step in grads:
            opt.zero_grad()
            for p, g in zip(model.parameters(), step):
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
            opt.step()
    assert_params_close(ours, theirs, 1e-6)
    assert params_rel_err(ours, start) > 0.1  # the parameters did move


@pytest.mark.parametrize("settings", [
    dict(momentum=0.9, weight_decay=1e-2),
    dict(momentum=0.9, nesterov=True),
    dict(momentum=0.5, dampening=0.3),
    dict(),
])
def test_fused_sgd_equals_torch_sgd(settings):
    ours = make_model()
    theirs = copy.deepcopy(ours)
    data = [batch() for _ in range(60)]
    train(ours, mk.optim.FusedSGD(groups_of(ours, lr=3e-3), lr=1e-2, **settings), data)
    train(theirs, torch.optim.SGD(groups_of(theirs, lr=3e-3), lr=1e-2, **settings), data)
    assert_params_close(ours, theirs, 1e-6)


def test_lr_scheduler_drives_the_fused_step():
    ours = make_model()
    theirs = copy.deepcopy(ours)
    data = [batch() for _ in range(12)]
    opt = mk.optim.FusedAdamW(groups_of(ours, lr=5e-3), lr=1e-2)
    ref = torch.optim.AdamW(groups_of(theirs, lr=5e-3), lr=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.05, 0.02], total_steps=12)
    ref_sched = torch.optim.lr_scheduler.OneCycleLR(ref, max_lr=[0.05, 0.02], total_steps=12)
    train(ours, opt, data, sched)
    train(theirs, ref, data, ref_sched)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups]
    assert_params_close(ours, theirs, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls, kwargs", [(mk.optim.FusedAdamW, dict(lr=1e-2)),
                                         (mk.optim.FusedSGD, dict(lr=1e-2, momentum=0.9))])
def test_state_dict_round_trip_continues_exactly(cls, kwargs, dtype):
    model = make_model(dtype)
    opt = cls(groups_of(model, lr=2e-3), **kwargs)
    data = [batch(dtype) for _ in range(10)]
    train(model, opt, data[:5])
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, saved)
    train(model, opt, data[5:])

    saved.seek(0)
    checkpoint = torch.load(saved)
    resumed = make_model(dtype)
    resumed.load_state_dict(checkpoint["model"])
    opt2 = cls(groups_of(resumed, lr=99.0), **kwargs)  # the saved lr must win
    opt2.load_state_dict(checkpoint["opt"])
    train(resumed, opt2, data[5:])
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(model.parameters(), resumed.parameters()):
        for key, value in opt.state[p].items():
            assert torch.equal(value, opt2.state[q][key]), key


def test_state_dicts_move_between_torch_and_fused_adamw():
    model = make_model()
    data = [batch() for _ in range(10)]
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, torch_opt, data[:5])

    fused_model = copy.deepcopy(model)
    fused = mk.optim.FusedAdamW(fused_model.parameters(), lr=1e-2)
    fused.load_state_dict(torch_opt.state_dict())
    train(model, torch_opt, data[5:])
    train(fused_model, fused, data[5:])
    assert_params_close(fused_model, model, 1e-6)

    back_model = copy.deepcopy(fused_model)
    back = torch.optim.AdamW(back_model.parameters(), lr=1e-2)
    # Like torch's, the state dict holds the live tensors: copy it, or both would share them.
    back.load_state_dict(copy.deepcopy(fused.state_dict()))
    more = [batch() for _ in range(3)]
    train(fused_model, fused, more)
    train(back_model, back, more)
    assert_params_close(back_model, fused_model, 1e-6)


def test_low_precision_params_get_float32_master_weights():
    model = make_model(torch.bfloat16)
    opt = mk.optim.FusedAdamW(model.parameters(), lr=1e-3)
    train(model, opt, [batch(torch.bfloat16) for _ in range(5)])
    for p in model.parameters():
        state = opt.state[p]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq", "master_param"}
        master = state["master_param"]
        assert master.dtype == torch.float32 and master.shape == p.shape
        assert torch.equal(p, master.to(torch.bfloat16))  # written back in the same pass
        # Updates of ~lr are far below bfloat16's resolution of weights ~0.1: only an fp32
        # master can hold them.
        assert not torch.equal(master, master.to(torch.bfloat16).float())
    state_dict = opt.state_dict()
    assert state_dict["state"][0]["master_param"].dtype == torch.float32


def test_torch_grad_scaler_drives_the_fused_step_without_a_host_read(monkeypatch):
    """GradScaler hands a fused optimizer grad_scale and found_inf; results equal GradScaler +
    torch.optim.AdamW, including a skipped step, and the fused step reads nothing on the host
    (torch.optim.AdamW's does: GradScaler reads found_inf to decide whether to call it)."""
    ours = make_model()
    theirs = copy.deepcopy(ours)
    data = [batch() for _ in range(8)]
    runs, reads = [], []
    for model, opt in ((ours, mk.optim.FusedAdamW(ours.parameters(), lr=1e-2)),
                       (theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-2))):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        scales, step_reads = [], []
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y) * (float("inf") if i == 3 else 1.0)
            scaler.scale(loss).backward()
            with pytest.MonkeyPatch.context() as patch, HostReadSpy(patch) as spy:
                scaler.step(opt)
            step_reads += spy.reads
            scaler.update()
            scales.append(scaler.get_scale())
        runs.append(scales)
        reads.append(step_reads)
    assert runs[0] == runs[1]
    assert_params_close(ours, theirs, 1e-6)
    assert reads[0] == [] and reads[1], reads  # the spy sees the read torch's path makes


def test_zero_grad_keeps_the_buffer_and_groups_are_fixed():
    model = make_model()
    opt = mk.optim.FusedSGD(model.named_parameters(), lr=0.1)
    views = [p.grad for p in model.parameters()]
    train(model, opt, [batch()])
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is v and not v.any() for p, v in zip(model.parameters(), views))
    assert opt.param_groups[0]["param_names"][0] == "0.weight"
    with pytest.raises(NotImplementedError, match="fixed at construction"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})


def test_loading_another_algorithms_state_is_an_error():
    model = make_model()
    sgd = mk.optim.FusedSGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, sgd, [batch()])
    with pytest.raises(ValueError, match="'momentum_buffer'.*not used by FusedAdamW"):
        mk.optim.FusedAdamW(copy.deepcopy(model).parameters()).load_state_dict(sgd.state_dict())


def test_loss_scaler_unscales_the_grad_buffer_for_the_fused_step():
    """The manual mixed-precision loop: LossScaler.unscale_ over the optimizer's GradBuffer
    (one kernel), found_inf handed to the fused step, update once per step. Same scales and
    parameters as torch.amp.GradScaler + torch.optim.AdamW, including a skipped step."""
    ours = make_model()
    theirs = copy.deepcopy(ours)
    data = [batch() for _ in range(8)]
    opt = mk.optim.FusedAdamW(ours.parameters(), lr=1e-2)
    scaler = mk.LossScaler(init_scale=2.0**10, growth_interval=2)
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    for i, (x, y) in enumerate(data):
        poison = float("inf") if i == 3 else 1.0
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(ours(x), y) * poison).backward()
        found_inf = scaler.unscale_(opt.grad_buffer)
        opt.step(found_inf=found_inf)
        scaler.update(found_inf)

        ref.zero_grad()
        ref_scaler.scale(torch.nn.functional.mse_loss(theirs(x), y) * poison).backward()
        ref_scaler.step(ref)
        ref_scaler.update()
        assert scaler.get_scale() == ref_scaler.get_scale()
    assert opt.state[ours[0].weight]["step"].item() == 7
    assert_params_close(ours, theirs, 1e-6)
