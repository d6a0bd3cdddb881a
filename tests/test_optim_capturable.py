"""The window end of ShardedOptimizer can be captured in a CUDA graph (issue 12).

On the CPU: everything that decides capturability — no host reads (``item``/``bool`` of a
tensor), the same op sequence whatever the values (an overflowing or a clipped window runs the
very ops a plain one runs, so a replayed graph is right for all of them), and every tensor the
step reads or updates keeps its address from window to window. On CUDA (marked ``cuda``): the
window end captured with ``graphed_step()`` and replayed gives the eager ``step()``'s
parameters.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import memkern as mk

HOST_READS = {"_local_scalar_dense", "item", "is_nonzero", "equal"}


class _OpTrace(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def _model(device, dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.GELU(),
                               torch.nn.Linear(31, 7)).to(device, dtype)


def _window(opt, model, scale=1.0, poison=False, device="cpu"):
    for _ in range(opt.accumulation_steps):
        x = torch.randn(5, 13, device=device, dtype=next(model.parameters()).dtype)
        loss = model(x).float().square().mean() * scale
        opt.backward(loss)
    if poison:
        next(model.parameters()).grad.view(-1)[3] = math.inf


def _addresses(opt, model):
    bufs = [b.grads for b in opt.grad_buffer.buckets]
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return [t.data_ptr() for t in [*model.parameters(), *bufs, *state,
                                   opt.scaler.scale_tensor(bufs[0].device)]]


def test_window_end_reads_nothing_on_host_and_runs_one_op_sequence():
    model = _model("cpu")
    opt = mk.optim.ShardedOptimizer(model.parameters(), "adamw", lr=1e-3, accumulation_steps=2,
                                    loss_scale="dynamic", max_grad_norm=0.5)
    _window(opt, model)
    opt.step()  # first window: the optimizer state is created (allocations outside any graph)
    opt.zero_grad()
    addresses = _addresses(opt, model)
    traces, results = {}, {}
    for kind in ("plain", "overflow", "clipped", "plain again"):
        before = [p.detach().clone() for p in model.parameters()]
        skipped = opt.skipped_steps
        _window(opt, model, scale=1e4 if kind == "clipped" else 1.0, poison=kind == "overflow")
        with _OpTrace() as trace:
            result = opt.step()
        traces[kind], results[kind] = trace.ops, result
        changed = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert changed == (kind != "overflow"), kind
        assert opt.skipped_steps == skipped + (kind == "overflow"), kind
        if kind == "clipped":
            assert opt.grad_norm > 0.5  # the clip did something: the window is really different
        assert _addresses(opt, model) == addresses, f"{kind}: a step tensor moved"
        opt.zero_grad()
    assert not bool(results["overflow"]) and bool(results["plain"]) and bool(results["clipped"])
    for kind, ops in traces.items():
        assert not HOST_READS & {op.split("::")[-1] for op in ops}, (kind, ops)
        assert ops == traces["plain"], f"{kind} runs other ops than a plain window"


def test_graphed_step_refuses_what_it_cannot_capture():
    model = _model("cpu")
    opt = mk.optim.ShardedOptimizer(model.parameters(), "adamw", lr=1e-3)
    with pytest.raises(RuntimeError, match="CUDA graphs need CUDA tensors"):
        opt.graphed_step()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graphed_step_matches_eager_step_on_cuda():
    models = [_model("cuda", torch.bfloat16) for _ in range(2)]
    opts = [mk.optim.ShardedOptimizer(m.parameters(), "adamw", lr=1e-3, accumulation_steps=2,
                                      loss_scale="dynamic", max_grad_norm=0.5) for m in models]
    graphed = None
    for i, kind in enumerate(("plain", "plain", "overflow", "clipped", "plain")):
        seed = 1000 + i
        for m, opt in zip(models, opts):
            torch.manual_seed(seed)
            _window(opt, m, scale=1e4 if kind == "clipped" else 1.0, poison=kind == "overflow",
                    device="cuda")
        if i == 0:
            opts[1].step()  # eager first window on both: kernels compiled, state created
            opts[0].step()
        else:
            if graphed is None:
                graphed = opts[1].graphed_step()
            opts[0].step()
            graphed()
        for opt in opts:
            opt.zero_grad()
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(a, b), kind
    assert opts[0].skipped_steps == opts[1].skipped_steps == 1
    assert opts[0].loss_scale == opts[1].loss_scale
