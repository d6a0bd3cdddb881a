"""Edge inputs of the optimizer front end, each a correct result or a clear error.

Correct results are checked against ``torch.optim.AdamW`` on the same parameters and the
same gradients (float32), with the semantics docs/api.md states where memkern differs from
torch (a parameter without a gradient is stepped with a zero gradient). Errors: the type and
the words that tell the user what was wrong, and the parameters left bit for bit as they were.

Two devices are emulated with the CPU and the meta device (no GPU needed).
"""
from __future__ import annotations

import warnings

import pytest
import torch

import memkern as mk

HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.1)


def sharded(params, **options):
    return mk.optim.ShardedOptimizer(params, "adamw", **HYPER, **options)


def torch_adamw(params):
    return torch.optim.AdamW(params, **HYPER, foreach=False)


def clones(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def assert_close_to_torch(ours, theirs):
    for i, (p, q) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=2e-6, atol=2e-7,
                                   msg=lambda m, i=i: f"parameter {i}: {m}")


def step_both(opt, ref, ours, theirs, loss_of) -> None:
    """One window of one micro-batch on memkern's front end and on torch's AdamW; a parameter
    the loss leaves without a gradient gets a zero one for torch (memkern steps it so)."""
    opt.backward(loss_of(ours))
    assert opt.step()
    opt.zero_grad()
    ref.zero_grad()
    loss_of(theirs).backward()
    for p in theirs:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    ref.step()


OFFLOAD = [pytest.param({}, id="plain"),
           pytest.param(dict(offload="cpu", zero_stage=2, bucket_size_mb=1e-3),
                        id="offload-stage2")]


@pytest.mark.parametrize("options", OFFLOAD)
def test_a_parameter_without_a_gradient_in_a_window_is_stepped_with_zero(options):
    """Window 2 does not use ``unused``: its gradient is zero (weight decay and the moments
    still move it, as docs/api.md says); with ZeRO-2 its bucket is reduced at the end of the
    backward pass."""
    used, unused = torch.randn(7, 3), torch.randn(5)
    ours, theirs = clones([used, unused]), clones([used, unused])
    opt, ref = sharded(ours, **options), torch_adamw(theirs)
    for window in range(3):
        x = torch.randn(3)
        step_both(opt, ref, ours, theirs,
                  lambda params, x=x, window=window: (params[0] @ x).square().sum()
                  + (params[1].sum() if window != 1 else 0))
    assert_close_to_torch(ours, theirs)


def test_requires_grad_switched_off_between_windows_is_refused():
    model = torch.nn.Linear(6, 3)
    opt = sharded(model.parameters())
    opt.backward(model(torch.randn(4, 6)).square().mean())
    assert opt.step()
    opt.zero_grad()
    model.bias.requires_grad_(False)
    before = [p.detach().clone() for p in model.parameters()]
    opt.backward(model(torch.randn(4, 6)).square().mean())
    with pytest.raises(RuntimeError, match=r"shape \(3,\).*no longer requires grad.*no step"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    model.bias.requires_grad_(True)  # switched back on: the open window steps
    assert opt.step()
    assert not torch.equal(model.weight, before[0])


def test_requires_grad_switched_off_is_refused_by_the_fused_optimizers():
    a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(3))
    opt = mk.optim.FusedAdamW([a, b], lr=1e-2)
    b.requires_grad_(False)
    a.grad.copy_(torch.randn(4))
    before = a.detach().clone()
    with pytest.raises(RuntimeError, match="FusedAdamW.step: .*no longer requires grad"):
        opt.step()
    assert torch.equal(a, before)


@pytest.mark.parametrize("algorithm", [mk.optim.FusedAdamW, mk.optim.FusedSGD])
def test_parameters_swapped_into_the_param_groups_are_refused(algorithm):
    """accelerate's FSDP2 preparation replaces the param groups' tensors with the sharded ones
    after the optimizer is built; stepping the built ones instead would train nothing."""
    model = torch.nn.Linear(6, 3)
    opt = algorithm(model.parameters(), lr=1e-2)
    swapped = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    opt.param_groups[0]["params"] = swapped
    for p in [*model.parameters(), *swapped]:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"step: param_groups hold a Parameter of shape "
                                           r"\(3, 6\) the optimizer was not built with.*no step"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("options", OFFLOAD)
def test_zero_element_parameters_train_beside_the_others(options):
    shapes = [(7,), (0,), (3, 0), (5, 2)]
    initial = [torch.randn(s) for s in shapes]
    ours, theirs = clones(initial), clones(initial)
    opt, ref = sharded(ours, **options), torch_adamw(theirs)
    for _ in range(3):
        xs = [torch.randn(s) for s in shapes]
        step_both(opt, ref, ours, theirs, lambda params, xs=xs: params[3].square().sum()
                  + sum((p * x).sum() for p, x in zip(params, xs)))
    assert_close_to_torch(ours, theirs)
    state = opt.state_dict()
    assert state["state"][1]["exp_avg"].shape == (0,)
    fresh = sharded(clones(ours), **options)
    fresh.load_state_dict(state)
    assert fresh.state_dict()["state"][3]["exp_avg"].equal(state["state"][3]["exp_avg"])


def test_the_same_parameter_in_two_groups_is_refused():
    p = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match=r"params\[1\].*same tensor as params\[0\].*pass each "
                                         "parameter once"):
        sharded([{"params": [p]}, {"params": [p], "lr": 1e-3}])


def test_non_contiguous_parameters_train_like_torch():
    """A transposed parameter: moved into the flat buffer (contiguous there), same values."""
    ours = [torch.nn.Parameter(t) for t in (torch.randn(5, 7).t(), torch.randn(4, 6)[:, ::2])]
    assert not any(p.is_contiguous() for p in ours)
    theirs = clones(ours)
    opt, ref = sharded(ours), torch_adamw(theirs)
    for _ in range(3):
        xs = [torch.randn(5, 3), torch.randn(3, 4)]
        step_both(opt, ref, ours, theirs,
                  lambda params, xs=xs: (params[0] @ xs[0]).square().sum()
                  + (xs[1] @ params[1]).square().sum())
    assert_close_to_torch(ours, theirs)


def test_parameters_on_two_devices_are_refused():
    cpu = torch.nn.Parameter(torch.randn(3))
    meta = torch.nn.Parameter(torch.empty(4, device="meta"))
    with pytest.raises(ValueError, match=r"params\[1\].*is on meta but params\[0\] is on cpu.*"
                                         "one optimizer per device"):
        sharded([cpu, meta])


def test_a_backward_after_step_without_zero_grad_adds_to_the_stale_gradient():
    """As torch does with ``.grad``: the next window's gradient is the stale one plus the new
    one; memkern warns that zero_grad() was not called."""
    initial = [torch.randn(6, 3)]
    ours, theirs = clones(initial), clones(initial)
    opt, ref = sharded(ours), torch_adamw(theirs)
    xs = [torch.randn(3) for _ in range(2)]
    opt.backward((ours[0] @ xs[0]).square().sum())
    assert opt.step()
    with pytest.warns(RuntimeWarning, match="never zeroed: call zero_grad"):
        opt.backward((ours[0] @ xs[1]).square().sum())
    assert opt.step()
    for x in xs:
        (theirs[0] @ x).square().sum().backward()
        ref.step()
    assert_close_to_torch(ours, theirs)


def test_parameters_replaced_after_the_optimizer_was_built_are_refused():
    model = torch.nn.Linear(5, 2)
    opt = sharded(model.parameters())
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(weights, assign=True)  # new Parameter objects
    with pytest.raises(RuntimeError, match="no parameter of this optimizer received a "
                                           "gradient.*replaced"):
        opt.backward(model(torch.randn(3, 5)).sum())
    assert opt.micro_batches == 0


REPLACEMENTS = {
    "module.weight = Parameter": (lambda m: setattr(m[2], "weight", torch.nn.Parameter(
        torch.randn(2, 4))), r"\(Linear\.weight = \.\.\.\)"),
    "model[2] = Linear": (lambda m: m.__setitem__(2, torch.nn.Linear(4, 2)),
                          r"\(Sequential\.2 = Linear\(\.\.\.\)\)"),
}


def _replaced_step_is_refused(model, replace, assignment: str, shape: str, fused: bool) -> None:
    """Builds an optimizer on ``model``, then ``replace(model)``: the other parameters still
    get their gradients (nothing looks amiss in backward); the step names the replaced
    parameter (of ``shape``, a regex) and the assignment, and changes no weight."""
    opt = (mk.optim.FusedAdamW if fused else sharded)(model.parameters())
    built = list(model.parameters())
    replace(model)
    loss = model(torch.randn(3, model[0].in_features)).square().sum()
    opt.zero_grad()
    loss.backward() if fused else opt.backward(loss)
    before = [p.detach().clone() for p in [*built, *model.parameters()]]
    name = "FusedAdamW" if fused else "ShardedOptimizer"
    with pytest.raises(RuntimeError, match=(
            rf"^memkern\.{name}\.step: a parameter of shape \({shape}\) \(torch\.float32, "
            rf"number \d in the flat layout\) was replaced in its module {assignment} after the "
            r"optimizer was built: .* no step was taken\. Change the model before building "
            r"the optimizer$")):
        opt.step()
    after = [p.detach() for p in [*built, *model.parameters()]]
    assert all(torch.equal(p, q) for p, q in zip(before, after))


@pytest.mark.parametrize("fused", [False, True], ids=["sharded", "fused"])
@pytest.mark.parametrize("how", sorted(REPLACEMENTS))
def test_one_parameter_replaced_in_its_module_is_refused(how, fused):
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    _replaced_step_is_refused(model, *REPLACEMENTS[how], "2, 4|2,", fused)


TIED = {
    "module.weight = another's": (lambda m: setattr(m[2], "weight", m[0].weight),
                                  r"\(Linear\.weight = \.\.\.\)"),
    "model[2] = model[0]": (lambda m: m.__setitem__(2, m[0]),
                            r"\(Sequential\.2 = Linear\(\.\.\.\)\)"),
}


@pytest.mark.parametrize("fused", [False, True], ids=["sharded", "fused"])
@pytest.mark.parametrize("how", sorted(TIED))
def test_a_slot_given_another_of_the_optimizers_parameters_is_refused(how, fused):
    """Weights tied after the optimizer was built: the slot now holds another parameter the
    optimizer steps, but not its own, which the model no longer uses (a slot holding some
    watched parameter is not one put back)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    _replaced_step_is_refused(model, *TIED[how], "4, 4|4,", fused)


def test_assignments_that_keep_the_parameters_step():
    """The same parameter or module assigned again, a module wrapped with its parameters, a
    module swapped out and put back (memkern.patch's fused head + loss does so in every
    forward), and another model built after the optimizer: nothing is replaced, the step is
    taken."""
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    opt = sharded(model.parameters())
    model[0].weight = model[0].weight
    model[2] = model[2]
    model[0] = torch.nn.Sequential(model[0])
    head, model[2] = model[2], torch.nn.Identity()
    model[2] = head
    other = torch.nn.Linear(4, 2)
    other.weight = torch.nn.Parameter(torch.randn(2, 4))
    before = model[2].weight.detach().clone()
    opt.backward(model(torch.randn(3, 5)).square().sum())
    assert opt.step()
    assert not torch.equal(model[2].weight, before)


@pytest.mark.parametrize("how", ["to(float64)", "p.data ="])
def test_parameter_storage_replaced_after_the_optimizer_was_built_is_refused(how):
    model = torch.nn.Linear(5, 2)
    opt = sharded(model.parameters())
    if how == "to(float64)":
        model.to(torch.float64)
    else:
        model.weight.data = model.weight.data.clone()
    x = torch.randn(3, 5, dtype=model.weight.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (gradients outside the buffer)
        opt.backward(model(x).sum())
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="storage of a parameter .* was replaced.*before "
                                           "building the optimizer"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
