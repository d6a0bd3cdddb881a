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
from conftest import needs_layer_extension

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


CHAINS = {
    "LayerNorm>Linear": lambda: torch.nn.Sequential(mk.nn.LayerNorm(64), mk.nn.Linear(64, 33)),
    "RMSNorm>Linear": lambda: torch.nn.Sequential(mk.nn.RMSNorm(64), mk.nn.Linear(64, 33)),
    "LayerNorm>MLP": lambda: torch.nn.Sequential(mk.nn.LayerNorm(64), mk.nn.MLP(64, 160)),
    "MLP-full": lambda: mk.nn.MLP(64, 160, activation="silu", recompute="full"),
    "SwiGLU": lambda: mk.nn.SwiGLU(64, 160),
    "SwiGLU-full": lambda: mk.nn.SwiGLU(64, 160, recompute="full"),
}


@needs_layer_extension
@pytest.mark.parametrize("name", list(CHAINS))
def test_compiled_modules_save_no_more_than_eager(name):
    from memkern.profile import saved_bytes

    torch._dynamo.reset()
    module = CHAINS[name]()
    x = torch.randn(3, 37, 64, requires_grad=True)
    eager = saved_bytes(module, x)
    compiled = torch.compile(module)
    compiled(x)
    # what eager saves, counted independently: the input (fp32), per-row statistics and, for
    # the MLPs with recompute="activation", one pre-activation (or gate and up) per row;
    # compiled, the same without the statistics (recomputed: the norm's region recomputes
    # every op)
    rows, hidden = 3 * 37, 160
    per_row = {"LayerNorm>MLP": hidden, "SwiGLU": 2 * hidden}.get(name, 0)
    assert eager <= 4 * (x.numel() + rows * (2 + per_row))
    assert saved_bytes(compiled, x) == 4 * (x.numel() + rows * per_row), \
        "torch.compile lost a memkern memory saving"
    out = compiled(x)
    grads = torch.autograd.grad(out.square().sum(), [x, *module.parameters()])
    want = torch.autograd.grad(module(x).square().sum(), [x, *module.parameters()])
    for a, b in zip(grads, want):
        assert rel_err(a, b) < 1e-5


@needs_layer_extension
def test_compiled_dropout_saves_only_its_seed():
    """Compiled, the dropout op's C++ autograd is traced: backward keeps the int64 seed (8
    bytes), never a mask, as in eager mode."""
    from memkern.profile import saved_bytes

    torch._dynamo.reset()
    module = mk.nn.Dropout(0.3)
    x = torch.randn(3, 37, 64, requires_grad=True)
    compiled = torch.compile(module)
    compiled(x)
    assert saved_bytes(module, x) == saved_bytes(compiled, x) == 8


def _assert_same_float32_gradients(module, x, out, eager):
    """``out`` (compiled) equals ``eager``, and their gradients w.r.t. ``x`` and the module's
    parameters are float32 and agree."""
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *module.parameters()], g)
    want = torch.autograd.grad(eager, [x, *module.parameters()], g)
    assert torch.equal(out, eager)
    for a, b in zip(grads, want):
        assert a.dtype == b.dtype == torch.float32 and rel_err(a, b) < 1e-5


@needs_layer_extension
def test_compiled_linear_under_autocast_matches_eager():
    """Under autocast the traced Linear computes in autocast's dtype (the op's fake says so).
    Eager it saves the input as cast; compiled, the partitioner keeps the weight's cast copy
    as well (as it did when this path was a Python autograd.Function: 18432 bytes here)."""
    from memkern.ops.linear_layer import _fake as linear_layer_fake
    from memkern.profile import saved_bytes

    torch._dynamo.reset()
    module = mk.nn.Linear(64, 33)
    x = torch.randn(3, 37, 64, requires_grad=True)
    compiled = torch.compile(module, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, eager = compiled(x), module(x)
        assert out.dtype == eager.dtype == torch.bfloat16
        # the fake implementation itself (the traced C++ node gave the compiled graph's dtype)
        assert linear_layer_fake(x, module.weight, None, False).dtype == torch.bfloat16
        assert saved_bytes(module, x) == 2 * x.numel()
        assert saved_bytes(compiled, x) == 2 * (x.numel() + module.weight.numel())
    _assert_same_float32_gradients(module, x, out, eager)


@needs_layer_extension
def test_compiled_norm_then_linear_under_autocast_keeps_what_it_did():
    """LayerNorm>Linear under autocast (bfloat16) on a float32 input, compiled: the traced norm
    computes in float32, as in eager mode, and the graph keeps x (float32) and the bfloat16
    copies of the norm's output and of the weight that the Linear computes with (46848 bytes
    here, as when the norm was a Python Function in its region); the results are eager's."""
    from memkern.profile import saved_bytes

    torch._dynamo.reset()
    module = CHAINS["LayerNorm>Linear"]()
    x = torch.randn(3, 37, 64, requires_grad=True)
    compiled = torch.compile(module, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, eager = compiled(x), module(x)
        norm_out = torch.compile(module[0], fullgraph=True)(x)
        assert out.dtype == eager.dtype == torch.bfloat16 and norm_out.dtype == torch.float32
        assert saved_bytes(compiled, x) == (4 * x.numel()
                                            + 2 * (x.numel() + module[1].weight.numel()))
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *module.parameters()], g)
    want = torch.autograd.grad(eager, [x, *module.parameters()], g)
    assert rel_err(out.float(), eager.float()) < 1e-2
    for a, b in zip(grads, want):
        assert a.dtype == b.dtype == torch.float32 and rel_err(a, b) < 1e-2


@needs_layer_extension
@pytest.mark.parametrize("name", ["MLP", "SwiGLU-none"])
def test_compiled_gemm_layers_under_autocast_match_eager(name):
    """Under autocast the traced MLP/SwiGLU node computes in autocast's dtype; compiled, its
    region recomputes the casts, so the input is kept as given (float32) and the weights'
    bfloat16 copies are not kept (the partitioner kept them when this path was a Python
    autograd.Function: 90688 and 182208 bytes here), with the intermediates of ``recompute``
    in bfloat16."""
    from memkern.profile import saved_bytes

    torch._dynamo.reset()
    module = (mk.nn.MLP(64, 160, activation="gelu_tanh") if name == "MLP"
              else mk.nn.SwiGLU(64, 160, recompute="none"))
    x = torch.randn(3, 37, 64, requires_grad=True)
    compiled = torch.compile(module, fullgraph=True)
    rows, hidden = 3 * 37, 160
    intermediates = 1 if name == "MLP" else 3  # pre; gate, up, h
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, eager = compiled(x), module(x)
        assert out.dtype == eager.dtype == torch.bfloat16
        assert saved_bytes(module, x) == 2 * (x.numel() + intermediates * rows * hidden)
        assert saved_bytes(compiled, x) == 4 * x.numel() + 2 * intermediates * rows * hidden
    _assert_same_float32_gradients(module, x, out, eager)


@needs_layer_extension
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_compiled_linear_cross_entropy_is_its_two_loop_ops_and_keeps_what_eager_keeps(
        dtype, reduction, bias):
    """Compiled, the layer's C++ node is traced into its two loop ops, opaque (never the
    unrolled loop): the forward graph holds memkern::linear_cross_entropy_forward, the backward
    graph memkern::linear_cross_entropy_backward where the weight gradient is computed there
    (split). What backward keeps, counted by hand: float32 "mean" the gradients computed in
    forward (dx, dW, db) and the 0-dim divisor; split ``x``, the targets, the float32
    log-sum-exp and dx (and the divisor for "mean"); the parameters are not counted. The loss
    and gradients against the float64 unfused graph. The partitioner is inductor's
    (min-cut); the graphs are run by AOTAutograd without inductor's code generation (cheap)."""
    import torch.nn.functional as F
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    from memkern.profile import saved_bytes

    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = {str(n.target) for n in gm.graph.nodes
                            if n.op == "call_function" and str(n.target).startswith("memkern.")}
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                           partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    N, H, V = 37, 24, 53
    module = mk.nn.LinearCrossEntropy(H, V, bias=bias, reduction=reduction, ignore_index=3,
                                      dtype=dtype)
    x = torch.randn(N, H, dtype=dtype, requires_grad=True)
    t = torch.randint(0, V, (N,))
    t[[0, 17]] = 3
    compiled = torch.compile(module, fullgraph=True, backend=backend)
    loss = compiled(x, t)
    params = list(module.parameters())
    g = torch.randn_like(loss)
    grads = torch.autograd.grad(loss, [x, *params], g)

    split = dtype != torch.float32 or reduction == "none"
    assert graphs["forward"] == {"memkern.linear_cross_entropy_forward.default"}
    assert graphs["backward"] == ({"memkern.linear_cross_entropy_backward.default"} if split
                                  else set())
    size = x.element_size()
    divisor = 4 if reduction == "mean" else 0
    if split:
        kept = N * H * size + N * 8 + N * 4 + N * H * size + divisor
    else:
        kept = N * H * 4 + V * H * 4 + V * 4 * bias + divisor
    assert saved_bytes(compiled, x, t) == kept

    x64, *p64 = (v.detach().double().requires_grad_() for v in (x, *params))
    ref = F.cross_entropy(F.linear(x64, *p64), t, reduction=reduction, ignore_index=3)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert rel_err(loss, ref) < tol
    for a, r in zip(grads, torch.autograd.grad(ref, [x64, *p64], g.double())):
        assert rel_err(a, r) < tol
