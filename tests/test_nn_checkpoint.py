"""memkern.checkpoint(module, policy): same outputs and gradients as without it, and less kept
for backward — measured both as saved bytes (memkern.profile, which memkern.checkpoint reports
its kept tensors to) and as bytes still allocated after the forward (the CPU allocation trace,
independent of any hook).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memkern as mk
from compare import rel_err
from memkern.nn.checkpoint import policy_of
from memkern.profile import allocation_stats, saved_bytes


class Block(nn.Module):
    def __init__(self, d=64, p=0.0, memkern=True):
        super().__init__()
        self.ln = (mk.nn.LayerNorm if memkern else nn.LayerNorm)(d)
        self.mlp = (mk.nn.MLP(d, 4 * d, activation="gelu_tanh", recompute="none") if memkern else
                    nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"),
                                  nn.Linear(4 * d, d)))
        self.drop = (mk.nn.Dropout if memkern else nn.Dropout)(p)

    def forward(self, x):
        return x + self.drop(self.mlp(self.ln(x)))


def _grads(model, x, g):
    y = model(x)
    return [y, *torch.autograd.grad(y, [x, *model.parameters()], g)]


@pytest.mark.parametrize("policy", ["full", "selective", "offload"])
@pytest.mark.parametrize("memkern", [True, False], ids=["memkern", "torch"])
def test_policy_keeps_outputs_and_gradients(policy, memkern):
    ref = Block(memkern=memkern)
    m = copy.deepcopy(ref)
    with pytest.warns(RuntimeWarning, match="offload") if policy == "offload" else _nullcontext():
        assert mk.checkpoint(m, policy) is m
        x = torch.randn(3, 11, 64, requires_grad=True)
        g = torch.randn(3, 11, 64)
        got = _grads(m, x, g)
    want = _grads(ref, x, g)
    assert all(rel_err(a, b) < 1e-6 for a, b in zip(got, want))
    assert policy_of(m) == policy and list(m.state_dict()) == list(ref.state_dict())


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_dropout_mask_is_replayed_in_recompute():
    m = Block(p=0.5)
    mk.checkpoint(m, "full")
    ref = copy.deepcopy(m)
    mk.checkpoint(ref, None)
    x = torch.randn(4, 9, 64, requires_grad=True)
    g = torch.randn(4, 9, 64)
    torch.manual_seed(5)
    a = _grads(m, x, g)
    torch.manual_seed(5)
    b = _grads(ref, x, g)
    assert all(rel_err(u, v) < 1e-6 for u, v in zip(a, b))


def _kept(model, x):
    """Bytes still allocated after the forward (the output included, then subtracted)."""
    stats = allocation_stats(model, x)
    out = stats.result
    return stats.retained - out.untyped_storage().nbytes()


def test_policies_keep_less():
    torch.manual_seed(0)
    x = torch.randn(4, 64, 128, requires_grad=True)
    sizes, kept = {}, {}
    for policy in (None, "selective", "full"):
        m = mk.checkpoint(Block(128), policy)
        sizes[policy] = saved_bytes(m, x)
        kept[policy] = _kept(m, x)
    act = x.numel() * 4
    # no policy: x, ln stats, pre-activation (4x), activation (4x) -> ~9x the input
    assert kept[None] >= 8 * act and sizes[None] >= 8 * act
    # selective: the matmul outputs (pre-activation 4x and the output 1x) and the input
    assert sizes["selective"] <= 6.2 * act and kept["selective"] <= 6.2 * act
    assert sizes["selective"] < sizes[None] and kept["selective"] < kept[None]
    # full: the input only (already allocated before the forward: nothing new is kept)
    assert sizes["full"] == act
    assert kept["full"] <= 0.05 * act


def test_checkpoint_is_idempotent_and_removable():
    m = Block()
    forward = m.forward
    mk.checkpoint(m, "full")
    mk.checkpoint(m, "selective")
    assert policy_of(m) == "selective"
    mk.checkpoint(m, None)
    assert policy_of(m) is None and m.forward == forward
    with pytest.raises(ValueError, match="policy='everything'"):
        mk.checkpoint(m, "everything")


def test_no_grad_runs_plain_forward():
    m = mk.checkpoint(Block(), "full")
    with torch.no_grad():
        y = m(torch.randn(2, 3, 64))
    assert y.grad_fn is None


@pytest.mark.cuda
def test_offload_on_cuda_moves_saved_tensors_to_host():
    dev = torch.device("cuda")
    ref = Block(256).to(dev)
    m = mk.checkpoint(copy.deepcopy(ref), "offload", offload_min_bytes=0)
    x = torch.randn(8, 512, 256, device=dev, requires_grad=True)
    g = torch.randn_like(x)
    # Warm up both first: the first GEMMs of a process allocate cuBLAS/cuBLASLt workspaces
    # (33 MiB on an H100) that stay allocated. Measured without this, the offloaded forward,
    # which ran first, was charged 34603008 B = 32 MiB + 1 MiB of workspace on the first GPU run.
    for module in (ref, m):
        torch.autograd.grad(module(x), [x], g)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = m(x)
    torch.cuda.synchronize()
    kept_offload = torch.cuda.memory_allocated() - before - y.untyped_storage().nbytes()
    before = torch.cuda.memory_allocated()
    y_ref = ref(x)
    kept_ref = torch.cuda.memory_allocated() - before - y_ref.untyped_storage().nbytes()
    assert kept_offload < 0.2 * kept_ref
    a = [y, *torch.autograd.grad(y, [x, *m.parameters()], g)]
    b = [y_ref, *torch.autograd.grad(y_ref, [x, *ref.parameters()], g)]
    assert all(rel_err(u, v) < 1e-5 for u, v in zip(a, b))


def test_selective_policy_saves_matmul_outputs_only():
    """Inside a selectively checkpointed torch MLP the GEMM outputs are kept and GELU is
    recomputed: what is kept is the input plus the two GEMM outputs."""
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(32, 128), nn.Linear(128, 32)
    mlp = nn.Sequential(lin1, nn.GELU(), lin2)
    mk.checkpoint(mlp, "selective")
    x = torch.randn(16, 32, requires_grad=True)
    size = saved_bytes(mlp, x)
    assert size == (16 * 32 + 16 * 128 + 16 * 32) * 4
    y = mlp(x)
    y_ref = lin2(F.gelu(lin1(x)))
    assert rel_err(y, y_ref) < 1e-6
