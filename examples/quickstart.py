"""memkern in a plain training loop: patched layers, bf16 weights with float32 masters, the
flat gradient buffer, gradient accumulation, clipping and an LR schedule.

    python examples/quickstart.py

A small classifier learns a random linear rule; the loss printed every 20 steps goes down.
"""
import torch

import memkern as mk

torch.manual_seed(0)
features, classes = 64, 10
rule = torch.randn(features, classes)


def batch(n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, features)
    return x, (x @ rule).argmax(dim=1)


model = torch.nn.Sequential(torch.nn.LayerNorm(features), torch.nn.Linear(features, 256),
                            torch.nn.GELU(), torch.nn.Linear(256, classes))
model = mk.patch(model).to(torch.bfloat16)   # memkern layers; bf16 weights
opt = mk.optim.ShardedOptimizer(             # float32 master weights live in the optimizer
    model.parameters(), "adamw", lr=3e-3, weight_decay=0.01,
    accumulation_steps=4,                    # 4 micro-batches per optimizer step
    max_grad_norm=1.0)                       # clipping, folded into the fused step
steps = 100
scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps)

step = 0
while step < steps:
    x, y = batch()
    loss = torch.nn.functional.cross_entropy(model(x.bfloat16()).float(), y)
    opt.backward(loss)                       # not loss.backward(): scales and counts it
    if opt.step() is not False:              # False until the window's 4th micro-batch
        scheduler.step()
        step += 1
        if step % 20 == 0:
            print(f"step {step:3d}  loss {loss.item():.3f}  grad norm {opt.grad_norm:.3f}")
    opt.zero_grad()                          # does nothing while a window is open
