"""LossScaler: torch.amp.GradScaler's trajectory, hysteresis, min_scale, the floor warning,
unscaling a GradBuffer in one kernel per flat buffer, and checkpoints."""
import math
import warnings

import pytest
import torch

import memkern as mk
from memkern import ops


def grad_scaler_trajectory(overflows, **settings):
    """The scale after each update of a real torch.amp.GradScaler driven by an optimizer whose
    gradient overflows where ``overflows`` says so."""
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", **settings)
    scales, trackers = [], []
    for overflow in overflows:
        opt.zero_grad()
        loss = (w * (float("inf") if overflow else 1.0)).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        trackers.append(scaler._get_growth_tracker())
    return scales, trackers


def hysteresis_trajectory(overflows, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                          growth_interval=2000, hysteresis=1):
    """The scale, growth tracker and hysteresis allowance after each update under Megatron-LM's
    DynamicGradScaler.update (its rule, transcribed), with GradScaler's products (float64,
    rounded to float32) and its growth kept only when finite."""
    scale, tracker, allowance = init_scale, 0, hysteresis
    scales, trackers, allowances = [], [], []
    for overflow in overflows:
        if overflow:
            tracker = 0
            allowance -= 1
            if allowance <= 0:
                scale = float(torch.tensor(scale * backoff_factor, dtype=torch.float32))
        else:
            tracker += 1
            if tracker == growth_interval:
                tracker = 0
                allowance = hysteresis
                grown = float(torch.tensor(scale * growth_factor, dtype=torch.float32))
                scale = grown if math.isfinite(grown) else scale
        scales.append(scale)
        trackers.append(tracker)
        allowances.append(max(allowance, 0))
    return scales, trackers, allowances


def loss_scaler_trajectory(overflows, scaler):
    w = torch.nn.Parameter(torch.ones(3))
    scales, trackers, allowances = [], [], []
    for overflow in overflows:
        w.grad = None
        loss = (w * (float("inf") if overflow else 1.0)).sum()
        scaler.scale(loss).backward()
        found_inf = scaler.unscale_([w.grad])
        scaler.update(found_inf)
        state = scaler.state_dict()
        scales.append(scaler.get_scale())
        trackers.append(state["_growth_tracker"])
        allowances.append(state["_hysteresis_tracker"])
    return scales, trackers, allowances


SETTINGS = [
    dict(init_scale=2.0**10, growth_interval=3),
    dict(init_scale=1000.0, growth_factor=1.7, backoff_factor=0.3, growth_interval=2),
]
# Scripted: a burst at the start (calibration), growth phases, isolated and paired overflows,
# and runs of three (which spend an allowance of up to three), then random ones.
SCRIPT = [1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0,
          1, 1, 1, 0, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0]


@pytest.mark.parametrize("settings", SETTINGS)
def test_trajectory_equals_grad_scaler(settings):
    overflows = SCRIPT + torch.rand(40).lt(0.3).tolist()
    want, want_trackers = grad_scaler_trajectory(overflows, **settings)
    got = loss_scaler_trajectory(overflows, mk.LossScaler(**settings, min_scale=1e-30))
    assert got[:2] == (want, want_trackers)  # bit-identical scales and growth trackers
    # the hysteresis oracle at hysteresis=1 is GradScaler: it is tied to torch here
    assert hysteresis_trajectory(overflows, **settings)[:2] == (want, want_trackers)


@pytest.mark.parametrize("hysteresis", [2, 3])
@pytest.mark.parametrize("settings", SETTINGS)
def test_trajectory_with_hysteresis_equals_megatron_rule(settings, hysteresis):
    """hysteresis > 1 has no torch counterpart: the oracle is Megatron-LM's rule, which the
    test above ties to GradScaler at hysteresis=1."""
    overflows = SCRIPT + torch.rand(60).lt(0.4).tolist()
    want = hysteresis_trajectory(overflows, **settings, hysteresis=hysteresis)
    got = loss_scaler_trajectory(
        overflows, mk.LossScaler(**settings, min_scale=1e-30, hysteresis=hysteresis))
    assert got == want  # scales bit for bit, growth trackers, allowances left
    assert len(set(want[0])) > 3  # the scale both grew and backed off


def run_updates(scaler, overflows):
    scales = []
    for overflow in overflows:
        scaler.update(torch.tensor(float(overflow)))
        scales.append(scaler.get_scale())
    return scales


def test_hysteresis_tolerates_overflows_until_the_allowance_is_spent():
    scaler = mk.LossScaler(init_scale=64.0, growth_interval=3, hysteresis=3)
    scaler.scale(torch.ones(()))
    # Two overflows use up the allowance, the third backs off; with the allowance spent every
    # further overflow backs off, until growth refills it.
    assert run_updates(scaler, [1, 1, 1, 1]) == [64, 64, 32, 16]
    assert run_updates(scaler, [0, 0, 0]) == [16, 16, 32]
    assert run_updates(scaler, [1, 0, 1, 1]) == [32, 32, 32, 16]


def test_scale_stops_at_min_scale_and_warns_with_the_count():
    scaler = mk.LossScaler(init_scale=4.0, min_scale=1.0)
    scaler.scale(torch.ones(()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scales = run_updates(scaler, [1] * 8)
    assert scales == [2, 1, 1, 1, 1, 1, 1, 1]
    # The first two overflows could still back off; from the third the scale is stuck. The
    # count is of consecutive skipped steps, warned again each time it doubles.
    counts = [str(w.message).split(" in ")[1].split(" consecutive")[0] for w in caught]
    assert counts == ["3", "6"], [str(w.message) for w in caught]
    assert "min_scale=1" in str(caught[0].message)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_updates(scaler, [0, 1])  # a clean step ends the run; the next overflow warns again
    assert len(caught) == 1 and " in 1 consecutive" in str(caught[0].message)


def test_overflow_at_min_scale_can_raise():
    scaler = mk.LossScaler(init_scale=2.0, min_scale=2.0, on_min_scale_overflow="raise")
    scaler.scale(torch.ones(()))
    run_updates(scaler, [0])
    with pytest.raises(RuntimeError, match="1 consecutive steps"):
        run_updates(scaler, [1])


def test_static_scale_never_moves_and_still_warns():
    scaler = mk.LossScaler(init_scale=8.0, min_scale=8.0, growth_interval=1, dynamic=False)
    scaler.scale(torch.ones(()))
    with pytest.warns(RuntimeWarning, match=r"static \(8\)"):
        assert run_updates(scaler, [0, 0, 1, 0]) == [8, 8, 8, 8]


def test_unscale_grad_buffer_one_kernel_per_flat_buffer(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    model[1].to(torch.bfloat16)
    buf = mk.GradBuffer(model.parameters())
    for b in buf.buckets:
        b.grads.normal_()
    before = [p.grad.clone() for p in model.parameters()]
    calls = []
    real = ops.unscale_
    monkeypatch.setattr(ops, "unscale_", lambda *a: calls.append(a[0]) or real(*a))

    scaler = mk.LossScaler(init_scale=2.0**7)
    found_inf = scaler.unscale_(buf)
    assert [c.data_ptr() for c in calls] == [b.grads.data_ptr() for b in buf.buckets]
    assert found_inf.shape == () and found_inf.dtype == torch.float32 and found_inf.item() == 0
    for p, old in zip(model.parameters(), before):
        assert torch.equal(p.grad, (old.float() / 2.0**7).to(old.dtype))

    model[1].bias.grad[1] = float("nan")
    assert scaler.unscale_(buf).item() == 1.0


@pytest.mark.parametrize("poisoned", [None, 0, 1, 2], ids=["clean", "first", "middle", "last"])
def test_unscale_grad_buffer_flags_inf_in_any_bucket(poisoned):
    """Three buckets (float32, bfloat16, float16); an inf/NaN in one of them, the others clean:
    the flag stays set whichever bucket comes after the poisoned one. By hand: the scale is
    a power of two, so every unscaled value is exact."""
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3),
                                torch.nn.Linear(3, 2))
    model[1].to(torch.bfloat16)
    model[2].to(torch.float16)
    buf = mk.GradBuffer(model.parameters())
    assert [b.grads.dtype for b in buf.buckets] == [torch.float32, torch.bfloat16, torch.float16]
    for b in buf.buckets:
        b.grads.normal_()
    if poisoned is not None:
        flat = buf.buckets[poisoned].grads
        flat[int(torch.randint(flat.numel(), ()))] = float("nan") if poisoned % 2 else float("inf")
    want = [(b.grads.double() / 8).to(b.grads.dtype) for b in buf.buckets]
    found_inf = mk.LossScaler(init_scale=8.0).unscale_(buf)
    assert found_inf.item() == (0.0 if poisoned is None else 1.0)
    for b, w in zip(buf.buckets, want):
        assert torch.equal(b.grads.isnan(), w.isnan())
        assert torch.equal(b.grads.nan_to_num(), w.nan_to_num())


def test_unscale_tensor_list_by_hand():
    grads = [torch.randn(7) * 100, torch.randn(3, 5).to(torch.float16), torch.randn(1),
             torch.randn(4).to(torch.bfloat16)]
    want = [(g.double() / 4).to(g.dtype) for g in grads]  # exact: 1/4 is a power of two
    found = mk.LossScaler(init_scale=4.0).unscale_(grads)
    assert found.item() == 0.0
    for g, w in zip(grads, want):
        assert torch.equal(g, w)
    grads[1][2, 3] = float("inf")  # in the first dtype group only: the later ones are clean
    found = mk.LossScaler(init_scale=4.0).unscale_(grads)
    assert found.item() == 1.0 and grads[1][2, 3].item() == float("inf")


@pytest.mark.parametrize("growth_factor, top", [(2.0, 2.0**127), (1.5, 1.5 * 2.0**127)],
                         ids=["x2-from-2^127", "x1.5-from-1.5x2^127"])
def test_growth_never_leaves_float32(growth_factor, top):
    """Near the top of float32 (max 3.4028e38 = (2 - 2**-23) * 2**127) a grown scale would
    be inf: the scale stays where it is, finite, and keeps working (torch's rule: growth is
    kept only if finite)."""
    assert top * growth_factor > torch.finfo(torch.float32).max
    scaler = mk.LossScaler(init_scale=top, growth_factor=growth_factor, growth_interval=2)
    scaler.scale(torch.ones(()))
    scales = run_updates(scaler, [0] * 6)
    assert scales == [top] * 6
    assert scaler.state_dict()["_growth_tracker"] == 0
    assert torch.isfinite(scaler.scale(torch.ones(()))).item()
    assert run_updates(scaler, [1, 0, 0]) == [top / 2, top / 2, top / 2 * growth_factor]


def test_state_dict_round_trip_and_grad_scaler_state():
    overflows = [0, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0]
    a = mk.LossScaler(init_scale=2.0**8, growth_interval=2, hysteresis=2)
    a.scale(torch.ones(()))
    run_updates(a, overflows)
    b = mk.LossScaler()
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert run_updates(b, overflows) == run_updates(a, overflows)

    torch_scaler = torch.amp.GradScaler("cpu", init_scale=32.0, growth_interval=5)
    c = mk.LossScaler()
    c.load_state_dict(torch_scaler.state_dict())
    assert c.get_scale() == 32.0 and c.growth_interval == 5 and c.min_scale == 1.0


def test_disabled_scaler_is_a_no_op():
    scaler = mk.LossScaler(enabled=False)
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss
    g = torch.tensor([1.0, float("inf")])
    assert scaler.unscale_([g]).item() == 0.0 and g[0] == 1.0
    scaler.update(torch.tensor(1.0))
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}


@pytest.mark.parametrize("kwargs, match", [
    (dict(init_scale=0.0), "init_scale"),
    (dict(growth_factor=1.0), "growth_factor"),
    (dict(backoff_factor=1.0), "backoff_factor"),
    (dict(growth_interval=0), "growth_interval"),
    (dict(min_scale=2.0**20), "min_scale"),
    (dict(hysteresis=0), "hysteresis"),
    (dict(on_min_scale_overflow="ignore"), "on_min_scale_overflow"),
])
def test_bad_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mk.LossScaler(**kwargs)
