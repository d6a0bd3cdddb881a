"""memkern.nn.functional.linear_log_probs: per-token log-probabilities with the entropy,
is-top-1 and the mean logit, against plain torch over the whole logits in float64 (log_softmax
at the target, -sum softmax * log_softmax, argmax, mean), forward and gradients (of
``g1 * log_probs + g2 * entropy``, g1 and g2 random per token), at >= 3 chunks of tokens and
>= 3 blocks of classes (the last ones short), with a tie for the maximum, ignored tokens and
soft-capping; what the node keeps for backward; the torch path without the extension.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import memkern as mk
from compare import rel_err
from conftest import needs_layer_extension
from memkern.nn import linear_log_probs as log_probs_module
from memkern.nn.functional import linear_cross_entropy, linear_log_probs

N, H, V = 37, 9, 67
CHUNK, BLOCK = 8, 16  # 5 chunks of tokens (the last of 5), 5 blocks of classes (the last of 3)
TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 3e-2}
"""Against float64: float32 math on the inputs (the logits a float32 GEMM's); bfloat16
inputs' logits are rounded to bfloat16 by their GEMM, as in any bfloat16 LM head."""


def _data(dtype, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, dtype=torch.float64, generator=gen)
    w = torch.randn(V, H, dtype=torch.float64, generator=gen)
    b = torch.randn(V, dtype=torch.float64, generator=gen) if bias else None
    t = torch.randint(0, V, (N,), generator=gen)
    # classes 20 and 60 tie, exactly (small integers: any order of the GEMM's sums), as the
    # maximum of two tokens in later chunks: the target at the first (top-1) and the second
    w[20] = w[60] = torch.randint(-2, 3, (H,), generator=gen).double()
    w[20, 0] = w[60, 0] = 3.0
    if b is not None:
        b[20] = b[60] = 0.5
    x[27] = x[33] = w[20]
    t[27], t[33] = 20, 60
    t[[4, 30]] = -100
    leaves = [a.to(dtype).requires_grad_() for a in (x, w) + ((b,) if bias else ())]
    return leaves[0], leaves[1], leaves[2] if bias else None, t


def _oracle(x, w, b, t, cap):
    """Float64 over the whole logits: log-probabilities, entropy, is-top-1, mean (0 at ignored
    tokens), from the very (rounded) inputs."""
    z = F.linear(x.double(), w.double(), None if b is None else b.double())
    if cap:
        z = cap * torch.tanh(z / cap)
    valid = t != -100
    logp = torch.log_softmax(z, 1)
    lp = torch.where(valid, logp.gather(1, t.clamp(min=0)[:, None])[:, 0], 0.0)
    entropy = torch.where(valid, -(torch.softmax(z, 1) * logp).sum(1), 0.0)
    return lp, entropy, valid & (z.argmax(1) == t), torch.where(valid, z.mean(1), 0.0)


def _grads(outputs, g1, g2, leaves):
    """Gradients of g1 * log_probs + g2 * entropy (either factor None: that output unused)."""
    total = sum((g * o).sum() for g, o in zip((g1, g2), outputs[:2]) if g is not None)
    return torch.autograd.grad(total, leaves)


@needs_layer_extension
@pytest.mark.parametrize("uses", ["both", "log_probs", "entropy"])
@pytest.mark.parametrize("cap", [0.0, 6.0], ids=["nocap", "softcap"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16],
                         ids=["float64", "float32", "bfloat16"])
def test_outputs_and_gradients_match_float64(dtype, cap, uses):
    """Every output against float64, and the gradients of x, weight and bias where the loss
    uses both outputs (each block of classes weighted for both), the log-probabilities alone
    (the forward's input gradient, the entropy asked but not differentiated) or the entropy
    alone."""
    x, w, b, t = _data(dtype)
    got = linear_log_probs(x, w, t, b, entropy=True, is_top1=True, mean_logits=True,
                           softcap=cap or None, chunk_size=CHUNK, vocab_block=BLOCK)
    want = _oracle(x, w, b, t, cap)
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    assert got.log_probs.dtype == got.entropy.dtype == got.mean_logits.dtype == cd
    assert got.is_top1.dtype == torch.bool and not got.mean_logits.requires_grad
    assert rel_err(got.log_probs, want[0]) < TOL[dtype]
    assert rel_err(got.entropy, want[1]) < TOL[dtype]
    assert rel_err(got.mean_logits, want[3]) < TOL[dtype]
    if dtype != torch.bfloat16:  # bfloat16 logits may tie where float64's do not
        assert torch.equal(got.is_top1, want[2])
    assert got.is_top1[27] and not got.is_top1[33]
    for out in got:
        assert out[[4, 30]].eq(0).all()
    gen = torch.Generator().manual_seed(1)
    g1, g2 = (torch.randn(N, dtype=torch.float64, generator=gen) for _ in range(2))
    g1, g2 = (None if uses == "entropy" else g1), (None if uses == "log_probs" else g2)
    leaves = (x, w, b)
    want_grads = _grads(_oracle_with_grad(leaves, t, cap), g1, g2, [a for a in leaves])
    for g, ref in zip(_grads(got, g1, g2, leaves), want_grads):
        assert rel_err(g, ref) < TOL[dtype]


def _oracle_with_grad(leaves, t, cap):
    """_oracle's two differentiable outputs on float64 copies wired to ``leaves``' grads."""
    x, w, b = (a.double() for a in leaves)
    return _oracle(x, w, b, t, cap)[:2]


@needs_layer_extension
def test_log_probs_are_the_negated_linear_cross_entropy():
    """Without statistics, the same loops as linear_cross_entropy(reduction="none"): the same
    bits, negated, and the same gradients."""
    x, w, b, t = _data(torch.float32)
    got = linear_log_probs(x, w, t, b, chunk_size=CHUNK, vocab_block=BLOCK)
    assert got.entropy is None and got.is_top1 is None and got.mean_logits is None
    loss = linear_cross_entropy(x, w, t, b, reduction="none", chunk_size=CHUNK,
                                vocab_block=BLOCK)
    assert torch.equal(got.log_probs, -loss)
    g = torch.randn(N)
    mine = torch.autograd.grad((g * got.log_probs).sum(), (x, w, b))
    theirs = torch.autograd.grad((-g * loss).sum(), (x, w, b))
    for a, c in zip(mine, theirs):
        assert torch.equal(a, c)


@needs_layer_extension
def test_what_the_node_keeps():
    """Saved for backward, beside the inputs: the forward's input gradient [N, H], the
    targets, the log-sum-exp and the entropy [N]; never a [tokens, classes] tensor."""
    x, w, b, t = _data(torch.float32)
    inputs = {a.data_ptr() for a in (x, w, b, t)}
    kept = []

    def pack(tensor):
        if tensor.data_ptr() not in inputs:
            kept.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = linear_log_probs(x, w, t, b, entropy=True, is_top1=True, chunk_size=CHUNK,
                               vocab_block=BLOCK)
    assert sorted(kept) == sorted([N * H * 4, N * 4, N * 4])
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert x.grad is not None and w.grad is not None and b.grad is not None


def test_without_the_extension_it_is_torch(monkeypatch):
    """The torch path (no compiled extension): the same outputs and gradients."""
    monkeypatch.setattr(log_probs_module, "compiled", type("NoExtension", (), {"has_cpu": False}))
    x, w, b, t = _data(torch.float64)
    got = linear_log_probs(x, w, t, b, entropy=True, is_top1=True, mean_logits=True)
    want = _oracle(x, w, b, t, 0.0)
    for a, c in zip(got, want):
        assert rel_err(a.double(), c.double()) < 1e-12
    g1, g2 = torch.randn(N, dtype=torch.float64), torch.randn(N, dtype=torch.float64)
    for a, c in zip(_grads(got, g1, g2, (x, w, b)),
                    _grads(_oracle_with_grad((x, w, b), t, 0.0), g1, g2, (x, w, b))):
        assert rel_err(a, c) < 1e-12


def _call(x_shape, w_shape, t_len, **kwargs):
    return lambda: linear_log_probs(torch.randn(*x_shape), torch.randn(*w_shape),
                                    torch.zeros(t_len, dtype=torch.int64), **kwargs)


@pytest.mark.parametrize("call,match", [
    (_call((3, 4), (5, 6), 3), r"linear_log_probs: input \(3, 4\) must end with the weight's "
                               "in_features"),
    (_call((3, 4), (5, 4), 2), r"linear_log_probs: target has shape \(2,\)"),
    (_call((3, 4), (5, 4), 3, softcap=-1.0), "softcap=-1.0"),
])
def test_errors_name_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_exported():
    assert mk.nn.functional.linear_log_probs is linear_log_probs
