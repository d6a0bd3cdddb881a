"""Each memkern.nn module under ``torch.compile(fullgraph=True)`` gives the eager result
(outputs and gradients). The memkern ops appear in the compiled graph as opaque custom ops
(their fake implementations give the metadata). Tiny shapes: compiling is the slow part.
"""
from __future__ import annotations

import pytest
import torch
import torch._inductor.config as inductor_config

import memkern as mk
from compare import rel_err

pytestmark = pytest.mark.slow



MODULES = {
    "Linear": lambda: mk.nn.Linear(8, 6),
    "LayerNorm": lambda: mk.nn.LayerNorm(8),
    "RMSNorm": lambda: mk.nn.RMSNorm(8),
    "Dropout": lambda: mk.nn.Dropout(0.3),
    "MLP": lambda: mk.nn.MLP(8, 12, activation="gelu_tanh", dropout=0.2, recompute="activation"),
    "MLP-full": lambda: mk.nn.MLP(8, 12, activation="silu", recompute="full"),
    "SwiGLU": lambda: mk.nn.SwiGLU(8, 12),
    "LinearCrossEntropy": lambda: mk.nn.LinearCrossEntropy(8, 11, bias=True, label_smoothing=0.1),
}


@pytest.mark.parametrize("name", list(MODULES))
def test_compiled_module_matches_eager(name):
    # Inductor draws random numbers as eager does, so dropout seeds match run for run.
    with inductor_config.patch(fallback_random=True):
        _check(name)


def _check(name):
    torch._dynamo.reset()
    module = MODULES[name]()
    x = torch.randn(3, 5, 8, requires_grad=True)
    args = (x, torch.randint(0, 11, (3, 5))) if name == "LinearCrossEntropy" else (x,)
    params = list(module.parameters())
    seed = int(torch.randint(0, 1 << 30, ()))

    torch.manual_seed(seed)
    eager = module(*args)
    g = torch.randn_like(eager)
    eager_grads = torch.autograd.grad(eager, [x, *params], g)

    compiled = torch.compile(module, fullgraph=True)
    torch.manual_seed(seed)
    out = compiled(*args)
    grads = torch.autograd.grad(out, [x, *params], g)

    assert rel_err(out, eager) < 1e-6
    for a, b in zip(grads, eager_grads):
        assert rel_err(a, b) < 1e-5
