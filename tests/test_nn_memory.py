"""The memory claims of memkern.nn, measured.

Saved bytes (memkern.profile.saved_bytes: storages saved for backward, each counted once,
parameters excluded): MLP(recompute="activation") <= 60% of nn.Sequential(Linear, GELU,
Linear); norms save no normalised output (nor does the Linear after them); Dropout saves no
mask; a GPT-2-style block of memkern modules <= 60% of the torch.nn block (<= 40% with
recompute="full"), and computes the same thing.

Linear cross-entropy at N=4096, V=32000, H=512 on the CPU: peak allocation (profiler trace)
<= 10% of the unfused ``F.cross_entropy(x @ W.T, t)``. Its time against torch's own
``F.linear_cross_entropy`` is a benchmark's job (``benchmarks/bench_modules.py``), not a test's.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memkern as mk
from compare import rel_err
from conftest import needs_layer_extension
from memkern.bench.block import GPT2Block
from memkern.profile import SavedTensorsRecorder, allocation_stats, saved_bytes


def test_saved_bytes_counts_each_storage_once_and_skips_parameters():
    x = torch.randn(64, 32, requires_grad=True)
    w = nn.Parameter(torch.randn(32, 32))
    # x is saved by both matmuls (once as a view); w is a parameter
    assert saved_bytes(lambda: (x @ w).sum() + (x.t() @ x).sum()) == x.numel() * 4
    assert saved_bytes(lambda: x @ w, include_parameters=True) == (x.numel() + w.numel()) * 4


@needs_layer_extension
@pytest.mark.parametrize("activation,torch_act", [("gelu", nn.GELU()),
                                                   ("gelu_tanh", nn.GELU(approximate="tanh")),
                                                   ("silu", nn.SiLU())])
def test_mlp_activation_saves_at_most_60_percent(activation, torch_act):
    ref = nn.Sequential(nn.Linear(96, 384), torch_act, nn.Linear(384, 96))
    x = torch.randn(4, 33, 96, requires_grad=True)
    base = saved_bytes(ref, x)
    ratios = {}
    for rc in ("none", "activation", "full"):
        m = mk.nn.MLP(96, 384, activation=activation, recompute=rc)
        ratios[rc] = saved_bytes(m, x) / base
    assert ratios["activation"] <= 0.60, ratios
    assert ratios["full"] <= 0.25, ratios
    assert abs(ratios["none"] - 1.0) < 0.01, ratios  # "none" keeps what torch keeps


@needs_layer_extension
def test_swiglu_saves_less_than_torch():
    m = mk.nn.SwiGLU(64, 160)
    x = torch.randn(3, 17, 64, requires_grad=True)

    def torch_swiglu(x):
        return F.linear(F.silu(F.linear(x, m.gate_proj.weight)) * F.linear(x, m.up_proj.weight),
                        m.down_proj.weight)

    base = saved_bytes(torch_swiglu, x)  # x, gate, silu(gate), up, h
    act = saved_bytes(m, x)  # x, gate, up
    m.recompute = "full"
    full = saved_bytes(m, x)  # x
    assert act <= 0.60 * base and full <= 0.15 * base, (act / base, full / base)


@needs_layer_extension
@pytest.mark.parametrize("name", ["MLP", "SwiGLU"])
@pytest.mark.parametrize("recompute", ["none", "activation", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_gemm_layers_under_autocast_save_the_cast_input(name, recompute, dtype):
    """Under autocast (bfloat16) the MLPs save x in bfloat16 — a copy for a float32 x, x itself
    for a bfloat16 one — and their bfloat16 intermediates, per recompute; never the weights'
    bfloat16 copies (made again in backward)."""
    x = torch.randn(3, 37, 64, dtype=dtype, requires_grad=True)
    m = (mk.nn.MLP(64, 160, recompute=recompute) if name == "MLP"
         else mk.nn.SwiGLU(64, 160, recompute=recompute))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with SavedTensorsRecorder() as rec:
            y = m(x)
    assert y.dtype == torch.bfloat16
    # [rows, hidden] intermediates: MLP pre (and h); SwiGLU gate, up (and h)
    intermediates = {"none": 2, "activation": 1, "full": 0}[recompute]
    if name == "SwiGLU" and recompute != "full":
        intermediates += 1
    rows, hidden = 3 * 37, 160
    assert rec.bytes == 2 * (x.numel() + intermediates * rows * hidden), rec.entries
    assert all(e.dtype == torch.bfloat16 for e in rec.entries.values())


@needs_layer_extension
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_norm_saves_input_and_row_statistics_only(norm):
    d = 257
    x = torch.randn(5, 31, d, requires_grad=True)
    m = mk.nn.LayerNorm(d) if norm == "layer" else mk.nn.RMSNorm(d)
    rows = 5 * 31
    stats = (2 if norm == "layer" else 1) * rows * 4
    with SavedTensorsRecorder() as rec:
        y = m(x)
    assert rec.bytes == x.numel() * 4 + stats
    # the input, and per-row statistics: [rows] (memkern op) or [..., 1] (torch's layer norm)
    assert all(e.shape == tuple(x.shape) or math.prod(e.shape) in (rows, 0)
               for e in rec.entries.values())
    del y


@needs_layer_extension
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_linear_after_a_norm_saves_no_normalised_output(norm):
    """Nor does the Linear consuming the normalised output: it rebuilds it in backward."""
    d = 257
    x = torch.randn(5, 31, d, requires_grad=True)
    m = mk.nn.LayerNorm(d) if norm == "layer" else mk.nn.RMSNorm(d)
    stats = (2 if norm == "layer" else 1) * 5 * 31 * 4
    lin = mk.nn.Linear(d, 7)
    chain = saved_bytes(lambda: lin(m(x)))
    assert chain == x.numel() * 4 + stats
    torch_chain = saved_bytes(
        lambda: nn.Linear(d, 7)((nn.LayerNorm(d) if norm == "layer" else nn.RMSNorm(d))(x)))
    assert torch_chain >= 2 * x.numel() * 4
    # and the rebuilt output gives the right gradients
    lin_t = nn.Linear(d, 7)
    lin_t.load_state_dict(lin.state_dict())
    ref_norm = nn.LayerNorm(d) if norm == "layer" else nn.RMSNorm(d)
    ref_norm.load_state_dict(m.state_dict())
    g = torch.randn(5, 31, 7)
    a = torch.autograd.grad(lin(m(x)), [x, *m.parameters(), *lin.parameters()], g)
    b = torch.autograd.grad(lin_t(ref_norm(x)), [x, *ref_norm.parameters(), *lin_t.parameters()], g)
    assert all(rel_err(u, v) < 1e-5 for u, v in zip(a, b))


def test_recompute_falls_back_when_the_norm_input_changed():
    m, lin = mk.nn.LayerNorm(16), mk.nn.Linear(16, 4)
    x = torch.randn(3, 16)
    h = x.clone().requires_grad_()
    base = h * 1.0
    y = m(base)
    base.add_(1.0)  # the norm's input changed after the norm ran: its output can't be rebuilt
    with SavedTensorsRecorder() as rec:
        out = lin(y)
    assert any(e.shape == (3, 16) for e in rec.entries.values())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()  # as torch: the norm saved the input that was then modified


@needs_layer_extension
def test_dropout_saves_no_mask():
    x = torch.randn(33, 129, requires_grad=True)
    with SavedTensorsRecorder() as rec:
        mk.nn.Dropout(0.3)(x)
    assert rec.bytes == 8, rec.entries  # the int64 seed
    assert saved_bytes(nn.Dropout(0.3), x) >= x.numel()  # torch keeps a mask


def _load_torch_into_memkern(t: GPT2Block, m: GPT2Block) -> None:
    sd = {k.replace("mlp.0.", "mlp.fc1.").replace("mlp.2.", "mlp.fc2."): v
          for k, v in t.state_dict().items()}
    m.load_state_dict(sd)


@needs_layer_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_gpt2_block_saved_bytes(dtype):
    x = torch.randn(2, 33, 256, dtype=dtype, requires_grad=True)
    base = saved_bytes(GPT2Block(256, 4, 0.1, memkern=False).to(dtype), x)
    act = saved_bytes(GPT2Block(256, 4, 0.1, memkern=True).to(dtype), x)
    full = saved_bytes(GPT2Block(256, 4, 0.1, memkern=True, recompute="full").to(dtype), x)
    assert act <= 0.60 * base, act / base
    assert full <= 0.40 * base, full / base


def test_gpt2_block_same_result_as_torch():
    t, m = GPT2Block(96, 4, 0.0, memkern=False), GPT2Block(96, 4, 0.0, memkern=True)
    _load_torch_into_memkern(t, m)
    x = torch.randn(3, 17, 96, requires_grad=True)
    y_t, y_m = t(x), m(x)
    assert rel_err(y_m, y_t) < 1e-5
    g = torch.randn_like(y_t)
    a = torch.autograd.grad(y_m, [x, *m.parameters()], g)
    b = torch.autograd.grad(y_t, [x, *t.parameters()], g)
    assert all(rel_err(u, v) < 1e-5 for u, v in zip(a, b))


# ----------------------------------------------------------------------------------------------
# linear cross-entropy at scale

N, V, H = 4096, 32000, 512


@pytest.fixture(scope="module")
def lce_inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, H, generator=gen).requires_grad_()
    w = (torch.randn(V, H, generator=gen) * 0.02).requires_grad_()
    t = torch.randint(0, V, (N,), generator=gen)
    return x, w, t


@pytest.mark.slow
@pytest.mark.skipif(not mk.compiled.has_cpu, reason=(
    "the 10% bound is the compiled kernels': the reference backend (no extension) keeps a few "
    "float32 temporaries of each [chunk, V] block, about half the logits' bytes at this size"))
def test_linear_cross_entropy_peak_memory_at_most_10_percent(lce_inputs):
    x, w, t = lce_inputs
    peaks = {}
    for name, fn in (("unfused", lambda: F.cross_entropy(x @ w.t(), t)),
                     ("memkern", lambda: mk.nn.functional.linear_cross_entropy(x, w, t))):
        x.grad = w.grad = None  # freed before the trace starts
        peaks[name] = allocation_stats(lambda fn=fn: fn().backward()).peak
        assert x.grad is not None and w.grad is not None
    logits_bytes = N * V * 4
    assert peaks["unfused"] >= 2 * logits_bytes  # the baseline does hold the logits
    assert peaks["memkern"] < logits_bytes / 2  # never a [tokens x vocab] tensor
    assert peaks["memkern"] <= 0.10 * peaks["unfused"], peaks
    print(f"peak MB: {({k: round(v / 2**20, 1) for k, v in peaks.items()})}, "
          f"ratio {peaks['memkern'] / peaks['unfused']:.3f}")
