"""``memkern::adamw8bit_step_``: the fused AdamW step of ``memkern::adamw_step_`` with its two
moments stored block-wise in 8 bits: dequantize, update, requantize, master write-back and the
16-bit parameter copy in one pass.

Arguments (1-D contiguous buffers on one device; ``n`` elements, ``B = ceil(n / QBLOCK)``)
    master             float32 master weights (n), updated in place.
    exp_avg            int8 codes of the first moment ``m`` (n), rewritten.
    exp_avg_absmax     float32 (B): per block of :data:`QBLOCK` elements, ``max |m|``.
    exp_avg_sq         uint8 codes of the second moment ``v`` (n), rewritten.
    exp_avg_sq_absmax  float32 (B): per block, ``max v``.
    grads, params, step, grad_multiplier, found_inf, lr, beta1, beta2, eps, weight_decay
                       as ``memkern::adamw_step_`` (a set ``found_inf`` writes nothing).

The step::

    m, v   = dequantize(codes, absmax)                 (the stored moments)
    master, m, v = AdamW(master, m, v, grads)          (memkern.ops.adamw.update, in float32)
    codes, absmax = quantize(m), quantize(v)           (per block of QBLOCK elements)
    params = round(master);  step = step + 1

The master update uses the new ``m`` and ``v`` before they are requantized (as bitsandbytes'
8-bit optimizers do): quantization error enters through the *stored* state only.

Quantization map (the choice and why, measured with ``benchmarks/bench_8bit_state.py``):
a *power* map on top of bitsandbytes' block-wise absmax scaling (Dettmers et al., "8-bit
Optimizers via Block-wise Quantization", 2022, the anchor). With ``s`` a block's absmax::

    m = sign(c) * (|c| / 127) ** 2 * s,   c in [-127, 127]   (int8)
    v = (c / 255) ** 4 * s,               c in [0, 255]      (uint8)
    quantize: the code c whose (|c| / C) ** 2 is nearest to |m| / s (m: the nearest value),
              or to sqrt(v / s) (v: the nearest root of a value, the root the update divides
              by); the smaller |c| on a tie. C = 127 or 255.

Which quantity a code is the nearest of decides the bias the stored state carries, and the
loss curves measured it (the bench model, float32 parameters, sequence 128, batch 8, 200 steps
at lr 1e-3; ``benchmarks/bench_8bit_state.py --sections quality``; benchmarks/NOTES.md,
"8-bit optimizer state"):

1. The nearest root, ``C |x / s| ** (1/p)`` rounded to an integer (the first rule): the map is
   convex, so every ``x`` between two codes' midpoint in root space and their midpoint in value
   space went to the upper code, and the stored ``|m|`` and ``v`` came back biased upward. Seed
   0: mean signed loss gap to the 32-bit run -0.45%, 22 of 180 steps over 1%, largest 2.46%.
2. The nearest value, for ``m`` and ``v``. Seeds 0, 1, 2 (on a later main): largest step gaps
   2.24%, 1.97%, 2.62%; 11, 7, 7 steps over 1%; mean signed gaps -0.27%, -0.06%, +0.01%.
3. Now: ``v``'s code is the nearest in ``sqrt(v)``, the quantity the update reads (its
   midpoints lie between the two above; a scratch ablation had shown ``v``'s rounding, not
   ``m``'s, pulling the 8-bit loss below the 32-bit one). Seeds 0, 1, 2: largest step gaps
   1.55%, 1.81%, 2.05%; 11, 2, 5 steps over 1%; mean signed gaps -0.17%, -0.00%, +0.01%. The
   32-bit step in another rounding order: 0.60%, 0.00%, 1.24% (0, 0, 1 steps over 1%).

In units of ``(|c| / C) ** 2`` both rules are the square map's: the midpoint of codes ``k`` and
``k + 1`` is ``(k**2 + k + 1/2) / C**2``. This reference takes the truncated root ``lo`` of that
quantity (times C) and adds one where the quantity lies above the midpoint of ``lo`` and
``lo + 1``; the kernels (C++, CUDA, Triton) use the closed form,
``round(sqrt(y - 1/4))`` with ``y = C**2 |m| / s`` or ``C**2 sqrt(v) / sqrt(s)``, one root per
code and one division per block, no truncation and no comparison (csrc/cpu/state8bit.h): codes
equal to the reference's but for a value within an ulp of a code boundary.

Like bitsandbytes' dynamic (tree) map it is dense near zero, which a linear map is not: a
linear map rounds every ``v`` below ``s / 510`` to 0, and a zero ``v`` under a non-zero ``m``
turns the update ``m / (sqrt(v) + eps)`` into ``m / eps`` (the "zero-point problem" of Li et
al., "Memory Efficient Optimizers with 4-bit States", 2023). The 4th-power map resolves ``v``
down to ``s * 255**-4 ~ 2e-10 * s`` (``sqrt(v)`` to ``1.5e-5``); the square map resolves
``m`` to ``6e-5 * s``, relative steps of at most 2/c and 4/c. Unlike the tree map it needs no
table and no search: both directions are a few square roots and products, which vectorise on
the CPU. On a GPU they are not free: the AdamW step's budget at 80% of an H100's copy bandwidth
is ~200 SASS instructions per element, and the 8-bit kernels take ~270-290
(``benchmarks/step_kernel_sass.py``).

Block size ``QBLOCK`` = 256 (:mod:`memkern.kernels.state8bit`), as bitsandbytes' and
torchao's 8-bit optimizers use, chosen from measurement (``benchmarks/bench_8bit_block.py``;
figures in benchmarks/NOTES.md): on the bench model's Adam state, blocks of 64, 128 and 256
read the update direction ``m / (sqrt(v) + eps)`` back with a median relative error of 0.82%,
0.86% and 0.90%, and the loss curves stay as close to the float32-state run, while the scales
cost 2 x 4 / QBLOCK = 0.125, 0.0625 and 0.031 bytes per parameter: only 256 (8.03) and 128
(8.06) meet the 8.1 bytes-per-parameter target with room for padding. QBLOCK is the flat
layout's alignment (:data:`memkern.optim.grad_buffer.ALIGN`): every parameter and every ZeRO
shard starts on a block boundary, so a block never spans two parameters or two ranks, and the
quantized state of a parameter does not depend on the world size.

Backends compute the map in different orders of float32 roundings (the compiled CPU kernel
with per-block factors and no division per element, csrc/cpu/state8bit.h): their values agree
within a few ulp and their codes but where a value lies within an ulp of a code boundary.

Non-finite moments: a block holding a NaN or an infinite ``m`` (``v``) stores NaN as its
absmax and 0 codes, so its moments read back as NaN from the next step on (the master of this
step is computed from the exact values, as in ``adamw_step_``). With loss scaling such steps
are skipped and nothing is written.

No host sync: step, grad_multiplier and found_inf are read on the device.
"""
from __future__ import annotations

import torch

from memkern.kernels.state8bit import (
    QBLOCK,
    SIGNED_CODES,
    SIGNED_POWER,
    UNSIGNED_CODES,
    UNSIGNED_POWER,
    num_blocks,
)
from memkern.ops import _checks, adamw
from memkern.ops._registry import Op

SCHEMA = (
    "(Tensor(a!) master, Tensor(b!) exp_avg, Tensor(c!) exp_avg_absmax, Tensor(d!) exp_avg_sq, "
    "Tensor(e!) exp_avg_sq_absmax, Tensor grads, Tensor(f!)? params, Tensor(g!) step, "
    "Tensor? grad_multiplier, Tensor? found_inf, "
    "float lr, float beta1, float beta2, float eps, float weight_decay) -> ()"
)


def _check_codes(op: str, name: str, codes: torch.Tensor, dtype: torch.dtype,
                 absmax_name: str, absmax: torch.Tensor, master: torch.Tensor) -> None:
    _checks.flat(op, name, codes, (dtype,), like=master)
    _checks.flat(op, absmax_name, absmax, (master.dtype,))
    if absmax.numel() != num_blocks(master.numel()) or absmax.device != master.device:
        raise ValueError(
            f"memkern.{op}: {absmax_name} must hold one value per block of {QBLOCK} elements "
            f"({num_blocks(master.numel())} for {master.numel()} elements) on {master.device}, "
            f"got {absmax.numel()} on {absmax.device}; allocate it with "
            "memkern.kernels.state8bit.num_blocks(n)"
        )


def _check(master, exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax, grads, params, step,
           grad_multiplier, found_inf, lr, beta1, beta2, eps, weight_decay) -> torch.device:
    op = "adamw8bit_step_"
    _checks.flat(op, "master", master, (torch.float32, torch.float64))
    _check_codes(op, "exp_avg", exp_avg, torch.int8, "exp_avg_absmax", exp_avg_absmax, master)
    _check_codes(op, "exp_avg_sq", exp_avg_sq, torch.uint8, "exp_avg_sq_absmax",
                 exp_avg_sq_absmax, master)
    # The rest (grads, params, scalars, hyper-parameters) as adamw_step_.
    adamw._check(master, master, master, grads, params, step, grad_multiplier, found_inf,
                 lr, beta1, beta2, eps, weight_decay, op=op)
    return master.device


def _fake(*args) -> None:
    _check(*args)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` as ``[ceil(n / block), block]`` rows, the last one padded with zeros."""
    n = x.numel()
    padded = x.new_zeros(-(-n // block) * block)
    padded[:n] = x
    return padded.view(-1, block)


def _relative_value(c: torch.Tensor, levels: int, power: int) -> torch.Tensor:
    """``(|c| / levels) ** power`` of the float codes ``c``, a code's value over its block's
    absmax, in the reference's order of roundings (the kernels take the closed form above)."""
    q = c.abs() / levels
    return q * q if power == 2 else (q * q) * (q * q)


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype, *,
               block: int = QBLOCK) -> torch.Tensor:
    """The moments stored as ``codes`` (int8: ``m``; uint8: ``v``) and per-block ``absmax``,
    in ``dtype`` (float32, or float64 for the oracle); ``block``: elements per absmax (only
    benchmarks/bench_8bit_block.py, which compares block sizes, passes another)."""
    n = codes.numel()
    signed = codes.dtype == torch.int8
    levels, power = (SIGNED_CODES, SIGNED_POWER) if signed else (UNSIGNED_CODES, UNSIGNED_POWER)
    values = _relative_value(_blocks(codes.to(dtype), block), levels, power)
    values = values * absmax.to(dtype)[:, None]
    if signed:
        values = values * _blocks(codes.to(dtype), block).sign()
    return values.reshape(-1)[:n]


def quantize(x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, *,
             block: int = QBLOCK) -> None:
    """Writes ``x`` (float32/float64) into ``codes`` (int8: signed ``m``; uint8: ``v >= 0``)
    and ``absmax`` (one per ``block`` elements), computed in ``x.dtype``; a block with a
    non-finite value gets NaN and zero codes."""
    n = x.numel()
    signed = codes.dtype == torch.int8
    levels, power = (SIGNED_CODES, SIGNED_POWER) if signed else (UNSIGNED_CODES, UNSIGNED_POWER)
    rows = _blocks(x, block)
    finite = torch.isfinite(rows).all(dim=1, keepdim=True)
    scale = torch.where(torch.isfinite(rows), rows.abs(), 0).amax(dim=1, keepdim=True)
    usable = finite & (scale > 0)
    rel = torch.where(usable, rows.abs() / torch.where(usable, scale, 1), 0)
    # the quantity whose nearest code value is taken, (|c| / C) ** 2 in both maps: |m| / s,
    # or sqrt(v / s), the root the update divides by
    rounded = rel if power == 2 else rel.sqrt()
    # the code below it (C for the absmax), then the nearer of it and the next (the lower on a
    # tie); where the root rounds across an integer lo is one off, and the comparison still holds
    lo = torch.floor(rounded.sqrt() * levels)
    above = rounded - _relative_value(lo, levels, 2) > _relative_value(lo + 1, levels, 2) - rounded
    c = lo + above.to(lo.dtype)
    if signed:
        c = torch.where(usable, c * rows.sign(), 0)
    codes.copy_(c.reshape(-1)[:n].to(codes.dtype))
    absmax.copy_(torch.where(finite, scale, torch.nan).reshape(-1))


def reference(master, exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax, grads, params,
              step, grad_multiplier, found_inf, lr, beta1, beta2, eps, weight_decay) -> None:
    """Plain torch in ``master.dtype``: with float64 master and absmax it is the oracle of the
    quantized algorithm (dequantize, update and requantize all in float64)."""
    compute = master.dtype
    m = dequantize(exp_avg, exp_avg_absmax, compute)
    v = dequantize(exp_avg_sq, exp_avg_sq_absmax, compute)
    new_master, new_m, new_v = adamw.update(master, m, v, grads, step, grad_multiplier,
                                            lr, beta1, beta2, eps, weight_decay)
    m_codes, m_absmax = torch.empty_like(exp_avg), torch.empty_like(exp_avg_absmax)
    v_codes, v_absmax = torch.empty_like(exp_avg_sq), torch.empty_like(exp_avg_sq_absmax)
    quantize(new_m, m_codes, m_absmax)
    quantize(new_v, v_codes, v_absmax)
    _checks.commit_step_(found_inf, [(master, new_master), (exp_avg, m_codes),
                                     (exp_avg_absmax, m_absmax), (exp_avg_sq, v_codes),
                                     (exp_avg_sq_absmax, v_absmax)], master, params, step)


adamw8bit_step_ = Op(
    "adamw8bit_step_",
    SCHEMA,
    check=_check,
    fake=_fake,
    reference=reference,
    triton="memkern.kernels.adamw8bit.adamw8bit_step_",
    compiled_kernels=True,
)
