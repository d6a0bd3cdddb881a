"""A plain ``loss.backward()`` next to ShardedOptimizer: the gradients land in the flat buffer
(they are views of it), but they are neither loss-scaled nor counted in the window, so
``step()`` refuses them with one clear error instead of skipping or stepping wrong."""
import pytest
import torch

import memkern as mk


def _model(dtype=torch.float32):
    return torch.nn.Sequential(torch.nn.Linear(11, 29), torch.nn.Tanh(),
                               torch.nn.Linear(29, 3)).to(dtype)


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)


@pytest.mark.parametrize("settings", [
    dict(),
    dict(accumulation_steps=3),
    dict(loss_scale="dynamic", grad_dtype=torch.float32, dtype=torch.bfloat16),
], ids=["plain", "accumulating", "bf16-scaled-fp32-grads"])
def test_plain_backward_is_refused_at_step(settings):
    settings = dict(settings)
    model = _model(settings.pop("dtype", torch.float32))
    opt = mk.optim.ShardedOptimizer(model.parameters(), "adamw", lr=1e-2, **settings)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(7, 11), torch.randn(7, 3)
    _loss(model, x, y).backward()
    with pytest.raises(RuntimeError, match=r"did not go through ShardedOptimizer\.backward.*"
                                           r"Call opt\.backward\(loss\)"):
        opt.step()
    with pytest.raises(RuntimeError, match="did not go through"):
        opt.step(force=True)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_plain_backward_gradient_is_in_the_flat_buffer():
    """What loss.backward() produced is torch's gradient, in the buffer's views."""
    model = _model()
    reference = _model()
    reference.load_state_dict(model.state_dict())
    opt = mk.optim.ShardedOptimizer(model.parameters(), "adamw", lr=1e-2)
    x, y = torch.randn(9, 11), torch.randn(9, 3)
    _loss(model, x, y).backward()
    _loss(reference, x, y).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad.data_ptr() == opt.grad_buffer.grad(p).data_ptr()
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


def test_zero_grad_clears_the_stray_gradients_and_training_goes_on():
    """After the error, zero_grad() + opt.backward() trains exactly like torch.optim.AdamW."""
    model = _model()
    reference = _model()
    reference.load_state_dict(model.state_dict())
    opt = mk.optim.ShardedOptimizer(model.parameters(), "adamw", lr=1e-2, weight_decay=0.1)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    _loss(model, torch.randn(5, 11), torch.randn(5, 3)).backward()
    with pytest.raises(RuntimeError):
        opt.step()
    opt.zero_grad()
    for _ in range(3):
        x, y = torch.randn(13, 11), torch.randn(13, 3)
        opt.backward(_loss(model, x, y))
        assert opt.step()
        opt.zero_grad()
        _loss(reference, x, y).backward()
        torch_opt.step()
        torch_opt.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_stray_backward_inside_an_open_window_is_refused():
    """One opt.backward() then one plain backward in the same window: the window's last step
    must not silently take the unscaled, uncounted gradient."""
    model = _model()
    opt = mk.optim.ShardedOptimizer(model.parameters(), "sgd", lr=0.1, accumulation_steps=2)
    x, y = torch.randn(6, 11), torch.randn(6, 3)
    opt.backward(_loss(model, x, y))
    _loss(model, x, y).backward()
    opt.zero_grad()  # a no-op inside the open window: the stray gradient is still there
    with pytest.raises(RuntimeError, match="did not go through"):
        opt.step(force=True)
