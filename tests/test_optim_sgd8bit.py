"""``state_precision="8bit"`` on FusedSGD and ShardedOptimizer(optimizer="sgd") (single
process; the distributed cases are in test_optim_distributed.py): every step of the fused
optimizer against per-parameter float64 oracles (the op's reference for 8-bit parameters,
torch.optim.SGD for the float32 fallback), momentum 0, LR schedulers, memory. The size
threshold, state dicts, training against torch, skipped steps, accumulation with loss scaling
and clipping, and bad input: test_optim_8bit.py, parametrized over both optimizers."""
from __future__ import annotations

import torch

import flat_oracle as fo
import memkern as mk
from flat_oracle import assert_close64, f64
from memkern.kernels.state8bit import QBLOCK, num_blocks
from memkern.optim.grad_buffer import ALIGN
from memkern.optim.state_precision import MIN_8BIT_NUMEL
from net8bit import apply, gradient_steps, make_net, stored_state

HYPER = dict(lr=0.02, momentum=0.9, dampening=0.1, weight_decay=0.01)
HYPER_VALUES = (HYPER["lr"], HYPER["momentum"], HYPER["dampening"], HYPER["weight_decay"],
                False)


def snapshot(opt, model):
    """Per parameter, float64/CPU copies of what the next step starts from."""
    out = []
    for p in model.parameters():
        if not opt.state[p]:  # before the first step: the master is the weight, no momentum
            out.append((f64(p.reshape(-1)), None, torch.zeros(1)))
            continue
        master = opt.state[p].get("master_param", p).reshape(-1)
        stored = stored_state(opt, p, "momentum_buffer")[1:]
        out.append((f64(master), [t.cpu().clone() for t in stored],
                    opt.state[p]["step"].reshape(1).cpu().clone()))
    return out


def test_each_step_equals_the_float64_oracles_per_parameter():
    """bfloat16 model, five steps from the start: before each step the state of every
    parameter is copied out of the flat buffers, and after it the fused step must agree with
    that parameter's own float64 step: ``sgd8bit_step_``'s reference for the 8-bit ones (codes
    within one, float32 against float64 rounding), torch.optim.SGD for those below the
    threshold (float32 momentum). Compared step by step, so a rounding difference cannot grow
    through the model."""
    model = make_net(20, torch.bfloat16)
    opt = mk.optim.FusedSGD(model.parameters(), **HYPER, state_precision="8bit")
    kinds = ["8bit" if p.numel() >= MIN_8BIT_NUMEL else "32bit" for p in model.parameters()]
    assert kinds.count("8bit") == 2 and kinds.count("32bit") == 5
    for t, grads in enumerate(gradient_steps(model, 5)):
        before = snapshot(opt, model)
        apply(model, opt, [grads])
        for i, (p, g, (master, state, step)) in enumerate(zip(model.parameters(), grads, before)):
            g = f64(g.to(p.dtype).reshape(-1))
            what = f"step {t}, param {i} ({kinds[i]})"
            kind, *stored = stored_state(opt, p, "momentum_buffer")
            assert kind == kinds[i]
            mag_master, mag_buf = fo.sgd_magnitudes(
                master, torch.zeros_like(master) if state is None else
                (fo.dequantize64(state[0], state[1])
                 if kind == "8bit" else f64(state[0])), g, step, None, HYPER_VALUES)
            if kind == "8bit":
                codes = state[0] if state else torch.zeros(g.numel(), dtype=torch.int8)
                absmax = f64(state[1]) if state else torch.zeros(num_blocks(g.numel()),
                                                                  dtype=torch.float64)
                mk.ops.sgd8bit_step_.reference(master, codes, absmax, g, None, step, None,
                                               None, *HYPER_VALUES)
                fo.assert_codes_close(stored[0], codes, f"{what}: codes")
                assert_close64(stored[1], absmax, f"{what}: absmax",
                               magnitude=fo.block_max(mag_buf))
            else:
                buf = None if state is None else state[0]
                master, buf = fo.sgd_torch(master, buf, g, step, None, None, *HYPER_VALUES)
                assert_close64(stored[0], buf, f"{what}: momentum_buffer", magnitude=mag_buf)
            assert_close64(opt.state[p]["master_param"].reshape(-1), master, f"{what}: master",
                           magnitude=mag_master)
            assert torch.equal(p.reshape(-1), opt.state[p]["master_param"].reshape(-1).to(p.dtype))


def test_momentum_zero_keeps_no_state_and_steps_as_32bit():
    """Without momentum SGD has no state: "8bit" then quantizes nothing and steps exactly as
    "32bit" does. Momentum switched on later starts an 8-bit buffer from the next gradient,
    as torch starts its float32 one."""
    grads = gradient_steps(make_net(22), 4)
    models, opts = {}, {}
    for precision in ("32bit", "8bit"):
        models[precision] = make_net(22, torch.bfloat16)
        opts[precision] = mk.optim.FusedSGD(models[precision].parameters(), lr=0.05,
                                            weight_decay=0.01, state_precision=precision)
        apply(models[precision], opts[precision], grads[:2])
    for p, q in zip(models["32bit"].parameters(), models["8bit"].parameters()):
        assert torch.equal(p, q)
    opt = opts["8bit"]
    assert not any(seg.quantized_state or "momentum_buffer" in seg.state for seg in opt.segments)
    for precision in ("32bit", "8bit"):  # dampening: torch's first buffer is d all the same
        opts[precision].param_groups[0].update(momentum=0.9, dampening=0.5)
    apply(models["8bit"], opt, grads[2:3])
    quantized = [seg for seg in opt.segments if seg.quantized]
    assert quantized and all("momentum_buffer" in seg.quantized_state for seg in quantized)
    # The first momentum step is buf = d, stored exactly at the block's absmax code.
    for seg in quantized:
        codes, absmax = seg.quantized_state["momentum_buffer"]
        assert int(codes.abs().max()) == 127 and bool((absmax > 0).all())
    apply(models["32bit"], opts["32bit"], grads[2:3])
    for p, q in zip(models["32bit"].parameters(), models["8bit"].parameters()):
        assert torch.equal(p, q)  # the first momentum step uses the exact new buffer


def test_lr_scheduler_drives_the_8bit_step():
    """LambdaLR halves the learning rate every step: each step's master update is lr_t times
    the new (exact) momentum buffer, the one the 8-bit reference computes from the stored
    state."""
    model = make_net(29)
    opt = mk.optim.FusedSGD(model.parameters(), lr=0.04, momentum=0.9, state_precision="8bit")
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    index = [q is model.fc1.weight for q in model.parameters()].index(True)
    p = model.fc1.weight
    for t, grads in enumerate(gradient_steps(model, 3)):
        before = snapshot(opt, model)[index]
        apply(model, opt, [grads])
        scheduler.step()
        master, state, step = before
        g = f64(grads[index].reshape(-1))
        codes = state[0] if state else torch.zeros(g.numel(), dtype=torch.int8)
        absmax = f64(state[1]) if state else torch.zeros(num_blocks(g.numel()),
                                                          dtype=torch.float64)
        mk.ops.sgd8bit_step_.reference(master, codes, absmax, g, None, step, None, None,
                                       0.04 * 0.5 ** t, 0.9, 0.0, 0.0, False)
        assert_close64(p.reshape(-1), master, f"step {t}", rtol=1e-5)


def test_optimizer_state_bytes_are_a_quarter_plus_scales():
    """bfloat16 model: float32 masters (4 B) plus an 8-bit momentum buffer (1 B + 4 B per
    block) for the quantized parameters, measured from the storages."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 512),
                                torch.nn.Linear(512, 256)).to(torch.bfloat16)
    opt = mk.optim.FusedSGD(model.parameters(), lr=1e-3, momentum=0.9, state_precision="8bit")
    model(torch.randn(4, 256, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    breakdown = mk.profile.memory_breakdown(model, opt)
    big = sum(p.numel() for p in model.parameters() if p.numel() >= MIN_8BIT_NUMEL)
    small = sum(p.numel() for p in model.parameters() if p.numel() < MIN_8BIT_NUMEL)
    # small parameters are padded to ALIGN elements; one float32 step counter per segment
    expected = big + 4 * num_blocks(big) + 4 * (small + ALIGN) + 4 * len(opt.segments)
    assert abs(breakdown.optimizer_state - expected) <= 4 * ALIGN
    per_param = ((breakdown.grads + breakdown.master_weights + breakdown.optimizer_state)
                 / breakdown.num_params)
    print(f"optimizer-side bytes per parameter: {per_param:.4f}")
    # 2 grad + 4 master + 1 momentum code + 4 / QBLOCK absmax, plus 1.2% for the small ones
    assert per_param <= 7 + 4 / QBLOCK + 0.012
