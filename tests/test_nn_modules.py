"""memkern.nn modules against their torch counterparts: outputs and input/parameter gradients,
on odd shapes and fresh random data, in float32 (within 1e-5 relative) and bfloat16/float16
(within the documented tolerances below), plus each module's own contract (Linear accumulates
into an existing ``.grad`` without a transient dW; Dropout's backward mask is its forward mask).

Relative error = max |memkern - torch| / max |torch|, per tensor.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import memkern as mk
from compare import rel_err
from conftest import needs_layer_extension, runs_cpp_autograd
from memkern.profile import SavedTensorsRecorder

# Documented tolerances (relative to the largest magnitude of the tensor): float32 exact to
# 1e-5; 16-bit results may differ from torch's by the rounding of intermediates that memkern
# keeps in float32 (or torch does) — a few units of the format's last place.
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch."))
          for d in (torch.float32, torch.bfloat16, torch.float16)]
SHAPES = [pytest.param((7, 13), id="7x13"), pytest.param((1, 1023), id="1x1023"),
          pytest.param((2, 3, 37), id="2x3x37")]



def assert_same(mod_mk: nn.Module, mod_torch: nn.Module, *inputs: torch.Tensor, tol: float,
                grad_out: torch.Tensor | None = None) -> None:
    """Outputs and gradients (inputs that require grad, then parameters in order) agree."""
    y_mk = mod_mk(*inputs)
    y_t = mod_torch(*inputs)
    assert y_mk.dtype == y_t.dtype and y_mk.shape == y_t.shape
    assert rel_err(y_mk, y_t) <= tol, f"output: {rel_err(y_mk, y_t)}"
    g = torch.randn_like(y_t) if grad_out is None else grad_out
    xs = [t for t in inputs if t.requires_grad]
    p_mk, p_t = list(mod_mk.parameters()), list(mod_torch.parameters())
    r_mk = torch.autograd.grad(y_mk, xs + p_mk, g)
    r_t = torch.autograd.grad(y_t, xs + p_t, g)
    for i, (a, b) in enumerate(zip(r_mk, r_t)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert rel_err(a, b) <= tol, f"gradient {i}: {rel_err(a, b)}"


def _input(shape, dtype, scale=1.0):
    return (torch.randn(shape) * scale).to(dtype).requires_grad_()


# ----------------------------------------------------------------------------------------------
# Linear


@needs_layer_extension
def test_linear_runs_the_cpp_autograd():
    """Every call that memkern computes otherwise than torch's linear runs the C++ node: with
    ``.grad`` present (the training case), transposed, under autocast (in its dtype), 1-D;
    with none of these it is torch's own linear."""
    m = mk.nn.Linear(13, 7)
    assert m(torch.randn(3, 13)).grad_fn.name() == "AddmmBackward0"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(torch.randn(3, 13))
    assert y.grad_fn.name() == "memkern::LinearBackward" and y.dtype == torch.bfloat16
    assert mk.nn.Conv1D(7, 13)(torch.randn(3, 13)).grad_fn.name() == "memkern::LinearBackward"
    m.weight.grad = torch.zeros_like(m.weight)
    for x in (torch.randn(3, 13), torch.randn(13)):
        assert m(x).grad_fn.name() == "memkern::LinearBackward"


_DOUBLE_BACKWARD_LAYERS = {
    "linear": lambda: mk.nn.Linear(13, 7), "dropout": lambda: mk.nn.Dropout(0.25),
    "mlp": lambda: mk.nn.MLP(13, 17), "swiglu": lambda: mk.nn.SwiGLU(13, 17),
    "rms_norm": lambda: mk.nn.RMSNorm(13),
    # on a 16-bit CPU input LayerNorm runs memkern's op (float32: torch's own, which has a
    # double backward)
    "layer_norm-bf16": lambda: mk.nn.LayerNorm(13).to(torch.bfloat16)}


@needs_layer_extension
@pytest.mark.parametrize("layer", list(_DOUBLE_BACKWARD_LAYERS))
def test_cpp_autograd_refuses_double_backward(layer):
    """The C++ backwards' gradients are not differentiable (Linear's adds into ``.grad`` in
    place; memkern's backward kernels have no autograd): a backward that builds a graph is
    refused with a message, as ``once_differentiable`` refuses the second backward on the
    Python path — never a silently wrong second derivative."""
    m = _DOUBLE_BACKWARD_LAYERS[layer]()
    if layer == "linear":
        m.weight.grad = torch.zeros_like(m.weight)
    dtype = torch.bfloat16 if layer.endswith("bf16") else torch.float32
    x = torch.randn(3, 13, dtype=dtype, requires_grad=True)
    out = m(x)
    y = out.float().square().sum()
    if runs_cpp_autograd(out.grad_fn):
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.grad(y, x, create_graph=True)
    else:
        (gx,) = torch.autograd.grad(y, x, create_graph=True)
        with pytest.raises(RuntimeError):
            gx.sum().backward()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_torch(shape, dtype, bias):
    ref = nn.Linear(shape[-1], 11, bias=bias).to(dtype)
    m = mk.nn.Linear(shape[-1], 11, bias=bias).to(dtype)
    m.load_state_dict(ref.state_dict())
    assert_same(m, ref, _input(shape, dtype), tol=TOL[dtype])  # no .grad: F.linear
    m.weight.grad = torch.zeros_like(m.weight)  # memkern's own autograd (not accumulating here)
    assert_same(m, ref, _input(shape, dtype), tol=TOL[dtype])


def test_linear_unbatched_input_and_state_dict_keys():
    ref, m = nn.Linear(9, 5), mk.nn.Linear(9, 5)
    assert list(m.state_dict()) == list(ref.state_dict())
    m.load_state_dict(ref.state_dict())
    assert_same(m, ref, _input((9,), torch.float32), tol=1e-6)


def test_conv1d_matches_transposed_linear():
    m = mk.nn.Conv1D(11, 13)
    with torch.no_grad():
        m.bias.normal_()
    ref = nn.Linear(13, 11)
    with torch.no_grad():
        ref.weight.copy_(m.weight.t())
        ref.bias.copy_(m.bias)
    x = _input((7, 13), torch.float32)
    y, yr = m(x), ref(x)
    g = torch.randn_like(y)
    gx, gw, gb = torch.autograd.grad(y, (x, m.weight, m.bias), g)
    rx, rw, rb = torch.autograd.grad(yr, (x, ref.weight, ref.bias), g)
    assert rel_err(y, yr) < 1e-6 and rel_err(gx, rx) < 1e-6
    assert rel_err(gw, rw.t()) < 1e-6 and rel_err(gb, rb) < 1e-6


class _NewStorages(TorchDispatchMode):
    """Records every op output whose storage is at least ``nbytes`` and is not an input's."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.nbytes = nbytes
        self.big: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() >= self.nbytes
                    and t.untyped_storage().data_ptr() not in seen):
                self.big.append(str(func))
        return out


_GRAD_BUFFER_LAYERS = {
    "linear": lambda: mk.nn.Linear(301, 203), "conv1d": lambda: mk.nn.Conv1D(203, 301),
    "mlp": lambda: mk.nn.MLP(301, 203, recompute="activation"),
    "swiglu": lambda: mk.nn.SwiGLU(301, 203, recompute="full")}


@needs_layer_extension
@pytest.mark.parametrize("layer", list(_GRAD_BUFFER_LAYERS))
def test_weight_grad_accumulates_into_grad_buffer(layer):
    """With the front end's GradBuffer, weight-gradient GEMMs add into p.grad (beta = 1): no
    op creates a weight-sized tensor during backward, p.grad stays the buffer's view, the
    post-accumulate hooks fire once per backward, and the values are torch's."""
    m = _GRAD_BUFFER_LAYERS[layer]()
    ref = copy.deepcopy(m)
    buffer = mk.GradBuffer(list(m.parameters()))
    views = {id(p): p.grad for p in m.parameters()}
    assert all(v is not None for v in views.values())
    fired: list[int] = []
    for p in m.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(id(p)))
    smallest_weight = min(p.numel() * p.element_size() for p in m.parameters() if p.dim() == 2)
    for step in range(2):  # a second micro-batch accumulates on top of the first
        x = torch.randn(17, 301, requires_grad=True)
        y, yr = m(x), ref(x)
        g = torch.randn_like(y)
        spy = _NewStorages(smallest_weight)
        with spy:
            y.backward(g)
        yr.backward(g)
        assert spy.big == [], f"weight-sized tensors created in backward: {spy.big}"
        assert len(fired) == (step + 1) * len(views)
    for p, q in zip(m.parameters(), ref.parameters()):
        assert p.grad is views[id(p)], "p.grad must remain the GradBuffer's view"
        assert rel_err(p.grad, q.grad) < 1e-5
    buffer.zero_()
    assert all(float(p.grad.abs().max()) == 0 for p in m.parameters())


def test_linear_without_existing_grad_behaves_as_torch():
    """No .grad yet: the gradient is computed and handed to autograd as nn.Linear's is."""
    m, ref = mk.nn.Linear(13, 7), nn.Linear(13, 7)
    m.load_state_dict(ref.state_dict())
    x = torch.randn(5, 13)
    m(x).sum().backward()
    ref(x).sum().backward()
    assert rel_err(m.weight.grad, ref.weight.grad) < 1e-6
    m(x).sum().backward()  # now .grad exists: accumulated in place
    ref(x).sum().backward()
    assert rel_err(m.weight.grad, ref.weight.grad) < 1e-6


def test_linear_leaves_grad_alone_for_autograd_grad_and_inputs_subset():
    m = mk.nn.Linear(13, 7)
    m.weight.grad = torch.randn(7, 13)
    before = m.weight.grad.clone()
    x = torch.randn(5, 13, requires_grad=True)
    g = torch.randn(5, 7)
    (gw,) = torch.autograd.grad(m(x), [m.weight], g)
    assert torch.equal(m.weight.grad, before), "autograd.grad must not write .grad"
    assert rel_err(gw, g.t() @ x.detach()) < 1e-6
    m(x).backward(g, inputs=[x])
    assert torch.equal(m.weight.grad, before), "backward(inputs=[x]) must not touch weight.grad"
    assert rel_err(x.grad, g @ m.weight.detach()) < 1e-6


def test_linear_tensor_hooks_see_the_real_gradient():
    m = mk.nn.Linear(13, 7)
    m.weight.grad = torch.zeros(7, 13)
    seen = []
    m.weight.register_hook(lambda grad: seen.append(grad.clone()) or grad * 2)
    x, g = torch.randn(5, 13), torch.randn(5, 7)
    m(x).backward(g)
    assert rel_err(seen[0], g.t() @ x) < 1e-6
    assert rel_err(m.weight.grad, 2 * g.t() @ x) < 1e-6


@pytest.mark.parametrize("hook", ["node_post", "node_pre", "post_accumulate", "none"])
def test_accumulate_grad_node_runs_while_watched(hook):
    """Gradient added into an existing .grad in place: whatever watches the weight's
    AccumulateGrad node (a hook on it — DDP's reducer adds one — or a post-accumulate hook)
    still sees it run once per backward, a node hook with a gradient tensor (a zero: the
    real one is in .grad already); with nothing watching, the node may be passed over.
    .grad is right either way."""
    m = mk.nn.Linear(13, 7)
    m.weight.grad = torch.randn(7, 13)
    before = m.weight.grad.clone()
    node = torch.autograd.graph.get_gradient_edge(m.weight).node
    fired = []
    if hook == "node_post":
        node.register_hook(lambda grad_inputs, grad_outputs: fired.append(grad_outputs[0]))
    elif hook == "node_pre":
        node.register_prehook(lambda grad_outputs: fired.append(grad_outputs[0]))
    elif hook == "post_accumulate":
        m.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad))
    x, g = torch.randn(5, 13), torch.randn(5, 7)
    m(x).backward(g)
    assert len(fired) == (hook != "none")
    assert all(isinstance(t, torch.Tensor) for t in fired)
    assert rel_err(m.weight.grad, before + g.t() @ x) < 1e-6


def test_linear_under_autocast_matches_torch():
    ref, m = nn.Linear(13, 11), mk.nn.Linear(13, 11)
    m.load_state_dict(ref.state_dict())
    x = torch.randn(7, 13, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, yr = m(x), ref(x)
    assert y.dtype == yr.dtype == torch.bfloat16
    g = torch.randn_like(yr)
    a = torch.autograd.grad(y, (x, m.weight, m.bias), g)
    b = torch.autograd.grad(yr, (x, ref.weight, ref.bias), g)
    assert rel_err(y, yr) <= TOL[torch.bfloat16]
    for u, v in zip(a, b):
        assert u.dtype == v.dtype and rel_err(u, v) <= TOL[torch.bfloat16]


# ----------------------------------------------------------------------------------------------
# norms


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("affine", ["affine", "no_bias", "plain"])
def test_layer_norm_matches_torch(shape, dtype, affine):
    kw = dict(elementwise_affine=affine != "plain", bias=affine == "affine")
    ref = nn.LayerNorm(shape[-1], **kw).to(dtype)
    m = mk.nn.LayerNorm(shape[-1], **kw).to(dtype)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_()
    m.load_state_dict(ref.state_dict())
    assert_same(m, ref, _input(shape, dtype, 2.0), tol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("affine", [True, False])
def test_rms_norm_matches_torch(shape, dtype, affine):
    ref = nn.RMSNorm(shape[-1], eps=1e-6, elementwise_affine=affine).to(dtype)
    m = mk.nn.RMSNorm(shape[-1], eps=1e-6, elementwise_affine=affine).to(dtype)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_()
    m.load_state_dict(ref.state_dict())
    assert_same(m, ref, _input(shape, dtype, 2.0), tol=TOL[dtype])


def test_norms_over_several_dims_and_default_eps():
    for ref, m in ((nn.LayerNorm((3, 5)), mk.nn.LayerNorm((3, 5))),
                   (nn.RMSNorm((3, 5)), mk.nn.RMSNorm((3, 5)))):
        with torch.no_grad():
            for p in ref.parameters():
                p.normal_()
        m.load_state_dict(ref.state_dict())
        assert_same(m, ref, _input((4, 3, 5), torch.float32), tol=1e-5)


@needs_layer_extension
@pytest.mark.parametrize("autocast", [False, True])
def test_norms_run_the_cpp_autograd_and_stay_recomputable(autocast):
    """The routing, the op's (csrc/autograd/norm.h): RMSNorm and LayerNorm on 16-bit CPU input
    run the C++ node; float32 LayerNorm runs torch's own. Under autocast (bfloat16) the same,
    in the input's dtype. The output carries its recipe either way (a consuming Linear saves
    x, not the output), and so it does through ``torch.ops.memkern.norm_layer`` (no recipe:
    the op alone) and ``functional.layer_norm`` with a list or an int for the shape. Below
    autograd (inference mode) the op computes the same bits."""
    from memkern import _C
    cases = ((mk.nn.RMSNorm(13), torch.float32, "memkern::NormBackward"),
             (mk.nn.LayerNorm(13), torch.bfloat16, "memkern::NormBackward"),
             (mk.nn.LayerNorm(13), torch.float32, "NativeLayerNormBackward0"))
    for m, dtype, node in cases:
        m = m.to(dtype)
        x = _input((64, 13), dtype, 3.0)
        args = (m.weight, getattr(m, "bias", None), 1, m.eps or torch.finfo(dtype).eps,
                isinstance(m, mk.nn.RMSNorm))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = m(x)
            direct = mk.ops.norm_layer(x, *args)
            with torch.inference_mode():  # the op below autograd: the same bits
                below = mk.ops.norm_layer(x, *args)
        assert y.grad_fn.name() == direct.grad_fn.name() == node and y.dtype == dtype
        assert isinstance(getattr(y, _C.NORM_RECIPE_ATTR), _C.NormRecipe)
        assert not hasattr(direct, _C.NORM_RECIPE_ATTR)
        assert torch.equal(y, direct) and torch.equal(below, direct)
    for shape in ([13], 13):
        y = mk.nn.functional.layer_norm(_input((3, 13), torch.bfloat16), shape)
        assert isinstance(getattr(y, _C.NORM_RECIPE_ATTR), _C.NormRecipe)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_norms_match_float64_oracle(norm, dtype):
    """Against the formulas evaluated in float64 (not torch's layers), normalising the last two
    dimensions of an odd-sized input, with weight and bias."""
    shape, tol = (3, 5, 7), {torch.float32: 2e-6}.get(dtype, TOL[dtype])
    x64 = torch.randn(2, *shape, dtype=torch.float64) * 3 + 1
    w64 = torch.randn(shape[1:], dtype=torch.float64)
    b64 = torch.randn(shape[1:], dtype=torch.float64)
    if norm == "layer":
        m, eps = mk.nn.LayerNorm(shape[1:], eps=1e-4), 1e-4
    else:
        m, eps = mk.nn.RMSNorm(shape[1:], eps=1e-4), 1e-4
    m = m.to(dtype)
    with torch.no_grad():
        m.weight.copy_(w64)
        if norm == "layer":
            m.bias.copy_(b64)
    x = x64.to(dtype).requires_grad_()
    xr = x.detach().to(torch.float64).requires_grad_()
    w = m.weight.detach().to(torch.float64).requires_grad_()
    b = m.bias.detach().to(torch.float64).requires_grad_() if norm == "layer" else None
    dims = (-2, -1)
    if norm == "layer":
        centred = xr - xr.mean(dims, keepdim=True)
        ref = centred / torch.sqrt(centred.square().mean(dims, keepdim=True) + eps) * w + b
    else:
        ref = xr / torch.sqrt(xr.square().mean(dims, keepdim=True) + eps) * w
    y = m(x)
    g = torch.randn_like(ref)
    params = [w] + ([b] if b is not None else [])
    got = torch.autograd.grad(y, [x, *m.parameters()], g.to(dtype))
    want = torch.autograd.grad(ref, [xr, *params], g)
    assert rel_err(y, ref) <= tol
    for a, r in zip(got, want):
        assert a.dtype == dtype and rel_err(a, r) <= tol, rel_err(a, r)


# ----------------------------------------------------------------------------------------------
# Dropout


@needs_layer_extension
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_masks_forward_equal_backward(p, dtype):
    x = (torch.randn(3, 1025) + 5).to(dtype).requires_grad_()  # no zeros in x
    d = mk.nn.Dropout(p)
    y = d(x)
    g = (torch.rand_like(y, dtype=torch.float32) + 0.5).to(dtype)
    (gx,) = torch.autograd.grad(y, x, g)
    kept = y != 0
    assert torch.equal(kept, gx != 0), "the backward mask must be the forward mask"
    scale = 1.0 / (1.0 - p)
    cd = torch.float32
    assert torch.equal(y[kept], (x.detach()[kept].to(cd) * scale).to(dtype))
    assert torch.equal(gx[kept], (g[kept].to(cd) * scale).to(dtype))
    n = kept.numel()
    assert abs(kept.double().mean().item() - (1 - p)) < 4 * (p * (1 - p) / n) ** 0.5 + 1e-3
    y2 = d(x)
    assert not torch.equal(y2 != 0, kept), "each call draws a new mask"


def test_dropout_reproducible_from_manual_seed_and_eval_identity():
    d = mk.nn.Dropout(0.3)
    x = torch.randn(7, 13)
    torch.manual_seed(3)
    a = d(x)
    torch.manual_seed(3)
    assert torch.equal(a, d(x))
    d.eval()
    assert d(x) is x
    assert mk.nn.Dropout(0.0)(x) is x


@needs_layer_extension
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_mask_is_the_reference_mask_of_the_drawn_seed(p):
    """Under one RNG state the module draws one int64 seed in ``[0, 2**62)`` from the input's
    device generator (the documented draw, csrc/layer_constants.h), and its mask is the
    reference's Philox mask of that seed (an oracle apart from the C++ and Triton kernels); so
    checkpoint replays its runs."""
    from memkern.ops.dropout import reference
    x = torch.randn(3, 333) + 5
    torch.manual_seed(11)
    expected = reference(x, torch.randint(0, 1 << 62, (), dtype=torch.int64), p)
    torch.manual_seed(11)
    y = mk.nn.Dropout(p)(x.requires_grad_())
    assert y.grad_fn.name() == "memkern::DropoutBackward"
    assert torch.equal(y, expected)
    (gx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert torch.equal(gx != 0, expected != 0)


def test_dropout_inplace():
    x = torch.randn(5, 9, requires_grad=True)
    h = x * 1.0
    y = mk.nn.Dropout(0.5, inplace=True)(h)
    assert y is h
    y.sum().backward()
    assert torch.equal(x.grad != 0, y.detach() != 0)


# ----------------------------------------------------------------------------------------------
# MLP and SwiGLU


_ACTS = {"gelu": lambda: nn.GELU(), "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
         "relu": lambda: nn.ReLU(), "silu": lambda: nn.SiLU()}


def _torch_mlp(m: mk.nn.MLP) -> nn.Sequential:
    fc1, fc2 = m.fc1, m.fc2
    ref = nn.Sequential(nn.Linear(fc1.in_features, fc1.out_features, bias=fc1.bias is not None),
                        _ACTS[m.activation](),
                        nn.Linear(fc2.in_features, fc2.out_features, bias=fc2.bias is not None))
    ref = ref.to(fc1.weight.device, fc1.weight.dtype)
    ref[0].load_state_dict(fc1.state_dict())
    ref[2].load_state_dict(fc2.state_dict())
    return ref


@pytest.mark.parametrize("recompute", ["none", "activation", "full"])
@pytest.mark.parametrize("activation", list(_ACTS))
def test_mlp_matches_torch_fp32(activation, recompute):
    m = mk.nn.MLP(13, 29, 11, activation=activation, recompute=recompute)
    assert_same(m, _torch_mlp(m), _input((2, 7, 13), torch.float32), tol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES[1:])
@pytest.mark.parametrize("recompute", ["activation", "full"])
def test_mlp_matches_torch_low_precision(dtype, recompute):
    m = mk.nn.MLP(37, 61, activation="gelu_tanh", bias=True, recompute=recompute).to(dtype)
    assert_same(m, _torch_mlp(m), _input((9, 37), dtype), tol=TOL[dtype])


class _TorchSwiGLU(nn.Module):
    def __init__(self, m: mk.nn.SwiGLU) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (
            copy.deepcopy(m.gate_proj), copy.deepcopy(m.up_proj), copy.deepcopy(m.down_proj))
        for lin in (self.gate_proj, self.up_proj, self.down_proj):
            lin.__class__ = nn.Linear

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("recompute", ["none", "activation", "full"])
@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_matches_torch(recompute, dtype, bias):
    m = mk.nn.SwiGLU(13, 23, 11, bias=bias, recompute=recompute).to(dtype)
    assert_same(m, _TorchSwiGLU(m), _input((3, 5, 13), dtype), tol=TOL[dtype])


@needs_layer_extension
@pytest.mark.parametrize("name", ["MLP", "SwiGLU"])
def test_gemm_layers_run_the_cpp_autograd(name):
    """Every call runs the layer op's C++ node: one dtype, under autocast (in its dtype), a
    1-D input, GPT-2's transposed weights; a parameter in another dtype without autocast is
    refused with memkern's message."""
    m = mk.nn.MLP(13, 23) if name == "MLP" else mk.nn.SwiGLU(13, 23)
    backward = f"memkern::{name}Backward"
    for x in (torch.randn(3, 13), torch.randn(13)):
        assert m(x).grad_fn.name() == backward and m(x).shape == (*x.shape[:-1], 13)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(torch.randn(3, 13))
    assert y.grad_fn.name() == backward and y.dtype == torch.bfloat16
    if name == "MLP":
        y = mk.nn.functional.mlp(torch.randn(3, 13), m.fc1.weight.t(), m.fc1.bias,
                                 m.fc2.weight.t(), m.fc2.bias, transposed=True)
        assert y.grad_fn.name() == backward
    list(m.parameters())[-1].data = list(m.parameters())[-1].data.double()
    with pytest.raises(RuntimeError, match="a parameter has torch.float64"):  # memkern's message
        m(torch.randn(3, 13))


@pytest.mark.parametrize("name", ["MLP", "SwiGLU"])
def test_gemm_layers_under_autocast_match_torch(name):
    """Under autocast (bfloat16 on the CPU) the layer computes as torch's Linear layers do:
    in bfloat16, gradients in the parameters' and input's float32."""
    m = mk.nn.MLP(13, 29, 11, activation="gelu_tanh") if name == "MLP" else mk.nn.SwiGLU(13, 29, 11)
    ref = _torch_mlp(m) if name == "MLP" else _TorchSwiGLU(m)
    x = _input((2, 7, 13), torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, yr = m(x), ref(x)
    assert y.dtype == yr.dtype == torch.bfloat16
    g = torch.randn_like(yr)
    a = torch.autograd.grad(y, (x, *m.parameters()), g)
    b = torch.autograd.grad(yr, (x, *ref.parameters()), g)
    assert rel_err(y, yr) <= TOL[torch.bfloat16]
    for u, v in zip(a, b):
        assert u.dtype == v.dtype == torch.float32 and rel_err(u, v) <= TOL[torch.bfloat16]


def test_mlp_dropout_and_structure():
    m = mk.nn.MLP(16, 32, dropout=0.25)
    assert set(dict(m.named_children())) == {"fc1", "fc2", "dropout"}
    assert isinstance(m.fc1, mk.nn.Linear) and m.fc2.out_features == 16
    x = torch.randn(64, 16)
    y = m(x)
    with torch.no_grad():
        full = _torch_mlp(m)(x)
    kept = y != 0
    assert 0.6 < kept.double().mean().item() < 0.9
    assert rel_err(y[kept], full[kept] / 0.75) < 1e-5


@pytest.mark.parametrize("bad", [dict(activation="tanh"), dict(recompute="some")])
def test_mlp_rejects_bad_arguments(bad):
    with pytest.raises(ValueError, match=list(bad)[0]):
        mk.nn.MLP(4, 8, **bad)


def test_frozen_weights_only_input_grad():
    m = mk.nn.MLP(13, 17, recompute="full").requires_grad_(False)
    x = torch.randn(3, 13, requires_grad=True)
    ref = _torch_mlp(m)
    g = torch.randn(3, 13)
    (a,) = torch.autograd.grad(m(x), x, g)
    (b,) = torch.autograd.grad(ref(x), x, g)
    assert rel_err(a, b) < 1e-5


# ----------------------------------------------------------------------------------------------
# non-finite inputs propagate as in torch


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("name", ["Linear", "LayerNorm", "RMSNorm", "MLP", "SwiGLU"])
def test_nan_and_inf_propagate_like_torch(name, where):
    d = 13
    m = {"Linear": lambda: mk.nn.Linear(d, 7), "LayerNorm": lambda: mk.nn.LayerNorm(d),
         "RMSNorm": lambda: mk.nn.RMSNorm(d),
         "MLP": lambda: mk.nn.MLP(d, 17, activation="gelu_tanh"),
         "SwiGLU": lambda: mk.nn.SwiGLU(d, 17)}[name]()
    if name == "MLP":
        ref = _torch_mlp(m)
    elif name == "SwiGLU":
        ref = _TorchSwiGLU(m)
    else:
        ref = copy.deepcopy(m)
        ref.__class__ = type(m).__mro__[1]  # the torch class this memkern module derives from
    x = torch.randn(5, d)
    row = {"first": 0, "middle": 2, "last": 4}[where]
    x[row, row] = float("nan")
    x[(row + 1) % 5, d - 1 - row] = float("inf")
    x.requires_grad_()
    y, yr = m(x), ref(x)
    assert torch.equal(torch.isnan(y), torch.isnan(yr))
    assert torch.equal(torch.isinf(y), torch.isinf(yr))
    finite = torch.isfinite(yr)
    assert rel_err(y[finite], yr[finite]) <= 1e-5
    g = torch.randn_like(yr)
    (gx,) = torch.autograd.grad(y, x, g)
    (gr,) = torch.autograd.grad(yr, x, g)
    assert torch.equal(torch.isnan(gx), torch.isnan(gr))


# ----------------------------------------------------------------------------------------------
# the modules on the Triton backend (interpreted on the CPU) give the reference backend's result


@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
@pytest.mark.skipif(not mk.backend.runs_on("triton", torch.device("cpu")),
                    reason="no triton interpreter")
def test_linear_cross_entropy_on_triton_backend_matches_reference():
    """The one layer with a Python autograd (a forced backend reaches its kernel ops)."""
    m = mk.nn.LinearCrossEntropy(37, 301)
    x = torch.randn(3, 7, 37, requires_grad=True)
    args = (x, torch.randint(0, 301, (3, 7)))
    outs = {}
    g = torch.randn(())
    for b in ("reference", "triton"):
        torch.manual_seed(11)
        with mk.ops.force(b):
            y = m(*args)
            grads = torch.autograd.grad(y, [x, *m.parameters()], g)
        outs[b] = (y, *grads)
    for a, r in zip(outs["triton"], outs["reference"]):
        assert rel_err(a, r) < 1e-5


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_modules_on_cuda_match_torch(dtype):
    """The GPU path: Triton kernels compiled for real, GEMMs in cuBLAS (TF32 off)."""
    dev = torch.device("cuda")
    x = _input((4, 33, 129), dtype).detach().to(dev).requires_grad_()
    mlp = mk.nn.MLP(129, 257, activation="gelu_tanh").to(dev, dtype)
    assert_same(mlp, _torch_mlp(mlp), x, tol=TOL[dtype])
    sw = mk.nn.SwiGLU(129, 257).to(dev, dtype)
    assert_same(sw, _TorchSwiGLU(sw), x, tol=TOL[dtype])
    for m in (mk.nn.LayerNorm(129), mk.nn.RMSNorm(129)):
        m = m.to(dev, dtype)
        ref = copy.deepcopy(m)
        ref.__class__ = type(m).__mro__[1]
        assert_same(m, ref, x, tol=TOL[dtype])
    y = mk.nn.Dropout(0.2)(x)
    (gx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert torch.equal(y != 0, gx != 0)


# ----------------------------------------------------------------------------------------------
# a norm's output as a layer's input: the layer saves the norm's recipe (its input and
# parameters, which the norm saves anyway) instead of the output, and rebuilds it in backward


_EPS = 1e-2  # far from the modules' defaults, so that a rebuild with another eps shows


def _norm_case(name: str, d: int, dtype: torch.dtype):
    """(memkern norm, its float64 oracle, fresh random parameters), each called as
    ``f(x, *params)``; ``*_2d`` normalises the last two dimensions, ``(3, d)``."""
    shape = (3, d) if name.endswith("2d") else (d,)
    w = (torch.randn(shape) + 1).to(dtype).requires_grad_()
    if name.startswith("layer_norm"):
        return (lambda x, w, b: mk.nn.functional.layer_norm(x, shape, w, b, _EPS),
                lambda x, w, b: F.layer_norm(x, shape, w, b, _EPS),
                [w, torch.randn(shape).to(dtype).requires_grad_()])
    return (lambda x, w: mk.nn.functional.rms_norm(x, shape, w, _EPS),
            lambda x, w: F.rms_norm(x, shape, w, _EPS), [w])


_ORACLE_ACTS = {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
                "relu": F.relu, "silu": F.silu}


def _layer_case(name: str, d: int, dtype: torch.dtype):
    """(memkern layer, its oracle in plain torch ops, fresh random parameters, the name of its
    autograd Function), called as ``f(y, *params)``, for a GEMM layer on ``d`` features:
    ``linear``, ``conv1d``, ``mlp-<recompute>[-<activation>][-transposed]``,
    ``swiglu-<recompute>``."""
    def param(*shape):
        return (torch.randn(shape) / shape[-1] ** 0.5).to(dtype).requires_grad_()

    kind, *rest = name.split("-")
    if kind in ("linear", "conv1d"):
        t = kind == "conv1d"
        return (lambda y, w, b: mk.nn.functional.linear(y, w, b, transposed=t),
                lambda y, w, b: F.linear(y, w.t() if t else w, b),
                [param(d, 11) if t else param(11, d), param(11)], "Linear")
    if kind == "mlp":
        recompute, t = rest[0], "transposed" in rest
        act = next((a for a in rest[1:] if a in _ORACLE_ACTS), "gelu_tanh")

        def oracle(y, w1, b1, w2, b2):
            def lin(a, w, b):
                return F.linear(a, w.t() if t else w, b)
            return lin(_ORACLE_ACTS[act](lin(y, w1, b1)), w2, b2)
        return (lambda y, w1, b1, w2, b2: mk.nn.functional.mlp(
                    y, w1, b1, w2, b2, activation=act, recompute=recompute, transposed=t),
                oracle, [param(d, 29) if t else param(29, d), param(29),
                         param(29, 11) if t else param(11, 29), param(11)], "MLP")
    return (lambda y, wg, wu, wd, bu: mk.nn.functional.swiglu(y, wg, wu, wd, up_bias=bu,
                                                              recompute=rest[0]),
            lambda y, wg, wu, wd, bu: F.linear(F.silu(F.linear(y, wg)) * F.linear(y, wu, bu), wd),
            [param(23, d), param(23, d), param(11, 23), param(23)], "SwiGLU")


_LAYERS = ["linear", "conv1d", "mlp-none", "mlp-activation-gelu", "mlp-full", "mlp-full-relu",
           "mlp-activation-silu-transposed", "swiglu-none", "swiglu-activation", "swiglu-full"]
_NORMS = ["layer_norm", "rms_norm", "layer_norm_2d", "rms_norm_2d"]


def _saved_storages(fn, *args) -> tuple[torch.Tensor, set[int]]:
    """fn(*args) and the data pointers of the storages it saved for backward."""
    with SavedTensorsRecorder(include_parameters=True) as rec:
        out = fn(*args)
    return out, {key[1] for key in rec.entries}


def _leaves(tensors, dtype=None):
    return [t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]


@needs_layer_extension
@pytest.mark.parametrize("layer", _LAYERS)
@pytest.mark.parametrize("norm", _NORMS)
def test_layer_after_a_norm_saves_its_recipe_and_matches_float64(norm, layer):
    """norm -> layer in float64 on odd sizes against F.layer_norm/F.rms_norm + F.linear: the
    C++ node runs, the layer saves the norm's input but not its output,
    and every gradient — added into an existing .grad for half the layer's weights — is
    right."""
    x = torch.randn(2, 5, 3, 13, dtype=torch.float64, requires_grad=True)
    norm_fn, norm_oracle, norm_params = _norm_case(norm, 13, torch.float64)
    fn, oracle, params, function = _layer_case(layer, 13, torch.float64)
    earlier = [torch.randn_like(p) if i % 2 == 0 else None for i, p in enumerate(params)]
    for p, e in zip(params, earlier):
        p.grad = None if e is None else e.clone()
    y = norm_fn(x, *norm_params)
    out, saved = _saved_storages(fn, y, *params)
    assert out.grad_fn.name() == f"memkern::{function}Backward"
    assert y.untyped_storage().data_ptr() not in saved, "the normalised output was saved"
    assert x.untyped_storage().data_ptr() in saved
    g = torch.randn_like(out)
    out.backward(g)
    rx, rn, rp = _leaves([x]), _leaves(norm_params), _leaves(params)
    expected = oracle(norm_oracle(rx[0], *rn), *rp)
    expected.backward(g)
    assert rel_err(out, expected) < 1e-12
    for name, a, r, e in [("x", x, rx[0], None), *(("norm param", a, r, None) for a, r in
                                                 zip(norm_params, rn)),
                          *(("layer param", a, r, e) for a, r, e in zip(params, rp, earlier))]:
        want = r.grad if e is None else r.grad + e
        assert rel_err(a.grad, want) < 1e-10, name


@needs_layer_extension
@pytest.mark.parametrize("layer", ["linear", "mlp-activation", "mlp-full-transposed",
                                   "swiglu-none"])
@pytest.mark.parametrize("dtype", DTYPES[:2])
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm_2d"])
def test_layer_after_a_norm_under_autocast(norm, dtype, layer):
    """Norm and layer both under autocast (bfloat16): on a bfloat16 input the layer saves
    the norm's input (the norm's output is of the compute dtype and rebuilt in backward); on a
    float32 one, the bfloat16 copy it computes with. Gradients against float64 torch."""
    x = torch.randn(4, 3, 13).to(dtype).requires_grad_()
    norm_fn, norm_oracle, norm_params = _norm_case(norm, 13, dtype)
    fn, oracle, params, function = _layer_case(layer, 13, dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm_fn(x, *norm_params)
        out, saved = _saved_storages(fn, y, *params)
    assert out.grad_fn.name() == f"memkern::{function}Backward" and out.dtype == torch.bfloat16
    assert y.untyped_storage().data_ptr() not in saved
    assert (x.untyped_storage().data_ptr() in saved) == (dtype == torch.bfloat16)
    g = torch.randn(out.shape)
    out.backward(g.to(out.dtype))
    rx, rn, rp = _leaves([x], torch.float64), _leaves(norm_params, torch.float64), \
        _leaves(params, torch.float64)
    expected = oracle(norm_oracle(rx[0], *rn), *rp)
    expected.backward(g.double())
    assert rel_err(out, expected) < TOL[torch.bfloat16]
    for a, r in zip([x, *norm_params, *params], [*rx, *rn, *rp]):
        assert a.grad.dtype == dtype and rel_err(a.grad, r.grad) < TOL[torch.bfloat16]


_STALE_LAYERS = ["linear", "mlp-activation", "mlp-full-transposed", "swiglu-full"]


@needs_layer_extension
@pytest.mark.parametrize("layer", _STALE_LAYERS)
@pytest.mark.parametrize("changed", ["norm_input", "norm_output"])
def test_stale_recipe_makes_the_layer_save_its_input(changed, layer):
    """The norm's input (or its output) modified in place between the norm and the layer: the
    output can no longer be rebuilt from the norm's tensors, so the layer saves it itself and
    its gradients are those of the values it was given."""
    base = torch.randn(5, 13, dtype=torch.float64)
    norm_fn, _, norm_params = _norm_case("layer_norm", 13, torch.float64)
    fn, oracle, params, _ = _layer_case(layer, 13, torch.float64)
    y = norm_fn(base, *norm_params)
    if changed == "norm_input":
        base.mul_(2.0)
    else:
        y.mul_(1.5)
    given = y.detach().clone()
    out, saved = _saved_storages(fn, y, *params)
    assert y.untyped_storage().data_ptr() in saved
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, params, g)  # the layer's: the norm's would see base changed
    ref = _leaves(params)
    want = torch.autograd.grad(oracle(given, *ref), ref, g)
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-10


@needs_layer_extension
@pytest.mark.parametrize("layer", _STALE_LAYERS)
def test_norm_input_modified_after_the_layer_ran_raises_as_torch(layer):
    """The norm's input modified in place between forward and backward: rebuilding the
    output from it would be wrong, and the layer's backward raises autograd's error (as it
    would for any saved tensor modified in place), even when only the layer's own weight
    gradients are asked for."""
    base = torch.randn(5, 13, dtype=torch.float64)
    norm_fn, _, norm_params = _norm_case("rms_norm", 13, torch.float64)
    fn, _, params, _ = _layer_case(layer, 13, torch.float64)
    out = fn(norm_fn(base, *norm_params), *params)
    base.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out, params, torch.randn_like(out))
