"""Training set-ups the planner knows how to build: Hugging Face causal language models from a
config (the benchmark's configurations have theirs: ``bench_workload`` in the bench package).

Each function returns a ``build()`` for :func:`memkern.profile.plan.plan_training_step`: it
makes the set-up the way the benchmark (or a user's script) makes it, on the CPU stand-in.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence

import torch

from memkern.profile.plan import TrainingSetup, on_host

PATCH_OPTIONS = ("linear", "norm", "mlp", "dropout", "loss")
"""The on/off families of :func:`memkern.patch` (see ``memkern.nn.patch``)."""


def hf_config(source: str, overrides: Sequence[str] | dict = ()) -> object:
    """A ``transformers`` config from a model type ("llama") or a config file (``config.json``
    or a directory holding one), with ``overrides`` ("hidden_size=1024", or a dict) applied.
    Nothing is downloaded."""
    import transformers

    settings = dict(overrides) if isinstance(overrides, dict) else dict(map(_parse, overrides))
    if os.path.exists(source):
        path = os.path.join(source, "config.json") if os.path.isdir(source) else source
        with open(path) as fh:
            data = json.load(fh)
        model_type = data.pop("model_type", None)
        if model_type is None:
            raise ValueError(f"{path}: no model_type in the config file")
        settings = {**data, **settings}
    else:
        model_type = source
    try:
        default = transformers.AutoConfig.for_model(model_type)
    except ValueError:
        raise ValueError(f"{source!r} is neither a config file nor a transformers model type "
                         "(e.g. llama, mistral, qwen2, gpt2)") from None
    unknown = [k for k in settings if not hasattr(default, k) and k not in data_keys(source)
               and k != "attn_implementation"]
    if unknown:
        raise ValueError(f"the {model_type} config has no setting {', '.join(map(repr, unknown))}")
    # at construction, so that derived settings (head_dim from hidden_size) follow
    return transformers.AutoConfig.for_model(model_type, **settings)


def data_keys(source: str) -> set[str]:
    """The keys a config file sets (any is accepted: models read extra keys)."""
    if not os.path.exists(source):
        return set()
    path = os.path.join(source, "config.json") if os.path.isdir(source) else source
    with open(path) as fh:
        return set(json.load(fh))


def _parse(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"override {text!r}: expected key=value (e.g. hidden_size=1024)")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def hf_workload(config, *, batch: int, seq: int, dtype: torch.dtype = torch.bfloat16,
                patch: dict | None = None, optimizer: str = "adamw-fused",
                gradient_checkpointing: bool = False) -> Callable[[], TrainingSetup]:
    """A ``transformers`` causal LM from ``config`` (:func:`hf_config`), parameters in
    ``dtype``, trained as ``benchmarks/bench_hf.py`` trains it: ``model(input_ids=ids,
    labels=ids).loss``, ``backward()``, the optimizer's step, ``zero_grad(set_to_none=True)``.

    ``patch``: None (plain transformers) or the keyword arguments of :func:`memkern.patch`
    (``{}`` for its defaults, ``{"recompute": "full"}``, ``{"mlp": False}``...).
    ``optimizer``: "adamw-fused" (``torch.optim.AdamW(fused=True)``), "adamw" (foreach),
    "memkern-adamw" (:class:`memkern.optim.FusedAdamW`) or "sharded" (
    :class:`memkern.optim.ShardedOptimizer`, AdamW, dynamic loss scale, clipping at 1.0).
    """
    import transformers

    import memkern

    optimizers = ("adamw-fused", "adamw", "memkern-adamw", "sharded")
    if optimizer not in optimizers:
        raise ValueError(f"optimizer={optimizer!r}: choose from {', '.join(optimizers)}")

    def make() -> TrainingSetup:
        with on_host():  # built on the CPU in float32, then moved (and cast) to the device
            model = transformers.AutoModelForCausalLM.from_config(config)
        model = model.to(dtype=dtype).train()
        if gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if patch is not None:
            memkern.patch(model, **patch)
        params = model.parameters()
        sharded = None
        if optimizer == "adamw-fused":
            opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
        elif optimizer == "adamw":
            opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
        elif optimizer == "memkern-adamw":
            opt = memkern.optim.FusedAdamW(params, lr=1e-4)
        else:
            opt = sharded = memkern.optim.ShardedOptimizer(
                params, "adamw", lr=1e-4, loss_scale="dynamic", max_grad_norm=1.0)
        ids = torch.randint(1, config.vocab_size, (batch, seq))

        def step() -> None:
            loss = model(input_ids=ids, labels=ids).loss
            if sharded is not None:
                sharded.backward(loss)
                sharded.step()
                sharded.zero_grad()
                return
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        how = "plain" if patch is None else "memkern.patch(" + ", ".join(
            f"{k}={v!r}" for k, v in patch.items()) + ")"
        return TrainingSetup(model, opt, step,
                             f"{type(model).__name__} {how}, {dtype}, {optimizer}, "
                             f"batch {batch} x {seq}")

    return make
