"""``ShardedOptimizer(offload="cpu")`` in one process: the host step of each bucket starts
during the window's last backward pass (memkern.optim.offload.OverlappedHostStep).

What is checked: the order of events (a bucket's host step is issued before the next bucket's
gradients exist); that overlapping changes no bit of the result against the same optimizer
stepping after the verdict (the serial path, whose results test_optim_distributed ties to the
single-process run and that to torch's own loop), over accumulation windows with and without
num_items, clipping that never, sometimes or always bites, a loss-scaling overflow in a bucket
stepped last, 8-bit state, bfloat16 parameters and both ZeRO stages; that a skipped window
leaves parameters and state bit for bit as they were although earlier buckets had been
stepped; that the model's parameters change in ``step()`` only (the early steps write host
copies); that a state dict read between the last backward and the step sees the state before
the window. The model is on the CPU: the same schedule as from a GPU, without the copies
(the cuda-marked test runs it from a GPU).

Against torch's own optimizer (``torch.optim.AdamW`` / ``SGD`` on a float32 copy of the model,
given the same changes): any hyper-parameter set between the window's last backward and the
step is the one the step uses; a state dict's float32 masters (saved with bfloat16
parameters) loaded into float32 parameters are where the next step starts, host copies
included.
"""
from __future__ import annotations

import math

import pytest
import torch

import memkern as mk
from compare import assert_same_bits

WINDOWS, ACCUMULATION = 8, 2
POISONED = 5
"""The window whose last micro-batch gives the first layer's weight an inf gradient: that
bucket's gradients are final last, after the other buckets were stepped."""


def make_model(seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Sequential:
    """Layers of odd sizes; its first one large enough for 8-bit state (>= 4096 elements)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(67, 65), torch.nn.Tanh(), torch.nn.Linear(65, 33),
                                torch.nn.Tanh(), torch.nn.Linear(33, 5))
    return model.to(dtype)


def make_optimizer(model, *, algorithm="adamw", max_grad_norm=None, **options):
    hyper = dict(lr=3e-3, eps=1e-3) if algorithm == "adamw" else dict(lr=0.05, momentum=0.9)
    # 1 KiB buckets: every parameter a bucket (unit) of its own, so buckets become final one by
    # one during backward
    return mk.optim.ShardedOptimizer(model.parameters(), algorithm, offload="cpu",
                                     bucket_size_mb=1e-3, accumulation_steps=ACCUMULATION,
                                     max_grad_norm=max_grad_norm,
                                     loss_scale=mk.LossScaler(init_scale=2.0**10,
                                                              growth_interval=3),
                                     **hyper, **options)


def serial(opt):
    """The same optimizer stepping every bucket after the verdict (what it does with several
    ranks): the overlap switched off."""
    opt._overlap = None
    return opt


def batch(window: int, micro: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(window * ACCUMULATION + micro)
    return (torch.randn(16, 67, generator=g).to(dtype),
            (3 * torch.randn(16, 5, generator=g)).to(dtype))


def poison_first_layer(model):
    """An inf in the first layer's weight gradient of the next backward pass, only."""
    weight = model[0].weight

    def hook(grad):
        handle.remove()
        grad = grad.clone()
        grad.view(-1)[7] = math.inf
        return grad

    handle = weight.register_hook(hook)


def train(model, opt, dtype, windows=WINDOWS, poisoned=POISONED) -> list[float]:
    """Odd windows are summed over num_items, even ones mean losses; returns each window's
    gradient norm (before clipping)."""
    norms = []
    for window in range(windows):
        for micro in range(ACCUMULATION):
            x, y = batch(window, micro, dtype)
            items = window % 2 == 1
            loss = torch.nn.functional.mse_loss(model(x).float(), y.float(),
                                                reduction="sum" if items else "mean")
            if window == poisoned and micro == ACCUMULATION - 1:
                poison_first_layer(model)
            opt.backward(loss, num_items=y.numel() if items else None)
            opt.step()
            opt.zero_grad()
        norms.append(opt.grad_norm)
    return norms


def snapshot(model, opt):
    """The parameters and the optimizer state, read through ``state_dict()`` first (which
    settles a window's early steps)."""
    state = {k: {kk: vv.clone() if isinstance(vv, torch.Tensor) else vv for kk, vv in v.items()}
             for k, v in opt.state_dict()["state"].items()}
    return [p.detach().clone() for p in model.parameters()], state


# --------------------------------------------------------------------------- ordering
def test_host_step_of_a_bucket_is_issued_before_the_next_buckets_gradients_exist():
    model = make_model(0)
    opt = make_optimizer(model)
    overlap = opt._overlap
    events: list[tuple[str, int]] = []
    unit_of = {id(p): u.index for u in opt._shards.units for p in u.params}
    for p in model.parameters():  # after the optimizer's own hooks: sees a final gradient
        p.register_post_accumulate_grad_hook(
            lambda p: events.append(("gradient", unit_of[id(p)])))
    worker = overlap._worker

    class Spy:
        def submit(self, fn, i):
            events.append(("issued", i))
            return worker.submit(fn, i)

    overlap._worker = Spy()
    for micro in range(ACCUMULATION):
        events.clear()
        x, y = batch(0, micro, torch.float32)
        opt.backward(torch.nn.functional.mse_loss(model(x), y))
        if micro < ACCUMULATION - 1:  # an earlier micro-batch only accumulates
            assert not any(kind == "issued" for kind, _ in events)
    issued = [i for kind, i in events if kind == "issued"]
    assert sorted(issued) == list(range(len(opt._shards.units)))
    for k, k_next in zip(issued, issued[1:]):
        first_gradient_of_next = events.index(("gradient", k_next))
        assert events.index(("issued", k)) < first_gradient_of_next, events
    assert opt.step()


# ------------------------------------------------------------------ exact, bit for bit
CLIPPING = ("never", "sometimes", "always")


def clip_limit(clipping: str, algorithm: str, options: dict, dtype: torch.dtype) -> float | None:
    """max_grad_norm: None, the median of the windows' norms without clipping, or tiny."""
    if clipping == "never":
        return None
    if clipping == "always":
        return 1e-3
    model = make_model(1, dtype)
    norms = train(model, serial(make_optimizer(model, algorithm=algorithm, **options)), dtype)
    return sorted(n for n in norms if math.isfinite(n))[len(norms) // 2]


@pytest.mark.parametrize("clipping", CLIPPING)
@pytest.mark.parametrize("algorithm,options,dtype", [
    pytest.param("adamw", {}, torch.float32, id="adamw"),
    pytest.param("adamw", {}, torch.bfloat16, id="adamw-bf16"),
    pytest.param("adamw", dict(zero_stage=2), torch.float32, id="adamw-stage2"),
    pytest.param("adamw", dict(state_precision="8bit"), torch.bfloat16, id="adamw-8bit-bf16"),
    pytest.param("sgd", {}, torch.float32, id="sgd"),
    pytest.param("sgd", dict(state_precision="8bit"), torch.float32, id="sgd-8bit"),
])
def test_overlapped_step_equals_the_serial_step_bit_for_bit(algorithm, options, dtype,
                                                            clipping):
    limit = clip_limit(clipping, algorithm, options, dtype)
    results = []
    for overlapped in (True, False):
        model = make_model(1, dtype)
        opt = make_optimizer(model, algorithm=algorithm, max_grad_norm=limit, **options)
        if not overlapped:
            serial(opt)
        norms = train(model, opt, dtype)
        results.append((snapshot(model, opt), opt.skipped_steps, opt.loss_scale, opt.grad_norm))
        if overlapped:
            assert opt.skipped_steps == 1  # the poisoned window
            finite = [n for n in norms if math.isfinite(n)]
            clipped = sum(limit is not None and n > limit for n in finite)
            expected = {"never": range(0, 1), "sometimes": range(1, len(finite)),
                        "always": range(len(finite), len(finite) + 1)}[clipping]
            assert clipped in expected, (clipping, norms)
            # the next window steps early unless this one was clipped: the speculative
            # multiplier was the window's own, bit for bit
            assert opt._overlap.speculate == (norms[-1] <= (limit or math.inf))
    assert_same_bits(results[0], results[1], "overlapped vs serial")
    (params, _), *_ = results[0]
    assert any(not torch.equal(p, q.detach()) for p, q in
               zip(params, make_model(1, dtype).parameters()))


def test_skipped_window_leaves_parameters_and_state_bit_identical():
    model = make_model(2)
    opt = make_optimizer(model, max_grad_norm=None)
    train(model, opt, torch.float32, windows=3, poisoned=None)
    before = snapshot(model, opt)
    stepped = []
    run = opt._overlap._run

    def spy(i):
        run(i)
        stepped.extend(opt._overlap._speculated)

    opt._overlap._run = spy
    for micro in range(ACCUMULATION):
        x, y = batch(3, micro, torch.float32)
        if micro == ACCUMULATION - 1:
            poison_first_layer(model)
        opt.backward(torch.nn.functional.mse_loss(model(x), y))
    opt._overlap._wait_jobs()  # the worker thread's early steps are done (or none was issued)
    assert stepped, "no bucket was stepped before the verdict: nothing to undo was tested"
    assert not opt.step()  # skipped
    assert_same_bits(snapshot(model, opt), before, "skipped window")
    assert opt.skipped_steps == 1


@pytest.mark.parametrize("algorithm", ["adamw", "sgd"])
def test_a_window_clipped_by_a_hair_redoes_its_early_steps(algorithm):
    """A clip coefficient of 1 - 2e-6 (a few float32 ulps below 1): the speculative steps,
    taken with coefficient 1, must be redone with the clipped multiplier, bit for bit as the
    serial step. Each parameter's update then differs from the unclipped one by ~2e-6
    relative, which the moments keep even where the weights round alike."""
    model = make_model(7)
    norms = train(model, serial(make_optimizer(model, algorithm=algorithm)), torch.float32,
                  windows=3, poisoned=None)
    last = max(range(3), key=lambda w: norms[w])  # the windows before it are not clipped
    limit = (norms[last] + 1e-6) * (1 - 2e-6)
    assert all(n < limit for n in norms[:last])
    results = []
    for run in ("overlapped", "serial", "unclipped"):
        model = make_model(7)
        opt = make_optimizer(model, algorithm=algorithm,
                             max_grad_norm=None if run == "unclipped" else limit)
        if run == "serial":
            serial(opt)
        train(model, opt, torch.float32, windows=last + 1, poisoned=None)
        if run == "overlapped":
            assert not opt._overlap.speculate, "the last window was not seen as clipped"
        results.append(snapshot(model, opt))
    assert_same_bits(results[0], results[1], "clipped by a hair: overlapped vs serial")
    with pytest.raises(AssertionError, match="differs"):  # the hair is visible in the state
        assert_same_bits(results[1], results[2], "clipped vs unclipped")


@pytest.mark.parametrize("lr_kind", ["float", "tensor changed in place"])
def test_an_lr_set_after_the_early_steps_is_the_one_the_step_uses(lr_kind):
    """A learning rate set between the window's last backward (the early steps, with the old
    one) and ``step()`` (a schedule that sets each step's lr just before it): the step is taken
    with the new one, bit for bit as the serial step. Found by test_optim_contract_fuzz; the lr
    a one-element tensor written in place (the early step's lr must be compared by value)."""
    runs = []
    for overlapped in (True, False):
        model = make_model(8)
        opt = make_optimizer(model)
        if lr_kind != "float":
            opt.param_groups[0]["lr"] = torch.tensor(3e-3)
        if not overlapped:
            serial(opt)
        train(model, opt, torch.float32, windows=2, poisoned=None)
        for micro in range(ACCUMULATION):
            x, y = batch(2, micro, torch.float32)
            opt.backward(torch.nn.functional.mse_loss(model(x), y))
        if overlapped:
            opt._overlap._wait_jobs()
            assert opt._overlap._speculated, "no bucket was stepped before step()"
        if lr_kind == "float":
            opt.param_groups[0]["lr"] = 1e-2
        else:
            opt.param_groups[0]["lr"].fill_(1e-2)
        assert opt.step()
        runs.append(snapshot(model, opt))
    assert_same_bits(runs[0], runs[1], "lr set after the early steps")


def test_parameters_change_in_step_only():
    """After the window's last backward, with buckets already stepped on the host, the model's
    parameters are bit for bit those before the window; step() then gives the serial result."""
    runs = []
    for overlapped in (True, False):
        model = make_model(6, torch.bfloat16)
        opt = make_optimizer(model, max_grad_norm=None)
        if not overlapped:
            serial(opt)
        train(model, opt, torch.bfloat16, windows=2, poisoned=None)
        before = [p.detach().clone() for p in model.parameters()]
        for micro in range(ACCUMULATION):
            x, y = batch(2, micro, torch.bfloat16)
            opt.backward(torch.nn.functional.mse_loss(model(x).float(), y.float()))
        if overlapped:
            opt._overlap._wait_jobs()
            assert opt._overlap._speculated, "no bucket was stepped before step()"
        assert_same_bits([p.detach() for p in model.parameters()], before, "before step()")
        assert opt.step()
        runs.append(snapshot(model, opt))
    assert_same_bits(runs[0], runs[1], "the step after an untouched model")
    assert not any(torch.equal(p, q) for p, q in zip(runs[0][0], before))


def test_state_dict_between_the_last_backward_and_the_step_sees_the_state_before():
    runs = []
    for overlapped in (True, False):
        model = make_model(3)
        opt = make_optimizer(model, max_grad_norm=6.0)
        if not overlapped:
            serial(opt)
        train(model, opt, torch.float32, windows=2, poisoned=None)
        before = snapshot(model, opt)
        for micro in range(ACCUMULATION):
            x, y = batch(2, micro, torch.float32)
            opt.backward(torch.nn.functional.mse_loss(model(x), y))
        assert_same_bits(snapshot(model, opt), before, "state dict mid-window")
        assert opt.step()
        runs.append(snapshot(model, opt))
    assert_same_bits(runs[0], runs[1], "the step after the state dict")


def test_a_backward_after_the_windows_last_voids_its_early_steps():
    """A window fed one micro-batch more than accumulation_steps before its step: the host
    steps issued during the last-but-one backward must not count."""
    runs = []
    for overlapped in (True, False):
        model = make_model(4)
        opt = make_optimizer(model)
        if not overlapped:
            serial(opt)
        for micro in range(ACCUMULATION + 1):
            x, y = batch(0, micro, torch.float32)
            opt.backward(torch.nn.functional.mse_loss(model(x), y))
        assert opt.step()
        runs.append(snapshot(model, opt))
    assert_same_bits(runs[0], runs[1], "a window of one micro-batch more")


@pytest.mark.cuda
def test_overlapped_step_from_a_gpu_equals_the_serial_step_bit_for_bit():
    """From a GPU: the gradients down and the weights up on their own streams, the host steps
    during backward."""
    results = []
    for overlapped in (True, False):
        model = make_model(5, torch.bfloat16).cuda()
        opt = make_optimizer(model, max_grad_norm=6.0)
        if not overlapped:
            serial(opt)
        for window in range(WINDOWS):
            for micro in range(ACCUMULATION):
                x, y = (t.cuda() for t in batch(window, micro, torch.bfloat16))
                if window == POISONED and micro == ACCUMULATION - 1:
                    poison_first_layer(model)
                opt.backward(torch.nn.functional.mse_loss(model(x).float(), y.float()))
                opt.step()
                opt.zero_grad()
        params, state = snapshot(model, opt)
        results.append(([p.cpu() for p in params], state, opt.skipped_steps))
    assert_same_bits(results[0], results[1], "overlapped vs serial, from a GPU")


# ------------------------------------------------------------------ against torch.optim
TORCH = {"adamw": lambda params: torch.optim.AdamW(params, lr=3e-3, eps=1e-3, foreach=False),
         "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=False)}
"""torch's optimizer with make_optimizer's hyper-parameters (and torch's defaults, which
memkern's share: AdamW's weight_decay 0.01)."""


def window_with_torch(model, opt, twin, twin_opt, window: int, between=lambda group: None):
    """One window of mean losses on memkern's optimizer and on torch's (``twin_opt`` on
    ``twin``, a float32 model); ``between(param_group)`` runs on both between the window's
    last backward (memkern's early host steps) and the step."""
    for micro in range(ACCUMULATION):
        x, y = batch(window, micro, torch.float32)
        opt.backward(torch.nn.functional.mse_loss(model(x), y))
        (torch.nn.functional.mse_loss(twin(x), y) / ACCUMULATION).backward()
    for group in (opt.param_groups[0], twin_opt.param_groups[0]):
        between(group)
    assert opt.step()
    twin_opt.step()
    opt.zero_grad()
    twin_opt.zero_grad()


def assert_close_to_torch(model, twin, what: str) -> None:
    for i, (p, q) in enumerate(zip(model.parameters(), twin.parameters())):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=2e-6, atol=2e-7,
                                   msg=lambda m, i=i: f"{what}, parameter {i}: {m}")


CHANGES = {"adamw": [("weight_decay", 0.5), ("betas", (0.5, 0.9)), ("eps", 0.1)],
           "sgd": [("momentum", 0.3), ("weight_decay", 0.1), ("dampening", 0.5)]}


@pytest.mark.parametrize("algorithm", ["adamw", "sgd"])
def test_hyper_parameters_set_after_the_last_backward_are_the_ones_the_step_uses(algorithm):
    """Each window sets one hyper-parameter other than the lr between its last backward (the
    buckets' early host steps, taken with the old value) and ``step()``: the step uses the new
    value, as torch's optimizer does when it is set before its step."""
    model, twin = make_model(10), make_model(10)
    opt, twin_opt = make_optimizer(model, algorithm=algorithm), TORCH[algorithm](twin.parameters())
    window_with_torch(model, opt, twin, twin_opt, 0)
    for window, (key, value) in enumerate(CHANGES[algorithm], start=1):
        window_with_torch(model, opt, twin, twin_opt, window,
                          between=lambda group, key=key, value=value: (
                              group.__setitem__(key, value)))
        assert_close_to_torch(model, twin, f"{key} set to {value} before step {window + 1}")


def test_a_loaded_float32_master_is_the_weight_the_next_step_starts_from():
    """A state dict saved with bfloat16 parameters (float32 masters) loaded into float32 ones:
    the masters become the weights, and the host copies the step updates with them (not the
    weights the model held before the load). Oracle: torch's AdamW from the saved masters and
    moments."""
    low = make_model(11, torch.bfloat16)
    low_opt = mk.optim.ShardedOptimizer(low.parameters(), "adamw", lr=3e-3, eps=1e-3)
    for micro in range(2):
        x, y = batch(0, micro, torch.bfloat16)
        low_opt.backward(torch.nn.functional.mse_loss(low(x).float(), y.float()))
        low_opt.step()
        low_opt.zero_grad()
    saved = low_opt.state_dict()
    model, twin = make_model(12), make_model(12)  # other weights than the saved masters
    opt, twin_opt = make_optimizer(model), TORCH["adamw"](twin.parameters())
    opt.load_state_dict(saved)
    with torch.no_grad():
        for i, (p, q) in enumerate(zip(model.parameters(), twin.parameters())):
            master = saved["state"][i]["master_param"]
            assert torch.equal(p, master), f"parameter {i} is not the loaded master"
            q.copy_(master)
            twin_opt.state[q] = {"step": torch.tensor(float(saved["state"][i]["step"])),
                                 **{k: saved["state"][i][k].clone()
                                    for k in ("exp_avg", "exp_avg_sq")}}
    window_with_torch(model, opt, twin, twin_opt, 1)
    assert_close_to_torch(model, twin, "the step after the load")
