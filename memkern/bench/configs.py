"""The training configurations ``memkern bench`` compares, each built from the same seeded
model and trained on the same batches: :data:`DESCRIPTIONS` says what each one is (``memkern
bench`` prints it under its tables and in ``--help``).

``compile=True`` puts the memkern configurations' forward under ``torch.compile`` too (their
ops are ``torch.library`` ops with fake implementations, so they compile as opaque nodes).
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import types
from collections.abc import Callable

import torch

import memkern
from memkern.bench.model import GPT, GPTConfig

MEMORY_BUDGET = 0.5
"""torch-amp-compiled-budget's activation memory budget: the fraction of the activations the
compiled graph may keep (the rest it recomputes in backward)."""
DESCRIPTIONS = {
    "torch-fp32": "plain torch: float32 model, AdamW(fused=True), clip_grad_norm_",
    "torch-amp": "torch AMP: autocast(bf16) + GradScaler + clipping + fused AdamW",
    "torch-amp-compiled": "torch-amp with the model's forward under torch.compile (the "
                          "strongest plain-torch composition on a GPU)",
    "torch-amp-compiled-budget": "torch-amp-compiled with torch's automatic recomputation: "
                                 f"the compiler's activation memory budget at {MEMORY_BUDGET}, "
                                 "so its partitioner recomputes instead of saving what it can",
    "memkern-modules": "memkern.patch-ed model + fused linear cross-entropy head, float32, "
                       "torch's AdamW: memkern's layers only",
    "memkern-full": "memkern's layers, bf16 parameters, the flat bf16 gradient buffer and "
                    "ShardedOptimizer (dynamic loss scale, clipping, fused AdamW on float32 "
                    "master weights)",
    "memkern-full-ckpt": "memkern-full with every transformer block under memkern.checkpoint "
                         "(ckpt: recomputed in backward)",
    "memkern-full-8bit": "memkern-full with state_precision='8bit' (block-wise 8-bit Adam "
                         "moments for parameters of >= 4096 elements)",
    "memkern-full-offload": "memkern-full with offload='cpu': master weights and Adam moments "
                            "in host memory, each bucket's host step started during backward; "
                            "not in the default set",
    "memkern-fit": "memkern-full with each block's recomputation chosen by memkern.fit so that "
                   "the step fits --memory-budget; not in the default set",
}
"""What each configuration is, one line each."""
CONFIGS = tuple(DESCRIPTIONS)
DEFAULT_CONFIGS = CONFIGS[:-2]
"""What ``memkern bench`` runs by default: memkern-fit needs a memory budget, and
memkern-full-offload is measured against memkern-full when asked for (its host step takes the
machine's CPU cores, which the default run's CPU configurations share)."""
BASELINE = "torch-amp"
LR, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-3, 0.01, 1.0
MIN_STEPS = 3
"""Steps a run needs: one warm-up, one profiled for memory, at least one timed."""


@dataclasses.dataclass
class Setup:
    """A model with its optimizer and the two calls the bench makes on them."""

    name: str
    model: GPT
    optimizer: torch.optim.Optimizer
    train_step: Callable[..., torch.Tensor]
    """``train_step(x, y, after_backward=None)``: one optimizer step on one batch (forward,
    backward, clip, update, zero grads); returns the loss. ``after_backward()``, if given, is
    called once the gradients exist (for measuring what a step holds)."""
    autocast: Callable[[], contextlib.AbstractContextManager]
    """The context the forward runs in (autocast for torch-amp, nothing otherwise)."""


def _memkern_modules(model: GPT, *, checkpoint: bool = False) -> GPT:
    memkern.patch(model)
    head = memkern.nn.LinearCrossEntropy(model.cfg.width, model.cfg.vocab, bias=False,
                                         device=model.wte.weight.device)
    head.weight = model.wte.weight  # keep input and output embeddings tied
    model.head = head
    if checkpoint:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = memkern.checkpoint(block, policy="full")
    return model


def _torch_step(model: GPT, optimizer: torch.optim.Optimizer, autocast, max_grad_norm: float,
                scaler=None):
    def step(x: torch.Tensor, y: torch.Tensor, after_backward=None) -> torch.Tensor:
        with autocast():
            loss = model(x, y)
        if scaler is None:
            loss.backward()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        if after_backward is not None:
            after_backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm, foreach=True)
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _activation_memory_budget(budget: float) -> contextlib.AbstractContextManager:
    """torch's own automatic recomputation at ``budget``. Its only switch is the private
    ``torch._functorch.config.activation_memory_budget`` (torch 2.4+, no public equivalent), so
    it is set here and nowhere else; the partitioner reads it when a graph is compiled."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(activation_memory_budget=budget)


def _own_forward(model: GPT) -> Callable:
    """``model.forward`` with a code object of its own. Dynamo keeps compiled graphs per code
    object and its guards do not tell two GPTs apart, so compiling ``GPT.forward`` itself would
    give every compiled configuration the graph the first one compiled, with that one's
    settings (the memory budget); with its own code, each configuration compiles and keeps its
    own graph while the others stay built beside it (the bench times them in rounds)."""
    f = type(model).forward
    own = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__,
                             f.__closure__)
    return types.MethodType(own, model)


def _compile_forward(model: GPT, memory_budget: float | None = None) -> None:
    """``torch.compile`` the model's forward (the module stays itself: its parameters, its
    state_dict keys and what the optimizers hold are unchanged); with ``memory_budget``, every
    compilation of it runs at that activation memory budget."""
    compiled = torch.compile(_own_forward(model))
    if memory_budget is None:
        model.forward = compiled
        return

    def forward(*args, **kwargs):
        with _activation_memory_budget(memory_budget):
            return compiled(*args, **kwargs)

    model.forward = forward


def build(name: str, cfg: GPTConfig, device: torch.device, seed: int = 0, *,
          compile: bool = False, param_dtype: torch.dtype = torch.bfloat16,
          batch: int | None = None, memory_budget: int | str | None = None,
          max_grad_norm: float = MAX_GRAD_NORM) -> Setup:
    """The configuration ``name`` on ``device``, from a model initialised with ``seed``;
    ``compile``: the memkern configurations' forward under ``torch.compile``;
    ``param_dtype``: the memkern-full configurations' parameter dtype (float32 takes bfloat16's
    rounding out of a comparison of their optimizers); ``batch`` and ``memory_budget``
    (bytes, or "3GiB"): memkern-fit's step and budget; ``max_grad_norm``: every
    configuration's clipping threshold."""
    if name not in CONFIGS:
        raise ValueError(f"unknown configuration {name!r}; choose from {', '.join(CONFIGS)}")
    if name == "memkern-fit" and (memory_budget is None or batch is None):
        raise ValueError("memkern-fit needs a memory budget (memkern bench --memory-budget, "
                         "e.g. 3GiB) and the batch size")
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    nothing = contextlib.nullcontext
    if name.startswith("torch") or name == "memkern-modules":
        if name == "memkern-modules":
            _memkern_modules(model)
        if name == "torch-amp-compiled" or (compile and name == "memkern-modules"):
            _compile_forward(model)
        elif name == "torch-amp-compiled-budget":
            _compile_forward(model, MEMORY_BUDGET)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                      fused=True)
        if name.startswith("torch-amp"):
            def autocast():
                return torch.autocast(device.type, dtype=torch.bfloat16)

            scaler = torch.amp.GradScaler(device.type)
            return Setup(name, model, optimizer,
                         _torch_step(model, optimizer, autocast, max_grad_norm, scaler),
                         autocast)
        return Setup(name, model, optimizer, _torch_step(model, optimizer, nothing, max_grad_norm),
                     nothing)

    _memkern_modules(model, checkpoint=name == "memkern-full-ckpt")
    model.to(param_dtype)

    def make_optimizer(params):
        return memkern.optim.ShardedOptimizer(
            params, "adamw", lr=LR, weight_decay=WEIGHT_DECAY, loss_scale="dynamic",
            max_grad_norm=max_grad_norm,
            state_precision="8bit" if name == "memkern-full-8bit" else "32bit",
            offload="cpu" if name == "memkern-full-offload" else None)

    if name == "memkern-fit":
        tokens = torch.zeros(batch, cfg.seq, dtype=torch.long, device=device)
        report = memkern.fit(model, (tokens, tokens), memory_budget, optimizer=make_optimizer,
                             device=device.type)
        print("\n".join(str(report).splitlines()[:3]), file=sys.stderr)
    if compile:
        _compile_forward(model)
    optimizer = make_optimizer(model.parameters())

    def step(x: torch.Tensor, y: torch.Tensor, after_backward=None) -> torch.Tensor:
        loss = model(x, y)
        optimizer.backward(loss)
        if after_backward is not None:
            after_backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return Setup(name, model, optimizer, step, nothing)
