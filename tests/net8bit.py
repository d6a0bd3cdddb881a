"""The small model, gradient streams, stepping helper and state reader that the 8-bit
optimizer tests (test_optim_8bit.py, test_optim_sgd8bit.py) share."""
from __future__ import annotations

import torch

from memkern.kernels.state8bit import QBLOCK, num_blocks


class Net(torch.nn.Module):
    """Two weights above the 8-bit threshold (odd sizes, not multiples of the block), one
    below, biases and a one-element gain (float32 state)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(37, 129)   # 4773 elements: 8-bit
        self.fc2 = torch.nn.Linear(129, 41)   # 5289: 8-bit
        self.fc3 = torch.nn.Linear(41, 7)     # 287: float32
        self.gain = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x))))) * self.gain


def make_net(seed: int, dtype=torch.float32) -> Net:
    torch.manual_seed(seed)
    return Net().to(dtype)


def gradient_steps(model: Net, steps: int) -> list[list[torch.Tensor]]:
    """Fixed gradients spanning 4 decades, so that blocks hold values of unequal size."""
    return [[torch.randn_like(p) * 10.0 ** torch.empty(()).uniform_(-3, 1)
             for p in model.parameters()] for _ in range(steps)]


def apply(model: Net, opt, grads: list[list[torch.Tensor]]) -> None:
    """One optimizer step per entry of ``grads``, each with those gradients."""
    for step in grads:
        opt.zero_grad()
        for p, g in zip(model.parameters(), step):
            if p.grad is None:
                p.grad = g.to(p.dtype).clone()
            else:
                p.grad.copy_(g)
        opt.step()


def exact_gradients(model: Net) -> list[torch.Tensor]:
    """Gradients on a coarse grid (integers below 2**10 times a power of two per tensor): sums
    of two of them and divisions by a power of two are exact in float32."""
    return [torch.randint(-2**10, 2**10, p.shape).float() * 2.0 ** -int(torch.randint(10, 22, ()))
            for p in model.parameters()]


def stored_state(opt, p: torch.Tensor, key: str):
    """``("8bit", codes, absmax)`` or ``("32bit", flat)``: ``p``'s slice of its segment's
    state ``key`` (the blocks of a parameter start on a block boundary of its segment)."""
    seg = next(s for s in opt.segments if any(q is p for q in s.params))
    offset = seg.offsets[[q is p for q in seg.params].index(True)]
    n = p.numel()
    if seg.quantized:
        codes, absmax = seg.quantized_state[key]
        assert offset % QBLOCK == 0
        return "8bit", codes[offset:offset + n], absmax[offset // QBLOCK:][:num_blocks(n)]
    return "32bit", seg.state[key][offset:offset + n]
