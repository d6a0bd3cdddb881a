"""GradBuffer: p.grad are views of one flat buffer per dtype, through backward and zeroing."""
import copy
import io

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import memkern as mk
from memkern.optim.grad_buffer import ALIGN


def make_model(dtype=torch.float32):
    # Odd sizes everywhere: 1, 7, 13, 1023 elements never fill an alignment slot.
    model = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1))
    model.extra = torch.nn.Parameter(torch.randn(1023))
    return model.to(dtype)


def loss_of(model, x):
    return model(x).pow(2).mean() + (model.extra * x.sum()).pow(2).mean()


def reference_grads(model, xs):
    """Gradients of sum(loss(x) for x in xs) on an independent copy of ``model``."""
    twin = copy.deepcopy(model)
    twin.zero_grad()
    for x in xs:
        loss_of(twin, x).backward()
    return [p.grad for p in twin.parameters()]


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_grads_are_views_through_backward_and_zero():
    model = make_model()
    params = list(model.parameters())
    buf = mk.GradBuffer(params)
    (bucket,) = buf.buckets
    views = [p.grad for p in params]
    flat = bucket.grads
    for p, view in zip(params, views):
        assert view._base is flat and view.shape == p.shape

    xs = [torch.randn(5, 13) for _ in range(3)]
    for x in xs[:2]:
        loss_of(model, x).backward()
    for p, view, want in zip(params, views, reference_grads(model, xs[:2])):
        assert p.grad is view  # autograd accumulated in place, into the buffer
        torch.testing.assert_close(view, want)

    buf.zero_()
    assert all(p.grad is view for p, view in zip(params, views))
    assert torch.count_nonzero(flat) == 0
    loss_of(model, xs[2]).backward()
    for p, view, want in zip(params, views, reference_grads(model, xs[2:])):
        assert p.grad is view
        torch.testing.assert_close(view, want)


def test_zero_is_one_fill_per_dtype():
    model = make_model()
    model[0].to(torch.bfloat16)
    buf = mk.GradBuffer(model.parameters())
    assert sorted(str(b.dtype) for b in buf.buckets) == ["torch.bfloat16", "torch.float32"]
    for b in buf.buckets:
        b.grads.normal_()
    with OpLog() as log:
        buf.zero_()
    assert len(log.ops) == 2, log.ops
    assert all(torch.count_nonzero(b.grads) == 0 for b in buf.buckets)


def test_alignment_padding_is_invisible():
    model = make_model()
    params = list(model.parameters())
    buf = mk.GradBuffer(params)
    (bucket,) = buf.buckets
    assert buf.numel == sum(p.numel() for p in params) < bucket.numel
    for p, offset in zip(params, bucket.offsets):
        assert offset % ALIGN == 0
        assert (p.grad.data_ptr() - bucket.grads.data_ptr()) % 128 == 0
        assert p.grad.data_ptr() % 64 == 0  # torch allocates buffers at least 64-byte aligned
    for _ in range(2):
        loss_of(model, torch.randn(3, 13)).backward()
    padding = torch.ones(bucket.numel, dtype=torch.bool)
    for p, offset in zip(params, bucket.offsets):
        padding[offset:offset + p.numel()] = False
    assert torch.count_nonzero(bucket.grads[padding]) == 0
    grads = torch.cat([p.grad.flatten() for p in params])
    torch.testing.assert_close(torch.linalg.vector_norm(bucket.grads),
                               torch.linalg.vector_norm(grads))


def test_flat_params_keep_values_and_grad_views():
    model = make_model()
    before = copy.deepcopy(model)
    params = list(model.parameters())
    ids = [id(p) for p in params]
    buf = mk.GradBuffer(params)
    (weights,) = buf.flat_params()
    assert [id(p) for p in model.parameters()] == ids
    for p, q, offset in zip(params, before.parameters(), buf.buckets[0].offsets):
        assert p.data_ptr() == weights[offset:].data_ptr()
        assert torch.equal(p, q) and p.requires_grad
    x = torch.randn(4, 13)
    loss_of(model, x).backward()
    for p, want in zip(params, reference_grads(before, [x])):
        assert p.grad._base is buf.buckets[0].grads
        torch.testing.assert_close(p.grad, want)


def test_other_grad_dtype_accumulates_through_hooks():
    """bfloat16 weights, float32 gradient buffer: p.grad stays None, the buffer holds the sum
    of the bfloat16 gradients accumulated in float32."""
    model = make_model(torch.bfloat16)
    params = list(model.parameters())
    buf = mk.GradBuffer(params, dtype=torch.float32)
    xs = [torch.randn(6, 13, dtype=torch.bfloat16) for _ in range(3)]
    want = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    twin = copy.deepcopy(model)
    for x in xs:
        loss_of(model, x).backward()
        for w, g in zip(want, torch.autograd.grad(loss_of(twin, x), list(twin.parameters()))):
            w.add_(g)
    for p, w in zip(params, want):
        assert p.grad is None
        assert buf.grad(p).dtype == torch.float32
        torch.testing.assert_close(buf.grad(p), w)


def test_claim_grads_undoes_model_zero_grad():
    model = make_model()
    params = list(model.parameters())
    buf = mk.GradBuffer(params)
    views = [p.grad for p in params]
    loss_of(model, torch.randn(3, 13)).backward()
    model.zero_grad()  # sets .grad to None: the next backward allocates outside the buffer
    x = torch.randn(3, 13)
    loss_of(model, x).backward()
    assert all(p.grad is not v for p, v in zip(params, views))
    with pytest.warns(RuntimeWarning, match="zero_grad"):
        buf.claim_grads()
    for p, view, want in zip(params, views, reference_grads(model, [x])):
        assert p.grad is view
        torch.testing.assert_close(view, want)


def test_newer_buffer_takes_parameters_over():
    model = make_model()
    old = mk.GradBuffer(model.parameters())
    new = mk.GradBuffer(model.parameters())
    assert all(p.grad._base is new.buckets[0].grads for p in model.parameters())
    new.zero_()
    with pytest.raises(RuntimeError, match="took over"):
        old.zero_()
    torch.save(model, io.BytesIO())  # the ownership records leave the model picklable


@pytest.mark.parametrize("case, error, match", [
    ("empty", ValueError, "params is empty"),
    ("frozen", ValueError, r"params\[1\].*does not require grad"),
    ("twice", ValueError, r"params\[2\].*same tensor as params\[0\]"),
    ("devices", ValueError, r"params\[1\].*meta.*one device"),
    ("integer", TypeError, r"params\[0\].*integer"),
    ("float64", TypeError, r"params\[0\].*float64"),
    ("sparse", ValueError, r"params\[0\].*sparse"),
    ("non_leaf", ValueError, r"params\[0\].*not a leaf"),
    ("dtype", TypeError, r"dtype=torch.float64"),
])
def test_bad_input_is_named(case, error, match):
    w = torch.nn.Parameter(torch.randn(3))
    kwargs = {}
    if case == "empty":
        params = []
    elif case == "frozen":
        params = [w, torch.nn.Parameter(torch.randn(2), requires_grad=False)]
    elif case == "twice":
        params = [w, torch.nn.Parameter(torch.randn(2)), w]
    elif case == "devices":
        params = [w, torch.nn.Parameter(torch.randn(2, device="meta"))]
    elif case == "integer":
        params = [torch.zeros(3, dtype=torch.int64)]
    elif case == "float64":
        params = [torch.nn.Parameter(torch.randn(3, dtype=torch.float64))]
    elif case == "sparse":
        emb = torch.nn.Embedding(10, 3, sparse=True)
        emb(torch.tensor([1, 2])).sum().backward()
        params = [emb.weight]
    elif case == "non_leaf":
        params = [w * 2]
    else:
        params, kwargs = [w], {"dtype": torch.float64}
    with pytest.raises(error, match=match):
        mk.GradBuffer(params, **kwargs)


def test_sparse_gradient_arriving_later_is_an_error():
    emb = torch.nn.Embedding(10, 3, sparse=True)
    buf = mk.GradBuffer(emb.parameters())
    emb.zero_grad()  # .grad = None: the next backward stores a sparse gradient
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="sparse gradient"):
        buf.claim_grads()
