"""``memkern::sgd8bit_step_``: the fused SGD step of ``memkern::sgd_step_`` with its momentum
buffer stored block-wise in 8 bits: dequantize, update, requantize, master write-back and the
16-bit parameter copy in one pass.

Arguments (1-D contiguous buffers on one device; ``n`` elements, ``B = ceil(n / QBLOCK)``)
    master            float32 master weights (n), updated in place.
    momentum_buffer   int8 codes of the momentum buffer ``buf`` (n), rewritten.
    momentum_absmax   float32 (B): per block of :data:`~memkern.kernels.state8bit.QBLOCK`
                      elements, ``max |buf|``.
    grads, params, step, grad_multiplier, found_inf, lr, momentum, dampening, weight_decay,
    nesterov          as ``memkern::sgd_step_`` (a set ``found_inf`` writes nothing), with
                      ``momentum > 0``: without momentum SGD keeps no state and
                      ``sgd_step_(..., momentum_buffer=None, ...)`` is the step.

The step::

    buf            = dequantize(codes, absmax)           (the stored momentum)
    master, buf    = SGD(master, buf, grads)             (memkern.ops.sgd.update, in float32;
                                                          buf = d on the first step, step == 0)
    codes, absmax  = quantize(buf)                       (per block of QBLOCK elements)
    params = round(master);  step = step + 1

The momentum buffer is a signed first moment like AdamW's ``exp_avg``, and is stored exactly
as :mod:`memkern.ops.adamw8bit` stores ``exp_avg``: the same block size, the same signed
square map (``buf = sign(c) * (|c| / 127) ** 2 * absmax``, int8 codes; the choice and its
anchor are justified there), the same handling of non-finite values (a block holding a NaN or
an infinite ``buf`` stores NaN as its absmax and zero codes: that block reads back as NaN from
the next step on, the other blocks are untouched). As there, the master update uses the new
``buf`` before it is requantized: quantization error enters through the *stored* state only.

No host sync: step, grad_multiplier and found_inf are read on the device.
"""
from __future__ import annotations

import torch

from memkern.ops import _checks, adamw8bit, sgd
from memkern.ops._registry import Op

SCHEMA = (
    "(Tensor(a!) master, Tensor(b!) momentum_buffer, Tensor(c!) momentum_absmax, "
    "Tensor grads, Tensor(d!)? params, Tensor(e!) step, Tensor? grad_multiplier, "
    "Tensor? found_inf, float lr, float momentum, float dampening, float weight_decay, "
    "bool nesterov) -> ()"
)


def _check(master, momentum_buffer, momentum_absmax, grads, params, step, grad_multiplier,
           found_inf, lr, momentum, dampening, weight_decay, nesterov) -> torch.device:
    op = "sgd8bit_step_"
    _checks.flat(op, "master", master, (torch.float32, torch.float64))
    if not momentum > 0.0:
        raise ValueError(
            f"memkern.{op}: momentum must be > 0, got {momentum}; without momentum SGD keeps "
            "no state to quantize: call memkern.ops.sgd_step_ with momentum_buffer=None"
        )
    adamw8bit._check_codes(op, "momentum_buffer", momentum_buffer, torch.int8, "momentum_absmax",
                          momentum_absmax, master)
    # The rest (grads, params, scalars, hyper-parameters) as sgd_step_.
    sgd._check(master, master, grads, params, step, grad_multiplier, found_inf, lr, momentum,
               dampening, weight_decay, nesterov, op=op)
    return master.device


def _fake(*args) -> None:
    _check(*args)


def reference(master, momentum_buffer, momentum_absmax, grads, params, step, grad_multiplier,
              found_inf, lr, momentum, dampening, weight_decay, nesterov) -> None:
    """Plain torch in ``master.dtype``: with float64 master and absmax it is the oracle of the
    quantized algorithm (dequantize, update and requantize all in float64)."""
    buf = adamw8bit.dequantize(momentum_buffer, momentum_absmax, master.dtype)
    new_master, new_buf = sgd.update(master, buf, grads, step, grad_multiplier, lr, momentum,
                                     dampening, weight_decay, nesterov)
    codes, absmax = torch.empty_like(momentum_buffer), torch.empty_like(momentum_absmax)
    adamw8bit.quantize(new_buf, codes, absmax)
    _checks.commit_step_(found_inf, [(master, new_master), (momentum_buffer, codes),
                                     (momentum_absmax, absmax)], master, params, step)


sgd8bit_step_ = Op(
    "sgd8bit_step_",
    SCHEMA,
    check=_check,
    fake=_fake,
    reference=reference,
    triton="memkern.kernels.sgd8bit.sgd8bit_step_",
    compiled_kernels=True,
)
