"""``torch.nn.utils.prune`` on memkern's layers with memkern's optimizers: unstructured and
structured pruning, applied before or after ``memkern.patch``, trained with
``ShardedOptimizer`` (accumulation, clipping) and ``FusedAdamW``, then ``prune.remove``.

Oracle: torch: the unpatched model pruned the same way, trained by ``torch.optim.AdamW`` (with
``loss / 2`` accumulation and ``clip_grad_norm_`` where the memkern optimizer accumulates and
clips); by hand: a pruned entry's effective weight is exactly zero and its gradient exactly
zero (the mask multiplies both). Every step runs with Python warnings as errors and the C++
side's stderr captured: pruning must print nothing.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import prune

import memkern
from compare import params_rel_err

STEPS, WINDOW = 6, 2


def make_model() -> nn.Sequential:
    """A norm, an MLP block memkern fuses when unpruned, and a head: odd sizes."""
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(13),
                         nn.Sequential(nn.Linear(13, 33), nn.GELU(), nn.Linear(33, 13)),
                         nn.Linear(13, 5))


def pruned_layers(model: nn.Sequential) -> list[nn.Linear]:
    return [model[1][0], model[1][2], model[2]]


def apply_pruning(model: nn.Sequential, kind: str) -> None:
    fc1, fc2, head = pruned_layers(model)
    if kind == "unstructured":
        prune.l1_unstructured(fc1, "weight", amount=0.4)
        prune.random_unstructured(head, "weight", amount=0.3)
    else:  # whole output rows of fc1 (a hidden unit) and input columns of fc2
        prune.ln_structured(fc1, "weight", amount=0.3, n=2, dim=0)
        prune.ln_structured(fc2, "weight", amount=0.3, n=1, dim=1)
    prune.l1_unstructured(fc2, "bias", amount=0.5)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(7, 13, generator=g), torch.randint(0, 5, (7,), generator=g))
            for _ in range(STEPS * WINDOW)]


def masks(model: nn.Sequential) -> dict[str, torch.Tensor]:
    return {name: buf for name, buf in model.named_buffers() if name.endswith("_mask")}


def torch_run(kind: str, clip: float | None) -> tuple[nn.Sequential, list[float]]:
    model = make_model()
    torch.manual_seed(2)  # random_unstructured draws the same entries in both runs
    apply_pruning(model, kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    losses = []
    for i, (x, y) in enumerate(batches()):
        loss = nn.functional.cross_entropy(model(x), y)
        losses.append(loss.item())
        (loss / WINDOW).backward()
        if (i + 1) % WINDOW == 0:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
    return model, losses


def memkern_run(kind: str, order: str, optimizer: str, clip: float | None):
    model = make_model()
    if order == "after patch":
        memkern.patch(model)
    torch.manual_seed(2)
    apply_pruning(model, kind)
    if order == "before patch":
        memkern.patch(model)
    assert type(model[2]).__module__ == "memkern.nn.linear"
    if optimizer == "ShardedOptimizer":
        opt = memkern.optim.ShardedOptimizer(model.parameters(), "adamw", lr=1e-2,
                                             weight_decay=0.1, accumulation_steps=WINDOW,
                                             max_grad_norm=clip)
    else:
        opt = memkern.optim.FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for i, (x, y) in enumerate(batches()):
        loss = nn.functional.cross_entropy(model(x), y)
        losses.append(loss.item())
        if optimizer == "ShardedOptimizer":
            opt.backward(loss)
        else:
            (loss / WINDOW).backward()
        if (i + 1) % WINDOW == 0:
            for layer in pruned_layers(model):  # the last micro-batch's gradients are here
                for name, mask in layer.named_buffers():
                    orig = getattr(layer, name.removesuffix("_mask") + "_orig")
                    if orig.grad is not None:
                        assert (orig.grad[mask == 0] == 0).all(), name
        if optimizer == "ShardedOptimizer" or (i + 1) % WINDOW == 0:
            opt.step()  # ShardedOptimizer: False until the window's last micro-batch
            opt.zero_grad()
    return model, losses, opt


CASES = [("unstructured", "before patch", "ShardedOptimizer", 0.5),
         ("structured", "after patch", "ShardedOptimizer", None),
         ("unstructured", "after patch", "FusedAdamW", None),
         ("structured", "before patch", "FusedAdamW", None)]


@pytest.mark.parametrize("kind, order, optimizer, clip", CASES)
def test_pruned_training_equals_the_unpatched_pruned_model(capfd, kind, order, optimizer,
                                                           clip):
    expected, expected_losses = torch_run(kind, clip)
    capfd.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, losses, opt = memkern_run(kind, order, optimizer, clip)
        err = capfd.readouterr().err
    assert "Warning" not in err and "warn" not in err.lower(), err
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses),
                               rtol=1e-5, atol=0)
    assert masks(got).keys() == masks(expected).keys()
    for name, mask in masks(got).items():
        assert torch.equal(mask, masks(expected)[name])
        assert 0 < (mask == 0).sum() < mask.numel()
    for layer in pruned_layers(got):
        for name in ("weight", "bias"):
            mask = getattr(layer, f"{name}_mask", None)
            if mask is not None:
                assert (getattr(layer, name)[mask == 0] == 0).all()  # exactly zero, not small
    assert params_rel_err([t for layer in pruned_layers(got) for t in (layer.weight, layer.bias)],
                          [t for layer in pruned_layers(expected)
                           for t in (layer.weight, layer.bias)]) < 1e-6

    # prune.remove: the masked weights become plain parameters again, zeros kept
    for layer, expected_layer in zip(pruned_layers(got), pruned_layers(expected)):
        for name in ("weight", "bias"):
            if prune.is_pruned(layer) and hasattr(layer, f"{name}_mask"):
                prune.remove(layer, name)
                prune.remove(expected_layer, name)
    assert not masks(got) and all(isinstance(p, nn.Parameter) for p in
                                  (layer.weight for layer in pruned_layers(got)))
    assert params_rel_err(got, expected) < 1e-6
    x = batches()[0][0]
    torch.testing.assert_close(got(x), expected(x), rtol=1e-5, atol=1e-6)
    # prune.remove replaced the parameters' storage (orig.data = ...): the optimizer, whose
    # flat storage the model no longer reads, refuses to step (docs/integrations.md)
    if optimizer == "ShardedOptimizer":
        opt.backward(got(x).square().mean())
    else:
        got(x).square().mean().backward()
    with pytest.raises(RuntimeError, match="storage of a parameter"):
        opt.step(force=True) if optimizer == "ShardedOptimizer" else opt.step()
