"""Float64 oracles of the layer ops' math, written in plain torch from the definitions (no
memkern code): the tests of the CPU, CUDA and Triton kernels compare against these."""
from __future__ import annotations

import torch


def norm64(x, w, b, eps, rms, dy):
    """(y, mean, rstd) and the gradients of (x, w, b) for ``dy``, in float64 by autograd."""
    leaves = [None if t is None else t.double().requires_grad_() for t in (x, w, b)]
    x64, w64, b64 = leaves
    mean = None if rms else x64.mean(-1, keepdim=True)
    centred = x64 if rms else x64 - mean
    rstd = torch.rsqrt(centred.square().mean(-1, keepdim=True) + eps)
    y = centred * rstd
    y = y * w64 if w64 is not None else y
    y = y + b64 if b64 is not None else y
    wanted = [t for t in leaves if t is not None]
    grads = dict(zip([i for i, t in enumerate(leaves) if t is not None],
                     torch.autograd.grad(y, wanted, dy.double())))
    return (y.detach(), None if rms else mean.detach().view(-1), rstd.detach().view(-1),
            [grads.get(i) for i in range(3)])
