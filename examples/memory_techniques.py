"""PyTorch's "Memory Optimization" notebook, its three techniques each beside its memkern
counterpart, measured in bytes:

1. parameter footprint: the bytes of training state per parameter (weights, gradients, the
   optimizer's float32 weights and moments), torch's AdamW against memkern's
   ``ShardedOptimizer`` with bf16 weights and 8-bit moments;
2. gradient accumulation: four micro-batches per step, ``loss / 4`` and ``loss.backward()``
   against ``ShardedOptimizer(accumulation_steps=4)``, which sums the micro-batches'
   gradients in its flat buffer and divides once, in the fused step: the same update; the
   bytes one micro-batch saves for backward against the whole batch's;
3. activation checkpointing: ``torch.utils.checkpoint`` on a block against
   ``memkern.checkpoint(block)``, and memkern's patched layers, which save less without
   recomputing the block's GEMMs: on the notebook's ReLU block, and on a LayerNorm + GELU MLP
   block as transformers have.

Every figure is measured as the script runs (memkern.profile), on the CPU, in seconds::

    python examples/memory_techniques.py
"""
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import memkern as mk
from memkern.profile import memory_breakdown, saved_bytes


def kib(n: int) -> str:
    return f"{n / 1024:8.1f} KiB"


# ------------------------------------------------------------------ 1. parameter footprint
def training_state(model: nn.Module, opt: torch.optim.Optimizer, step) -> tuple[int, int]:
    """Bytes of weights, gradients, float32 weights the optimizer updates and its state, after
    one step (with the gradients of the next backward in place), and the parameter count."""
    x = torch.randn(16, 128)
    step(model(x.to(next(model.parameters()).dtype)).float().square().mean())
    model(x.to(next(model.parameters()).dtype)).float().square().mean().backward()
    b = memory_breakdown(model, opt)
    return b.params + b.grads + b.master_weights + b.optimizer_state, b.num_params


def large() -> nn.Sequential:
    torch.manual_seed(47)
    return nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10))


print("1. parameter footprint (the notebook's large model)")
model = large()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
torch_bytes, n = training_state(model, opt, lambda loss: (loss.backward(), opt.step()))

model = mk.patch(large()).to(torch.bfloat16)           # bf16 weights and gradients
opt = mk.optim.ShardedOptimizer(model.parameters(), "adamw", lr=1e-3, state_precision="8bit")
memkern_bytes, _ = training_state(model, opt, lambda loss: (opt.backward(loss), opt.step(),
                                                            opt.zero_grad()))
print(f"  {n} parameters")
print(f"  torch AdamW, float32:                       {kib(torch_bytes)}  "
      f"{torch_bytes / n:5.2f} bytes/parameter")
print(f"  memkern, bf16 weights, fp32 masters, 8-bit: {kib(memkern_bytes)}  "
      f"{memkern_bytes / n:5.2f} bytes/parameter")
assert memkern_bytes < 0.7 * torch_bytes


# ---------------------------------------------------------------- 2. gradient accumulation
def small_mlp() -> nn.Sequential:
    torch.manual_seed(47)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 2))


criterion = nn.CrossEntropyLoss()
x = torch.randn(32, 64)
y = torch.randint(0, 2, (32,))
micro_batch_size = 8
accumulation_steps = x.shape[0] // micro_batch_size

print("\n2. gradient accumulation (4 micro-batches of 8)")
# each micro-batch its own tensor, as a data loader gives it (a slice of x would keep all of x)
micro_x = [t.clone() for t in x.split(micro_batch_size)]
micro_y = [t.clone() for t in y.split(micro_batch_size)]
model = small_mlp()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
optimizer.zero_grad(set_to_none=True)
for step in range(accumulation_steps):
    loss = criterion(model(micro_x[step]), micro_y[step]) / accumulation_steps
    loss.backward()
optimizer.step()
whole_batch = saved_bytes(lambda: criterion(model(x), y))
micro_batch = saved_bytes(lambda: criterion(model(micro_x[0]), micro_y[0]))

patched = mk.patch(small_mlp())
opt = mk.optim.ShardedOptimizer(patched.parameters(), "adamw", lr=1e-2,
                                accumulation_steps=accumulation_steps)
for step in range(accumulation_steps):
    opt.backward(criterion(patched(micro_x[step]), micro_y[step]))  # no / 4: once, in the step
    opt.step()                                                        # False until the 4th
    opt.zero_grad()                                                   # nothing until then
memkern_micro_batch = saved_bytes(lambda: criterion(patched(micro_x[0]), micro_y[0]))
print(f"  saved for backward, torch, whole batch of 32:   {kib(whole_batch)}")
print(f"  saved for backward, torch, micro-batch of 8:    {kib(micro_batch)}")
print(f"  saved for backward, memkern, micro-batch of 8:  {kib(memkern_micro_batch)}"
      "  (a ReLU MLP: the same tensors)")
for p, q in zip(patched.parameters(), model.parameters()):
    torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
print("  the same weights after the step (to float32 rounding)")
assert 3.5 * micro_batch < whole_batch and memkern_micro_batch <= micro_batch


# -------------------------------------------------------------- 3. activation checkpointing
def relu_block() -> nn.Module:
    """The notebook's block."""
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())


def gelu_block() -> nn.Module:
    """The block as a transformer writes it: LayerNorm, then a GELU MLP."""
    return nn.Sequential(nn.LayerNorm(64),
                         nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)))


input_tensor = torch.randn(16, 64)
target = torch.randint(0, 2, (16,))


def measured(make_block, wrap=lambda block: block, run=lambda block, t: block(t)):
    """Bytes the block and the head save for backward, and the input's gradient."""
    torch.manual_seed(47)
    block, head = wrap(make_block()), nn.Linear(64, 2)
    inp = input_tensor.clone().requires_grad_()
    saved = saved_bytes(lambda: criterion(head(run(block, inp)), target))
    criterion(head(run(block, inp)), target).backward()
    return saved, inp.grad


def torch_checkpoint(block, t):
    return checkpoint(block, t, use_reentrant=False)


print("\n3. activation checkpointing (batch 16)")
for name, make_block in (("the notebook's ReLU block", relu_block),
                         ("a LayerNorm + GELU MLP block", gelu_block)):
    plain, plain_grad = measured(make_block)
    torch_ckpt, torch_grad = measured(make_block, run=torch_checkpoint)
    memkern_ckpt, memkern_grad = measured(make_block, wrap=mk.checkpoint)
    patched, patched_grad = measured(make_block, wrap=mk.patch)
    print(f"  {name}")
    print(f"    torch, no checkpointing:               {kib(plain)}")
    print(f"    torch.utils.checkpoint on the block:   {kib(torch_ckpt)}  (runs it twice)")
    print(f"    memkern.checkpoint(block):             {kib(memkern_ckpt)}  (runs it twice)")
    print(f"    memkern.patch(block):                  {kib(patched)}  (recomputes no GEMM)")
    for grad in (torch_grad, memkern_grad, patched_grad):
        torch.testing.assert_close(grad, plain_grad, rtol=1e-5, atol=1e-7)
    assert torch_ckpt < plain and memkern_ckpt <= torch_ckpt and patched <= plain
print("  the same input gradient every way (to float32 rounding)")
# The ReLU block's tensors are what any backward needs (a linear layer's input, ReLU's
# output); the GELU block's torch version also keeps the LayerNorm's output and GELU's input
# and output, which memkern's layers recompute cheaply instead of keeping.
assert patched < plain
