"""Helpers for the flat-buffer op tests: backends, sizes, random inputs, float64 oracles and
comparisons that say which element failed and by how much.
"""
from __future__ import annotations

import math

import pytest
import torch

from memkern.backend import runs_on

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SIZES = (1, 7, 1023, 65537)
"""Odd sizes, none a multiple of a block; the Triton interpreter runs all of them in seconds."""
BIG = 2**20 + 5
"""One size past 2**20 for the compiled backends (cpu, cuda)."""
RTOL = 1e-6
"""float32 state against the float64 oracle (float32 rounds at 6e-8: a 16x margin)."""


def cpu_backends() -> list[str]:
    """Backends that run ops on CPU tensors here (reference, triton interpreted, cpu if built)."""
    import conftest

    return conftest.cpu_backends()


def sizes_for(backend: str) -> tuple[int, ...]:
    return SIZES + ((BIG,) if backend in ("cpu", "cuda") else ())


def cases(*, with_sizes: bool = True, cuda_backends: tuple[str, ...] = ("cuda", "triton")):
    """pytest params ``(backend, device[, n])``: every CPU backend, plus CUDA runs (marked)."""
    out = []
    for device, backends, marks in (
        ("cpu", cpu_backends(), ()),
        ("cuda", cuda_backends, (pytest.mark.cuda,)),
    ):
        for backend in backends:
            if with_sizes:
                out += [pytest.param(backend, device, n, marks=marks, id=f"{backend}-{device}-n{n}")
                        for n in sizes_for(backend)]
            else:
                out.append(pytest.param(backend, device, marks=marks, id=f"{backend}-{device}"))
    return out


def need(backend: str, device: str) -> torch.device:
    """The device, or a skip when ``backend`` cannot run there in this process."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not runs_on(backend, dev):
        pytest.skip(f"backend {backend!r} cannot run on {device} here")
    return dev


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` as integers, every NaN as one NaN (NaN == NaN whatever its sign
    and payload: x86 CPUs produce -NaN where GPUs produce +NaN; -0 != +0)."""
    if t.is_floating_point():
        t = t.masked_fill(t.isnan(), math.nan)
    same_size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(same_size[t.element_size()])


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    a, e = bits(actual.cpu()), bits(expected.cpu())
    if not torch.equal(a, e):
        i = int((a != e).nonzero()[0])
        n_bad = int((a != e).sum())
        raise AssertionError(
            f"{what}: {n_bad}/{a.numel()} elements differ bitwise; first at [{i}]: "
            f"{actual.cpu()[i].item()!r} vs expected {expected.cpu()[i].item()!r}"
        )


def assert_close64(actual: torch.Tensor, oracle: torch.Tensor, what: str, rtol: float = RTOL,
                    magnitude: float | torch.Tensor | None = None) -> None:
    """``|a - b| <= rtol * (|b| + magnitude)`` elementwise against a float64 oracle.

    ``magnitude`` stands for the size of the terms an element was computed from (a tensor:
    per element, see :func:`adamw_magnitudes`; default: the mean ``|b|`` over the finite
    elements), so an element that came out near 0 by cancellation is held to the absolute
    error its inputs allow, not to an impossible relative one. Equal infinities pass, and so
    does NaN against NaN (and only against NaN).
    """
    a = actual.detach().cpu().to(torch.float64)
    b = oracle.detach().cpu().to(torch.float64)
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if b.numel() == 0:
        return
    finite = torch.isfinite(b)
    if isinstance(magnitude, torch.Tensor):
        scale = magnitude.detach().cpu().to(torch.float64)
    elif magnitude is not None:
        scale = torch.tensor(float(magnitude), dtype=torch.float64)
    elif finite.any():
        scale = b[finite].abs().mean()
    else:
        scale = torch.tensor(0.0, dtype=torch.float64)
    tol = rtol * (b.abs() + scale)
    ok = (a == b) | (a.isnan() & b.isnan()) | ((a - b).abs() <= tol)
    if not bool(ok.all()):
        bad = (~ok).nonzero().flatten()
        err = torch.where(ok, torch.zeros_like(a), ((a - b).abs() / tol).nan_to_num(math.inf))
        i = int(err.argmax())
        raise AssertionError(
            f"{what}: {bad.numel()}/{a.numel()} elements off (rtol={rtol}); worst [{i}]: "
            f"{a[i].item()!r} vs oracle {b[i].item()!r} (|diff| = {abs(a[i] - b[i]).item():.3e}, "
            f"allowed {tol[i].item():.3e})"
        )


def uniform(lo: float, hi: float) -> float:
    """Drawn from torch's generator, so conftest's printed seed replays a failure."""
    return lo + (hi - lo) * torch.rand((), dtype=torch.float64).item()


def randint(lo: int, hi: int) -> int:
    """An integer in ``[lo, hi]`` (inclusive), from torch's generator."""
    return int(torch.randint(lo, hi + 1, ()).item())


def choice(options):
    return options[randint(0, len(options) - 1)]


def poison(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A write-only output, filled with NaN so that an element the kernel skipped shows."""
    return torch.full((n,), math.nan, dtype=dtype, device=device)


def scalar(value: float, device) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32, device=device)


def inject(t: torch.Tensor, position: str, value: float) -> int:
    """Write ``value`` at the first/middle/last element of ``t``; returns the index."""
    i = {"first": 0, "middle": t.numel() // 2, "last": t.numel() - 1}[position]
    t[i] = value
    return i


def odd_multiplier() -> float:
    """A float32 gradient multiplier that is not a power of two (so rounding is exercised)."""
    return float(torch.tensor(2.0 ** -randint(4, 12) * uniform(0.55, 0.95)))


def scaled_grads(n: int, dtype: torch.dtype, multiplier: float | None) -> torch.Tensor:
    """Random gradients as the backward of a scaled loss leaves them (never zero)."""
    g = torch.randn(n)
    if multiplier is not None:
        g = g / multiplier
    return g.to(dtype)


def step_inputs(n: int, dtype: torch.dtype, device, with_optionals: bool):
    """``(grads, params, grad_multiplier, found_inf)`` of an optimizer step: CPU gradients of
    ``dtype`` scaled by 1 / multiplier, and, ``with_optionals``, a NaN-poisoned parameter copy,
    an odd multiplier and a clear found_inf on ``device`` (else None each)."""
    if not with_optionals:
        return scaled_grads(n, dtype, None), None, None, None
    multiplier = odd_multiplier()
    return (scaled_grads(n, dtype, multiplier), poison(n, dtype, device),
            scalar(multiplier, device), scalar(0.0, device))


def adamw_hyper() -> dict:
    """Random AdamW hyperparameters: both torch.lerp branches, eps large enough to matter."""
    return dict(
        lr=10 ** uniform(-2.5, -0.5),
        beta1=choice([uniform(0.6, 0.95), uniform(0.0, 0.45)]),
        beta2=uniform(0.9, 0.9999),
        eps=10 ** uniform(-8, -2),
        weight_decay=choice([0.0, uniform(0.01, 0.5)]),
    )


def f64(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().cpu().to(torch.float64)


def cpu_clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().cpu().clone()


def adamw_magnitudes(master, exp_avg, exp_avg_sq, grads, step, grad_multiplier, hyper,
                     new_exp_avg_sq):
    """Per element, the size of the terms AdamW adds up (float64 inputs before the step).

    ``exp_avg``: |m| + |g| (the lerp subtracts them); ``exp_avg_sq``: |v| + g**2;
    ``master``: |master| + step_size * (|m| + |g|) / denom, with the oracle's denominator,
    which carries an ``m`` that came out near 0 by cancellation into the update.
    """
    lr, beta1, beta2, eps, _ = hyper.values()
    g = grads * (1.0 if grad_multiplier is None else grad_multiplier.item())
    t = step.item() + 1
    mag_m = exp_avg.abs() + g.abs()
    mag_v = exp_avg_sq.abs() + g * g
    denom = new_exp_avg_sq.sqrt() / math.sqrt(1 - beta2**t) + eps
    mag_master = master.abs() + lr / (1 - beta1**t) * mag_m / denom
    return mag_master, mag_m, mag_v


def sgd_magnitudes(master, momentum_buffer, grads, step, grad_multiplier, hyper):
    """Per element, the size of the terms SGD adds up (float64 inputs before the step): each
    sum of the update with its terms taken by absolute value."""
    lr, momentum, dampening, weight_decay, nesterov = hyper
    d = grads.abs() * (1.0 if grad_multiplier is None else abs(grad_multiplier.item()))
    d = d + weight_decay * master.abs()
    mag_buf = None
    if momentum != 0.0:
        mag_buf = d if step.item() == 0 else momentum * momentum_buffer.abs() + (1 - dampening) * d
        d = d + momentum * mag_buf if nesterov else mag_buf
    return master.abs() + lr * d, mag_buf


# --------------------------------------------------------------------------------------------
# float64 oracles that share no code with memkern: torch.optim's own update rules


def _torch_step(make_opt, master, state: dict, grads, grad_multiplier, found_inf):
    """One step of the torch optimizer ``make_opt([p])`` in float64 from ``state``; returns the
    new master and state, or copies of the old ones when ``found_inf`` is non-zero."""
    p = torch.nn.Parameter(f64(master).clone())
    if found_inf is not None and found_inf.item() != 0:
        return p.detach(), {k: v.clone() for k, v in state.items()}
    g = f64(grads)
    if grad_multiplier is not None:
        g = g * grad_multiplier.item()
    p.grad = g
    opt = make_opt([p])
    opt.state[p] = {k: v.clone() for k, v in state.items()}
    opt.step()
    return p.detach(), opt.state[p]


def adamw_torch(master, exp_avg, exp_avg_sq, grads, step, grad_multiplier, found_inf,
                lr, beta1, beta2, eps, weight_decay):
    """``[master, exp_avg, exp_avg_sq]`` (float64) and the step after one
    ``torch.optim.AdamW`` step (single-tensor path) from the given state."""
    state = {"step": torch.tensor(float(step.item())), "exp_avg": f64(exp_avg),
             "exp_avg_sq": f64(exp_avg_sq)}
    new_master, new = _torch_step(
        lambda ps: torch.optim.AdamW(ps, lr=lr, betas=(beta1, beta2), eps=eps,
                                     weight_decay=weight_decay, foreach=False),
        master, state, grads, grad_multiplier, found_inf)
    return [new_master, new["exp_avg"], new["exp_avg_sq"]], new["step"].item()


def sgd_torch(master, momentum_buffer, grads, step, grad_multiplier, found_inf,
              lr, momentum, dampening, weight_decay, nesterov):
    """``(master, momentum_buffer)`` (float64; the buffer None without momentum) after one
    ``torch.optim.SGD`` step; memkern's ``step == 0`` is torch's "no buffer yet"."""
    state = {}
    if momentum != 0.0 and step.item() != 0:
        state["momentum_buffer"] = f64(momentum_buffer)
    new_master, new = _torch_step(
        lambda ps: torch.optim.SGD(ps, lr=lr, momentum=momentum, dampening=dampening,
                                   weight_decay=weight_decay, nesterov=nesterov, foreach=False),
        master, state, grads, grad_multiplier, found_inf)
    return new_master, new.get("momentum_buffer")


# --------------------------------------------------------------------------------------------
# The block-wise 8-bit state (memkern/ops/adamw8bit.py's map), written here from its definition
# in float64 plain torch, independent of memkern's quantizer

QBLOCK = 256
"""Elements per quantization block (memkern.kernels.state8bit.QBLOCK; test_state8bit_ops.py
checks that the two agree)."""
CODE_MAPS = {torch.int8: (127, 2), torch.uint8: (255, 4)}
"""Per code dtype: the largest code C and the power p of ``x = sign(c) (|c| / C) ** p absmax``."""


def blocks_of(n: int) -> int:
    return -(-n // QBLOCK)


def block_max(x: torch.Tensor) -> torch.Tensor:
    """Per block of QBLOCK elements, the largest of ``x`` (>= 0)."""
    padded = torch.zeros(blocks_of(x.numel()) * QBLOCK, dtype=x.dtype)
    padded[:x.numel()] = x
    return padded.view(-1, QBLOCK).amax(dim=1)


def quantize64(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, absmax)`` of ``x`` in float64: per block ``absmax = max |x|`` and ``c`` the
    code whose value ``sign(c) (|c| / C) ** p absmax`` is nearest to ``x`` for int8 (p = 2),
    and whose value's square root is nearest to ``sqrt(x)`` for uint8 (p = 4), the smaller
    ``|c|`` on a tie: ``|c|`` counts the midpoints between consecutive ``(k / C) ** 2`` that
    lie below ``|x| / absmax`` (int8) or ``sqrt(x / absmax)`` (uint8). A block with a
    non-finite value gets NaN and zero codes, an all-zero block absmax 0 and zero codes."""
    top, power = CODE_MAPS[dtype]
    x = x.detach().cpu().to(torch.float64)
    n = x.numel()
    padded = torch.zeros(blocks_of(n) * QBLOCK, dtype=torch.float64)
    padded[:n] = x
    blocks = padded.view(-1, QBLOCK)
    bad = ~blocks.isfinite().all(dim=1)
    absmax = blocks.abs().nan_to_num(0.0, posinf=0.0).amax(dim=1)
    usable = ~bad & (absmax > 0)
    scale = torch.where(usable, absmax, torch.ones_like(absmax))[:, None]
    relative = torch.where(usable[:, None], blocks.abs() / scale, torch.zeros_like(blocks))
    rounded = relative if power == 2 else relative.sqrt()
    squares = torch.tensor([(k / top) ** 2 for k in range(top + 1)], dtype=torch.float64)
    midpoints = (squares[:-1] + squares[1:]) / 2
    magnitude = torch.searchsorted(midpoints, rounded.reshape(-1), side="left")
    codes = magnitude.to(torch.float64).view_as(blocks) * torch.sign(blocks).nan_to_num(0.0)
    absmax = torch.where(bad, torch.full_like(absmax, math.nan), absmax)
    return codes.reshape(-1)[:n].to(dtype), absmax


def dequantize64(codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """The float64 values of ``codes`` (int8 or uint8) with one ``absmax`` per block."""
    top, power = CODE_MAPS[codes.dtype]
    c = codes.detach().cpu().to(torch.float64)
    scale = absmax.detach().cpu().to(torch.float64).repeat_interleave(QBLOCK)[:c.numel()]
    return torch.sign(c) * (c.abs() / top) ** power * scale


def quantized_state(n: int, code_dtypes, device) -> list[torch.Tensor]:
    """``[master, codes, absmax, ...]``: random float32 master weights, and per code dtype the
    codes and float32 absmax of values spread over several decades within a block (what the
    map must resolve): signed for int8 (first moments, momentum), positive for uint8."""
    state = [torch.randn(n) * uniform(0.02, 1.0)]
    for dtype in code_dtypes:
        if dtype == torch.int8:
            values = torch.randn(n) * 0.1 * 10 ** (2 * torch.rand(n) - 2)
        else:
            values = (torch.rand(n) + 1e-3) * 10 ** (4 * torch.rand(n) - 4)
        codes, absmax = quantize64(values, dtype)
        state += [codes, absmax.to(torch.float32)]
    return [t.to(device) for t in state]


def oracle_state(state: list[torch.Tensor]) -> list[torch.Tensor]:
    """``state`` (master, then codes and absmax pairs) for a float64 run of an op's reference:
    float64 master and absmax on the CPU, the same codes."""
    return [t.cpu().clone() if t.dtype in CODE_MAPS else f64(t) for t in state]


def assert_codes_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Codes equal up to one step where float32 and float64 round a value near a code
    boundary differently (rare: at most 1% of the elements)."""
    diff = (actual.cpu().to(torch.int32) - expected.to(torch.int32)).abs()
    if diff.numel() == 0:
        return
    assert int(diff.max()) <= 1, f"{what}: a code is off by {int(diff.max())}"
    assert int((diff != 0).sum()) <= max(1, actual.numel() // 100), (
        f"{what}: {int((diff != 0).sum())}/{actual.numel()} codes differ by one")


def check_8bit_step(op: str, backend: str, dev, dtype: torch.dtype, state: list[torch.Tensor],
                    step: torch.Tensor, hyper: tuple, moment_names: tuple[str, ...],
                    magnitudes, *, with_optionals: bool, it: int) -> None:
    """One call of 8-bit step op ``op`` on ``backend`` (``state``: master, then codes and
    absmax per moment named in ``moment_names``; updated in place) against its reference run
    on a float64 copy of the state, the float64 oracle of the quantized algorithm: master and
    absmax within rounding of ``magnitudes(master, moments, grads, step, grad_multiplier)``
    (float64 values before the step: the master's and each moment's per-element magnitudes),
    codes up to a boundary flip, the step counter, and the params written from the master."""
    from memkern import ops

    n = state[0].numel()
    g, params, mult_t, found_inf = step_inputs(n, dtype, dev, with_optionals)
    oracle = oracle_state(state)
    moments = [dequantize64(codes, absmax) for codes, absmax in zip(oracle[1::2], oracle[2::2])]
    step_before, oracle_step = step.item(), step.cpu().clone()
    mag_master, *mag_moments = magnitudes(oracle[0].clone(), moments, f64(g), oracle_step.clone(),
                                          cpu_clone(mult_t))
    kernel = getattr(ops, op)

    with ops.force(backend):
        kernel(*state, g.to(dev, copy=True), params, step, mult_t, found_inf, *hyper)
    kernel.reference(*oracle, f64(g), None, oracle_step, cpu_clone(mult_t), cpu_clone(found_inf),
                     *hyper)

    what = f"{op} {dtype} n={n} step {step_before:.0f} {hyper} (call {it})"
    assert_close64(state[0], oracle[0], f"{what}: master", magnitude=mag_master)
    for k, (name, mag) in enumerate(zip(moment_names, mag_moments)):
        assert_codes_close(state[1 + 2 * k], oracle[1 + 2 * k], f"{what}: {name} codes")
        assert_close64(state[2 + 2 * k], oracle[2 + 2 * k], f"{what}: {name}_absmax",
                       magnitude=block_max(mag))
    assert step.item() == step_before + 1 == oracle_step.item()
    if params is not None:  # written from the float32 master in the same pass: bit-exact
        assert_bits_equal(params, state[0].to(dtype), f"{what}: params")
