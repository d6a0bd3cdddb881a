"""Training set-ups the planner knows how to build: Hugging Face causal language models from a
config (the benchmark's configurations have theirs: ``bench_workload`` in the bench package).

Each function returns a ``build()`` for :func:`memkern.profile.plan.plan_training_step`: it
makes the set-up the way the benchmark (or a user's script) makes it, on the CPU stand-in.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from memkern import _fake
from memkern.profile.blocks import repeated_blocks
from memkern.profile.plan import TrainingSetup, on_host

PATCH_OPTIONS = ("linear", "norm", "mlp", "dropout", "lora", "attention", "loss")
"""The on/off families of :func:`memkern.patch` (see ``memkern.nn.patch``)."""
SHARDINGS = ("zero1", "zero2", "fsdp2")
"""How :func:`hf_workload` shards across the ranks of the default process group."""


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
        raise ValueError(_not_a_config(source)) from None
    unknown = [k for k in settings if not hasattr(default, k) and k not in data_keys(source)
               and k != "attn_implementation"]
    if unknown:
        raise ValueError(f"the {model_type} config has no setting {', '.join(map(repr, unknown))}")
    # at construction, so that derived settings (head_dim from hidden_size) follow
    return transformers.AutoConfig.for_model(model_type, **settings)


def _not_a_config(source: str) -> str:
    """The error for a source that is neither a file nor a model type: most often a Hub model
    id ("bert-base-uncased", "meta-llama/Llama-3.1-8B"), which is not fetched: say so, and
    name the model type its name starts with, if one does."""
    from transformers import CONFIG_MAPPING

    name = source.rsplit("/", 1)[-1].lower().replace("_", "-")
    types = [t for t in CONFIG_MAPPING if name.startswith(t.replace("_", "-"))]
    guess = max(types, key=len, default=None)
    hint = (f"; for its architecture at its default sizes try --hf {guess} (with --set for "
            "the sizes)" if guess else "")
    return (f"{source!r} is neither a config file nor a transformers model type (e.g. llama, "
            "mistral, qwen2, gpt2, bert). Hub model ids are not fetched (nothing is "
            f"downloaded): download its config.json (hf download {source} config.json prints "
            f"where it put it) and pass that path{hint}")


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


LORA_DEFAULTS = {"r": 16, "alpha": 32, "dropout": 0.0, "targets": "all-linear"}
"""The LoRA adapters :func:`lora_options` describes by default: rank 16, ``lora_alpha`` 32, no
dropout, on every linear layer but the output layer (PEFT's ``"all-linear"``)."""


def lora_options(text: str) -> dict:
    """LoRA options from ``"r=16,alpha=32,dropout=0.05,targets=q_proj+v_proj"`` (any of them;
    the rest :data:`LORA_DEFAULTS`; ``targets``: module names joined by ``+``, or
    ``all-linear``)."""
    options = dict(LORA_DEFAULTS)
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in LORA_DEFAULTS:
            raise ValueError(f"LoRA option {item!r}: expected key=value with key one of "
                             f"{', '.join(LORA_DEFAULTS)} (e.g. r=16,alpha=32)")
        try:
            options[key] = (value if key == "targets" else
                            int(value) if key in ("r", "alpha") else float(value))
        except ValueError:
            raise ValueError(f"LoRA option {item!r}: {value!r} is not a number") from None
    if options["r"] < 1 or not 0.0 <= options["dropout"] < 1.0:
        raise ValueError(f"LoRA options {text!r}: r must be at least 1 and dropout in [0, 1)")
    return options


def with_lora(model: torch.nn.Module, options: dict) -> torch.nn.Module:
    """``model`` with PEFT's LoRA adapters (``peft.get_peft_model``) as :func:`lora_options`
    describes them: the base weights frozen, the adapters trainable."""
    import peft

    targets = options["targets"]
    config = peft.LoraConfig(r=options["r"], lora_alpha=options["alpha"],
                             lora_dropout=options["dropout"],
                             target_modules=targets if targets == "all-linear"
                             else targets.split("+"))
    return peft.get_peft_model(model, config)
@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer as code: ``spec(params)`` makes it, :meth:`code` writes the same call as
    Python a user can paste (so what a command plans is what it prints)."""

    path: str
    """The class, as imported: ``"memkern.optim.ShardedOptimizer"``."""
    args: tuple = ()
    """The positional arguments after the parameters."""
    kwargs: dict = dataclasses.field(default_factory=dict)

    def __call__(self, params) -> Any:
        module, _, name = self.path.rpartition(".")
        return getattr(importlib.import_module(module), name)(params, *self.args, **self.kwargs)

    def with_options(self, **options: Any) -> OptimizerSpec:
        """The same optimizer with these keyword arguments added (or replaced)."""
        return dataclasses.replace(self, kwargs={**self.kwargs, **options})

    def code(self, params: str = "model.parameters()") -> str:
        args = [params, *map(_literal, self.args),
                *(f"{k}={_literal(v)}" for k, v in self.kwargs.items())]
        return f"{self.path}({', '.join(args)})"


def _literal(value: Any) -> str:
    """A keyword value as Python: strings in double quotes, as the docs write them."""
    return json.dumps(value) if isinstance(value, str) else repr(value)


NO_KV_CACHE = {"use_cache": False}
"""The forward's keyword for a recomputed transformers model, as ``gradient_checkpointing_enable``
sets it: in training a key/value cache holds every layer's keys and values until the step
ends, and a recomputed layer appends them again (its recomputed keys then no longer match the
saved ones: torch's checkpoint refuses the step)."""


def uses_kv_cache(config) -> bool:
    """Whether a transformers model of ``config`` keeps a key/value cache by default."""
    return bool(getattr(config, "use_cache", False))


OPTIMIZERS = {
    "sharded": OptimizerSpec("memkern.optim.ShardedOptimizer", ("adamw",), dict(
        lr=1e-4, loss_scale="dynamic", max_grad_norm=1.0)),
    "adamw-fused": OptimizerSpec("torch.optim.AdamW", (), dict(lr=1e-4, fused=True)),
    "adamw": OptimizerSpec("torch.optim.AdamW", (), dict(lr=1e-4, foreach=True)),
    "memkern-adamw": OptimizerSpec("memkern.optim.FusedAdamW", (), dict(lr=1e-4)),
    "memkern-adamw-8bit": OptimizerSpec("memkern.optim.FusedAdamW", (), dict(
        lr=1e-4, state_precision="8bit")),
}
"""The optimizers :func:`hf_workload` builds, by name. ``memkern plan`` and ``memkern fit``
train with "sharded" unless told otherwise: ``ShardedOptimizer``'s AdamW, float32 master weights
of 16-bit parameters, global-norm clipping at 1.0, dynamic loss scaling."""
DEFAULT_OPTIMIZER = "sharded"

TASKS = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "image-classification": "AutoModelForImageClassification",
}
"""The tasks :func:`hf_workload` trains: task -> the ``transformers`` auto class of its model."""

MASKED_FRACTION = 0.15
"""The fraction of tokens a masked-LM batch labels (BERT's); the others are -100."""


def default_seq(config, task: str) -> int:
    """A task's default sequence length: 2048 for a causal LM (or its context, if shorter),
    512 for an encoder (or its positions, less RoBERTa's two padding offsets)."""
    positions = getattr(config, "max_position_embeddings", None)
    if task == "causal-lm":
        return min(2048, positions or 2048)
    return min(512, (positions or 514) - 2 * (getattr(config, "model_type", "") in
                                              ("roberta", "xlm-roberta", "camembert")))


def model_class(config, task: str):
    """The model class ``transformers``' auto class ``TASKS[task]`` gives ``config``."""
    import transformers

    auto = getattr(transformers, TASKS[task])
    # The auto class's mapping (private): its from_config() fails on mappings to several
    # classes (DeiT's image classification in transformers 5.24); the first is the plain model.
    try:
        found = auto._model_mapping[type(config)]
    except KeyError:
        raise ValueError(f"{config.model_type} has no {task} model in transformers "
                         f"({TASKS[task]})") from None
    return found[0] if isinstance(found, tuple) else found


def task_batch(config, task: str, batch: int, seq: int) -> dict:
    """One batch of ``task``'s inputs and labels, random (masked LM: one token in
    ``round(1 / MASKED_FRACTION)`` labelled, the others -100)."""
    if task == "image-classification":
        size, channels = config.image_size, getattr(config, "num_channels", 3)
        return dict(pixel_values=torch.randn(batch, channels, size, size),
                    labels=torch.randint(0, config.num_labels, (batch,)))
    ids = torch.randint(1, config.vocab_size, (batch, seq))
    if task == "causal-lm":
        return dict(input_ids=ids, labels=ids)
    if task == "masked-lm":  # with data: memkern's fused loss keeps the labelled rows
        with _fake.without_dispatch_modes():
            every = round(1 / MASKED_FRACTION)
            labelled = torch.arange(batch * seq).view(batch, seq) % every == 0
            labels = torch.where(labelled, torch.randint(1, config.vocab_size, (batch, seq)), -100)
        return dict(input_ids=ids,
                    labels=_fake.fake_with_data(labels) if _fake.fake_mode_active() else labels)
    if task == "sequence-classification":
        return dict(input_ids=ids, labels=torch.randint(0, config.num_labels, (batch,)))
    return dict(input_ids=ids, labels=torch.randint(0, config.num_labels, (batch, seq)))


def hf_workload(config, *, batch: int, seq: int, dtype: torch.dtype = torch.bfloat16,
                patch: dict | None = None, optimizer: str = "adamw-fused",
                gradient_checkpointing: bool = False, task: str = "causal-lm",
                autocast: torch.dtype | None = None, sharding: str | None = None,
                optimizer_options: dict | None = None, checkpoint: str | None = None,
                kv_cache: bool = True, lora: dict | None = None) -> Callable[[], TrainingSetup]:
    """A ``transformers`` model for ``task`` (:data:`TASKS`) from ``config``
    (:func:`hf_config`), parameters in ``dtype``, trained as ``benchmarks/bench_hf.py`` trains
    it: ``model(**batch).loss``, ``backward()``, the optimizer's step,
    ``zero_grad(set_to_none=True)``. The batch: ``batch`` sequences of ``seq`` token ids and
    the task's labels (causal LM: the ids; masked LM: 15% of the tokens labelled; image
    classification: ``batch`` images of the config's size, ``seq`` unused).

    ``patch``: None (plain transformers) or the keyword arguments of :func:`memkern.patch`
    (``{}`` for its defaults, ``{"recompute": "full"}``, ``{"mlp": False}``...).
    ``optimizer``: "adamw-fused" (``torch.optim.AdamW(fused=True)``), "adamw" (foreach),
    "memkern-adamw" (:class:`memkern.optim.FusedAdamW`), "memkern-adamw-8bit" (its 8-bit
    state) or "sharded" (:class:`memkern.optim.ShardedOptimizer`, AdamW, dynamic loss scale,
    clipping at 1.0): :data:`OPTIMIZERS`. ``optimizer_options``: keyword arguments added to
    its constructor's (``{"state_precision": "8bit", "offload": "cpu"}``).
    ``gradient_checkpointing``: transformers' own (``model.gradient_checkpointing_enable()``).
    ``lora``: :func:`lora_options`' dict: the model gets PEFT's LoRA adapters (:func:`with_lora`)
    before ``patch``, and the optimizer steps the adapters only.
    ``checkpoint``: :func:`memkern.checkpoint` with this policy on each of the model's
    repeated blocks (:func:`memkern.profile.fit.repeated_blocks`: its decoder layers), called
    without a key/value cache (:data:`NO_KV_CACHE`). ``kv_cache=False``: the forward runs
    without its key/value cache in any case (what ``memkern plan`` and ``memkern fit`` plan).
    ``autocast``: the forward runs under ``torch.autocast(<the planned device>, dtype=autocast)``
    (AMP: float32 parameters, ``torch.float16`` or ``torch.bfloat16`` matmuls).

    ``sharding`` (over the default process group: plan with ``world_size``), each rank
    training on its own ``batch`` sequences: "zero1" / "zero2" (the ``"sharded"`` optimizer,
    ``zero_stage`` 1 / 2: a whole model per rank, the optimizer state split), or "fsdp2"
    (``fully_shard`` on each decoder layer, then on the model, as torchtitan does; then the
    optimizer on the sharded parameters).
    """
    from transformers.initialization import no_init_weights

    import memkern

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: choose from {', '.join(OPTIMIZERS)}")
    if task not in TASKS:
        raise ValueError(f"task={task!r}: choose from {', '.join(TASKS)}")
    if sharding is not None and sharding not in SHARDINGS:
        raise ValueError(f"sharding={sharding!r}: choose from {', '.join(SHARDINGS)}")
    if sharding in ("zero1", "zero2") and optimizer != "sharded":
        raise ValueError(f"sharding={sharding!r} is ShardedOptimizer's: use optimizer='sharded'")
    if sharding == "fsdp2" and optimizer == "sharded":
        raise ValueError("sharding='fsdp2' shards the parameters: use a torch optimizer or "
                         "memkern-adamw, not 'sharded'")
    model_cls = model_class(config, task)
    spec = OPTIMIZERS[optimizer].with_options(**(optimizer_options or {}))
    if sharding == "zero2":
        spec = spec.with_options(zero_stage=2)

    def make() -> TrainingSetup:
        # built on the CPU in float32, then moved (and cast) to the device; the weights'
        # initial values do not matter to a plan (ViT's truncated-normal init cannot run on
        # fake tensors)
        with on_host(), no_init_weights():
            model = model_cls(config)
        # transformers' no_init_weights also skips tying the output layer to the embeddings
        # (GPT-2's, a masked LM's decoder): tie them as a built model has them
        model.tie_weights()
        model = model.to(dtype=dtype).train()
        if gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if lora is not None:
            model = with_lora(model, lora)
        if patch is not None:
            memkern.patch(model, **patch)
        if checkpoint is not None:
            for _, block in repeated_blocks(model):
                memkern.checkpoint(block, checkpoint)
        if sharding == "fsdp2":
            _fully_shard(model)
        opt = spec([p for p in model.parameters() if p.requires_grad])
        sharded = opt if isinstance(opt, memkern.optim.ShardedOptimizer) else None
        inputs = task_batch(config, task, batch, seq)
        device = next(model.parameters()).device.type
        no_cache = (NO_KV_CACHE if (checkpoint is not None or not kv_cache)
                    and uses_kv_cache(config) else {})

        def step() -> None:
            with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
                loss = model(**inputs, **no_cache).loss
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
        extras = "".join([f", LoRA r={lora['r']} on {lora['targets']}" if lora else "",
                          f", autocast {autocast}" if autocast is not None else "",
                          ", gradient checkpointing" if gradient_checkpointing else "",
                          f", memkern.checkpoint {checkpoint!r}" if checkpoint else ""])
        options = "".join(f", {k}={_literal(v)}" for k, v in (optimizer_options or {}).items())
        shape = (f"batch {batch}" if task == "image-classification" else f"batch {batch} x {seq}")
        ranks = "" if sharding is None else \
            f", {sharding} over {torch.distributed.get_world_size()} ranks"
        return TrainingSetup(model, opt, step,
                             f"{model_cls.__name__} {how}, {dtype}{extras}, {optimizer}"
                             f"{options}, {shape}{ranks}")

    return make


def _fully_shard(model: torch.nn.Module) -> None:
    """FSDP2 over the default process group, in the layout ``MemkernTrainer(fsdp2=True)``
    trains (:func:`memkern.integrations.fsdp2.fully_shard_blocks`)."""
    from torch.distributed.device_mesh import init_device_mesh

    from memkern import _fake
    from memkern.integrations.fsdp2 import fully_shard_blocks

    device = next(model.parameters()).device.type
    with _fake.without_dispatch_modes():  # the mesh's rank table is real even when planning
        mesh = init_device_mesh(device, (torch.distributed.get_world_size(),))
    fully_shard_blocks(model, mesh)
