"""``MemkernTrainer``: Hugging Face's ``transformers.Trainer`` training through memkern, and
``MemkernTrainerMixin``, the same for any ``Trainer`` subclass (trl's ``SFTTrainer``,
``DPOTrainer``, ``GRPOTrainer``, ...).

Use it where you would use ``Trainer``; the ``TrainingArguments`` keep their meaning::

    from memkern.integrations.transformers import MemkernTrainer

    args = TrainingArguments("out", bf16=True, gradient_accumulation_steps=4,
                             max_grad_norm=1.0, learning_rate=3e-4, lr_scheduler_type="cosine")
    trainer = MemkernTrainer(model=model, args=args, train_dataset=dataset)
    trainer.train()                       # later: trainer.train(resume_from_checkpoint=True)

``MemkernTrainer`` is ``class MemkernTrainer(MemkernTrainerMixin, Trainer)``; another trainer
gets the same by putting the mixin first among its bases (the mixin's methods must come before
``Trainer``'s, which is checked when the class is made)::

    class MemkernSFTTrainer(MemkernTrainerMixin, trl.SFTTrainer):
        pass

    trainer = MemkernSFTTrainer(model=model, args=sft_config, train_dataset=dataset,
                                processing_class=tokenizer, peft_config=lora, offload="cpu")

What changes against ``Trainer`` (and the same for a subclass):

* the model is patched in place with :func:`memkern.patch` (``patch=False`` leaves it alone,
  a dict passes keyword arguments to ``patch``);
* the optimizer is a :class:`memkern.optim.ShardedOptimizer` built from the arguments:
  ``optim`` ``"adamw_torch"``/``"adamw_torch_fused"`` (memkern's fused AdamW, the same math)
  or ``"sgd"``, ``learning_rate``, ``weight_decay`` (not on biases and norms, as ``Trainer``
  decides), ``adam_beta1/2``, ``adam_epsilon``; every LR scheduler of ``Trainer`` works;
* ``gradient_accumulation_steps`` is the optimizer's accumulation window: gradients are
  summed in the flat buffer and normalised once, in the fused step (``Trainer``'s own
  normalisation, by the window's token count or its number of micro-batches, is kept: the
  result is ``Trainer``'s gradient, without a second division);
* ``max_grad_norm`` is the optimizer's clipping, folded into its step (``Trainer`` does not
  clip on top; the logged ``grad_norm`` is the optimizer's, before clipping);
* ``bf16=True`` / ``fp16=True`` keep the weights and the gradient buffer in bfloat16 /
  float16 with float32 master weights in the optimizer, instead of autocast over float32
  weights; ``fp16`` adds dynamic loss scaling (a skipped step does not advance the scheduler);
* checkpoints hold the optimizer's full state (float32 masters, moments, loss scale), and
  ``train(resume_from_checkpoint=...)`` restores it, at any world size: in one process as
  ``Trainer``'s ``optimizer.pt``; across processes each rank writes its own shards
  (:meth:`~memkern.optim.ShardedOptimizer.save_sharded`, a ``memkern-optimizer`` folder),
  so no rank ever holds the whole state;
* a checkpoint is marked complete (``memkern-complete``) once every rank has written its
  files, and ``save_total_limit`` removes older ones only after that: a process killed while
  saving leaves the previous complete checkpoint, which ``train(resume_from_checkpoint=True)``
  resumes from (:func:`last_complete_checkpoint`; ``Trainer`` would pick the newest folder,
  written or not).

Across processes (``torchrun --nproc-per-node N`` or ``accelerate launch``), each rank holds the
whole model and the optimizer shards its state ZeRO-style (``zero_stage=1``: masters and
moments split 1/N per rank; ``2``: gradients too). The model is not wrapped in
``DistributedDataParallel``: the optimizer reduces the gradients itself, once per window.
``TrainingArguments.per_device_train_batch_size`` is per rank, as with ``Trainer``.

``MemkernTrainer(..., fsdp2=True)`` shards the parameters instead (accelerate enables its own
FSDP on GPUs only; this works on the CPU too): the patched model is ``fully_shard``-ed in
torchtitan's layout (each decoder layer, then the model:
:func:`memkern.integrations.fsdp2.fully_shard_blocks`) and stepped by memkern's
:class:`~memkern.optim.FusedAdamW` / :class:`~memkern.optim.FusedSGD` on each rank's shards.
``Trainer`` then does what it does for a torch optimizer: the backward of each micro-batch
(FSDP2 reduce-scatters the gradients, averaged over the ranks as DDP's are), clipping with the
global norm (``torch.nn.utils.clip_grad_norm_`` on the DTensor gradients), the step, the LR
schedule. Checkpoints hold the full (gathered) model and optimizer state, written by rank 0,
and resume at any world size. Launch under ``torchrun`` or ``accelerate launch`` (one process:
``--nproc-per-node 1``): FSDP2 needs a process group.
"""
from __future__ import annotations

import os
import re
from typing import Any

import safetensors.torch
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from transformers.utils import SAFE_WEIGHTS_NAME

from memkern.integrations.fsdp2 import fully_shard_blocks
from memkern.nn.patch import patch as patch_model
from memkern.optim.fused_adamw import FusedAdamW
from memkern.optim.fused_sgd import FusedSGD
from memkern.optim.sharded import ShardedOptimizer

# TrainingArguments.optim -> ShardedOptimizer's algorithm
ALGORITHMS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "sgd": "sgd"}
COMPLETE = "memkern-complete"
"""The file that marks a checkpoint folder whose files every rank has written."""


def last_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The ``checkpoint-<step>`` folder of ``output_dir`` with the highest step that
    :class:`MemkernTrainer` marked complete; None if there is none (or no such folder): what
    ``train(resume_from_checkpoint=...)`` is given by a script that resumes if it can."""
    pattern = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
    try:
        names = os.listdir(output_dir)
    except FileNotFoundError:
        return None
    steps = [(int(m.group(1)), name) for name in names if (m := pattern.match(name))
             and os.path.exists(os.path.join(output_dir, name, COMPLETE))]
    return os.path.join(os.fspath(output_dir), max(steps)[1]) if steps else None

SHARDED_OPTIMIZER = "memkern-optimizer"
"""A checkpoint's folder of the optimizer's shards, written across processes (each rank its
own: :meth:`memkern.optim.ShardedOptimizer.save_sharded`)."""

_FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)
"""FSDP2 checkpoints: the gathered tensors, on the CPU (rank 0 holds them, the others none)."""


def _argument(args: Any, name: str) -> Any:
    value = getattr(args, name)
    return getattr(value, "value", value)  # TrainingArguments turns some strings into enums


class MemkernTrainerMixin:
    """Gives a ``transformers.Trainer`` subclass memkern layers and ``ShardedOptimizer`` (see
    the module docstring for what each ``TrainingArguments`` field maps to): put it first among
    the class's bases, ``class MemkernSFTTrainer(MemkernTrainerMixin, SFTTrainer)``.

    Args:
        model, args, *trainer_args, **trainer_kwargs: as for the trainer; ``model`` is required
            (``model_init`` and a model name are not supported) and is cast and patched in
            place, before the trainer's own ``__init__`` (trl's wraps it with PEFT there when
            given ``peft_config``).
        patch: True: :func:`memkern.patch` the model; False: leave its layers alone; a dict:
            keyword arguments for ``memkern.patch`` (e.g. ``{"recompute": "full"}``).
        offload: None, or ``"cpu"``: the optimizer's masters and state in host memory
            (``ShardedOptimizer(offload="cpu")``).
        zero_stage: across processes, 1 (masters and optimizer state split across ranks) or 2
            (gradients too): ``ShardedOptimizer(zero_stage=)``; None: 1.
        fsdp2: True: shard the parameters with FSDP2 and step them with ``FusedAdamW`` /
            ``FusedSGD`` instead of ``ShardedOptimizer`` (module docstring); needs an
            initialized process group (``torchrun``, ``accelerate launch``); float32 or
            ``bf16``, without ``offload`` or ``zero_stage``.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        if Trainer not in mro or mro.index(MemkernTrainerMixin) > mro.index(Trainer):
            raise TypeError(
                f"memkern {cls.__name__}: MemkernTrainerMixin must come before a "
                "transformers.Trainer subclass among the bases, as in class "
                f"{cls.__name__}(MemkernTrainerMixin, SFTTrainer): otherwise Trainer's methods "
                "win and the optimizer is not memkern's")

    def __init__(self, model: torch.nn.Module | None = None, args: Any = None, *trainer_args: Any,
                 patch: bool | dict[str, Any] = True, offload: str | None = None,
                 zero_stage: int | None = None, fsdp2: bool = False,
                 **trainer_kwargs: Any) -> None:
        name = f"memkern {type(self).__name__}"
        if not isinstance(model, (torch.nn.Module, type(None))):
            raise TypeError(f"{name}: model must be a torch.nn.Module, got "
                            f"{type(model).__name__}; load it first (from_pretrained) and "
                            "pass the model")
        if model is None:
            raise ValueError(f"{name}: pass model=; model_init is not supported (the model is "
                             "patched and cast once, before training)")
        if trainer_kwargs.get("optimizer_cls_and_kwargs") is not None:
            raise ValueError(f"{name}: optimizer_cls_and_kwargs is not supported: the optimizer "
                             "is memkern's ShardedOptimizer (pick the algorithm with "
                             "TrainingArguments.optim: 'adamw_torch' or 'sgd')")
        if not isinstance(patch, (bool, dict)):
            raise TypeError(f"{name}: patch must be True, False or a dict of memkern.patch "
                            f"keyword arguments, got {type(patch).__name__}")
        if args is not None and not isinstance(args, TrainingArguments):
            raise TypeError(f"{name}: args must be a TrainingArguments (or a trl config), got "
                            f"{type(args).__name__}; pass the trainer's arguments after model "
                            "by keyword (DPOTrainer's second is ref_model)")
        if args is not None:
            if args.n_gpu > 1:
                raise ValueError(
                    f"{name}: one device per process ({args.n_gpu} GPUs are visible to this "
                    "one, which Trainer would drive with DataParallel); launch one process per "
                    "GPU with torchrun or accelerate launch")
            dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
            if dtype is not None:
                model.to(dtype)  # the optimizer keeps float32 masters of these weights
        if patch:
            patch_model(model, **(patch if isinstance(patch, dict) else {}))
        self._memkern_offload = offload
        self._memkern_zero_stage = 1 if zero_stage is None else zero_stage
        self.memkern_fsdp2 = fsdp2
        if trainer_args:  # Trainer's positional order: model, args, data_collator, ...
            trainer_args = (args, *trainer_args)
        else:  # by keyword: other trainers order their arguments otherwise
            trainer_kwargs["args"] = args
        super().__init__(model, *trainer_args, **trainer_kwargs)
        if fsdp2:
            self._fully_shard(offload, zero_stage)
        else:
            self.add_callback(_SkippedStepsHoldTheScheduler(self))

    def _fully_shard(self, offload: str | None, zero_stage: int | None) -> None:
        name = f"memkern {type(self).__name__}(fsdp2=True)"
        if offload is not None or zero_stage is not None:
            raise ValueError(f"{name}: offload= and zero_stage= are ShardedOptimizer's; FSDP2 "
                             "already shards the parameters, gradients and optimizer state: "
                             "drop them")
        if self.args.fp16:
            raise ValueError(f"{name}: fp16 needs loss scaling, which this composition does not "
                             "run; use bf16=True or float32")
        if self.optimizer is not None:
            # fully_shard replaces the parameters: one built before would step the old ones.
            raise ValueError(f"{name}: optimizers=(opt, ...) is not supported; "
                             f"{type(self).__name__} builds FusedAdamW or FusedSGD on the "
                             "sharded parameters from TrainingArguments.optim ('adamw_torch' "
                             "or 'sgd')")
        if not torch.distributed.is_initialized():
            raise ValueError(f"{name}: FSDP2 needs a process group: launch with torchrun or "
                             "accelerate launch (one process: torchrun --nproc-per-node 1)")
        # Each rank keeps its own slice of the weights it was given: start every rank from
        # rank 0's, as DistributedDataParallel and ShardedOptimizer do.
        with torch.no_grad():
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                torch.distributed.broadcast(tensor, src=0)
        # Trainer has placed the model on args.device; FSDP2 keeps the shards there.
        mesh = torch.distributed.device_mesh.init_device_mesh(
            self.args.device.type, (torch.distributed.get_world_size(),))
        fully_shard_blocks(self.model, mesh)

    # ---------------------------------------------------------------------------- optimizer
    @property
    def memkern_optimizer(self) -> ShardedOptimizer | FusedAdamW | FusedSGD | None:
        """The ``ShardedOptimizer`` (with ``fsdp2=True``: the ``FusedAdamW`` or ``FusedSGD``;
        ``self.optimizer`` is accelerate's wrapper of it during training); None before it is
        built."""
        opt = self.optimizer
        return getattr(opt, "optimizer", opt)

    def create_optimizer(self, model: torch.nn.Module | None = None
                         ) -> ShardedOptimizer | FusedAdamW | FusedSGD:
        """Builds the ``ShardedOptimizer`` (with ``fsdp2=True``: the ``FusedAdamW`` or
        ``FusedSGD``) from ``self.args``, or checks the one passed as
        ``optimizers=(opt, scheduler)`` against them."""
        args = self.args
        max_grad_norm = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 \
            else None
        if self.optimizer is not None:
            self._check_given_optimizer(self.optimizer, max_grad_norm)
            return self.optimizer
        optim = _argument(args, "optim")
        if optim not in ALGORITHMS:
            raise ValueError(f"memkern {type(self).__name__}: TrainingArguments.optim="
                             f"{optim!r} has no memkern equivalent; use one of "
                             f"{sorted(ALGORITHMS)}")
        algorithm = ALGORITHMS[optim]
        hyper = ({"betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}
                 if algorithm == "adamw" else {})
        opt_model = self.model if model is None else model
        decay = set(self.get_decay_parameter_names(opt_model))
        trainable = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in trainable if n in decay],
                   "weight_decay": args.weight_decay},
                  {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        if self.memkern_fsdp2:
            # Trainer's clipping and its LR scheduler drive this torch optimizer as any other.
            self.optimizer = (FusedAdamW(groups, lr=args.learning_rate, **hyper)
                              if algorithm == "adamw" else FusedSGD(groups, lr=args.learning_rate))
            return self.optimizer
        self.optimizer = ShardedOptimizer(
            groups, algorithm, lr=args.learning_rate,
            accumulation_steps=args.gradient_accumulation_steps, max_grad_norm=max_grad_norm,
            loss_scale="dynamic" if args.fp16 else None, offload=self._memkern_offload,
            zero_stage=self._memkern_zero_stage, **hyper)
        return self.optimizer

    def _check_given_optimizer(self, opt: Any, max_grad_norm: float | None) -> None:
        name = f"memkern {type(self).__name__}"
        opt = getattr(opt, "optimizer", opt)
        if not isinstance(opt, ShardedOptimizer):
            raise TypeError(f"{name}: optimizers=(opt, ...) must hold a "
                            f"memkern.optim.ShardedOptimizer, got {type(opt).__name__}")
        if opt.accumulation_steps != self.args.gradient_accumulation_steps:
            raise ValueError(f"{name}: the optimizer's accumulation_steps="
                             f"{opt.accumulation_steps} differs from TrainingArguments."
                             f"gradient_accumulation_steps={self.args.gradient_accumulation_steps}"
                             "; build it with the same value")
        if opt.max_grad_norm != max_grad_norm:
            raise ValueError(f"{name}: the optimizer's max_grad_norm={opt.max_grad_norm} differs "
                             f"from TrainingArguments.max_grad_norm={self.args.max_grad_norm}; "
                             "build it with the same value (None for max_grad_norm=0)")

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # Every rank is called. Across ranks, ShardedOptimizer writes its shards itself
        # (collective, nothing gathered); gathering FSDP2's state is collective too: every
        # rank assembles it, the saving rank writes it.
        opt = self.memkern_optimizer
        state = None
        if self.memkern_fsdp2:
            state = get_optimizer_state_dict(self.model, opt, options=_FULL_STATE)
        elif opt.world_size > 1:
            opt.save_sharded(os.path.join(output_dir, SHARDED_OPTIMIZER))
        else:
            state = opt.state_dict()
        if self.args.should_save:
            if state is not None:
                torch.save(state, os.path.join(output_dir, OPTIMIZER_NAME))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        sharded = os.path.join(checkpoint, SHARDED_OPTIMIZER)
        if self.memkern_fsdp2:
            # Every rank reads the full state and keeps its shards of it: any world size.
            state = torch.load(os.path.join(checkpoint, OPTIMIZER_NAME), map_location="cpu",
                               weights_only=True)
            set_optimizer_state_dict(self.model, self.memkern_optimizer, state,
                                     options=_FULL_STATE)
        elif os.path.isdir(sharded):
            # Each rank reads the parts of the saved shards it owns now: any world size.
            self.memkern_optimizer.load_sharded(sharded)
        else:
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.lr_scheduler.load_state_dict(
            torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if self.memkern_fsdp2 and state_dict is None:
            # Gathering the full weights is collective: every rank, before Trainer lets the
            # saving rank alone write them.
            state_dict = get_model_state_dict(self.model, options=_FULL_STATE)
        super()._save(output_dir, state_dict)

    def _load_from_checkpoint(self, resume_from_checkpoint: str,
                              model: torch.nn.Module | None = None) -> None:
        if not self.memkern_fsdp2:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        path = os.path.join(resume_from_checkpoint, SAFE_WEIGHTS_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"memkern {type(self).__name__}(fsdp2=True): no "
                                    f"{SAFE_WEIGHTS_NAME} in {resume_from_checkpoint}; resume "
                                    "from a checkpoint that it saved with fsdp2=True")
        # Tied weights are saved once: their other names are missing, as for Trainer's load.
        loaded = set_model_state_dict(self.model, safetensors.torch.load_file(path),
                                      options=StateDictOptions(full_state_dict=True,
                                                               strict=False))
        self._issue_warnings_after_load(loaded)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        # Trainer writes checkpoint-<step> in place, file by file on each rank, and then
        # rotates older checkpoints out: killed meanwhile, it leaves a partial newest folder
        # and maybe no complete one. The marker is written once every rank's files are, and
        # the rotation waits for it.
        limit = self.args.save_total_limit
        self.args.save_total_limit = None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            run_dir = self._get_output_dir(trial=trial)
            folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            _write_durably(os.path.join(folder, COMPLETE), f"{self.state.global_step}\n")
            rotate_checkpoints(run_dir, save_total_limit=limit, use_mtime=True,
                               best_model_checkpoint=self.state.best_model_checkpoint)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any,
              **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint=True`` resumes from the newest checkpoint
        marked complete (:func:`last_complete_checkpoint`), not from the newest folder."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(
                    f"memkern {type(self).__name__}: resume_from_checkpoint=True, but "
                    f"{self.args.output_dir} holds no complete checkpoint; pass None to start "
                    "afresh (last_complete_checkpoint(output_dir) is None then)")
        return super().train(resume_from_checkpoint, *args, **kwargs)

    # ------------------------------------------------------------------- backward and step
    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        # The weights are already 16-bit and the optimizer scales the loss itself: accelerate's
        # autocast would add nothing and its GradScaler would drive a torch optimizer.
        return {**super()._build_accelerator_args(**kwargs), "mixed_precision": "no"}

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # Trainer.training_step ends in self.accelerator.backward(loss): routing that one call
        # through ShardedOptimizer.backward keeps all of Trainer's loss handling.
        if not self.memkern_fsdp2:
            self.accelerator.backward = self._memkern_backward
        if self.is_fsdp_enabled or self.is_deepspeed_enabled or self.args.fsdp:
            # (On the CPU accelerate drops the fsdp settings and wraps the model in DDP.)
            raise ValueError(
                f"memkern {type(self).__name__}: FSDP and DeepSpeed shard the model for an "
                "optimizer of their own; drop the fsdp/deepspeed settings and pass "
                f"{type(self).__name__}(..., fsdp2=True) for FSDP2 with memkern's optimizer "
                "(docs/distributed.md)")
        # The optimizer reduces the gradients across ranks, once per window (with fsdp2,
        # FSDP2 reduce-scatters them): accelerate's DistributedDataParallel would reduce them a
        # second time, every micro-batch.
        # prepare_model's evaluation_mode applies autocast and compile as configured, without
        # the DDP wrapper. No device placement of the trained model either: Trainer placed it
        # before the optimizer moved its weights into flat storage, and accelerate's
        # ``.to("cpu:0")`` of a CPU model would copy every parameter out of it. Other models
        # (trl's reference and reward models) are placed as the trainer asks.
        prepare_model = self.accelerator.prepare_model
        self.accelerator.prepare_model = (
            lambda model, device_placement=None, evaluation_mode=False:
            prepare_model(model, device_placement=False if model is self.model
                          else device_placement, evaluation_mode=True))

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        opt = self.memkern_optimizer
        if not self.memkern_fsdp2 and opt.micro_batches == 0:
            # A new window: as long as Trainer makes it (shorter at the end of an epoch). The
            # gradients become the buffer's views before the forward, not at its backward:
            # memkern's layers choose what to save by whether weight.grad exists, and a forward
            # recomputed in backward (gradient checkpointing) must choose as the first did.
            opt.accumulation_steps = getattr(self, "current_gradient_accumulation_steps",
                                             self.args.gradient_accumulation_steps)
            _point_grads_at_buffer(opt)
        return super().training_step(*args, **kwargs)

    def _memkern_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"memkern {type(self).__name__}: backward options {sorted(kwargs)} "
                            "are not supported (they serve LOMO and DeepSpeed)")
        opt = self.memkern_optimizer
        # Trainer's loss already carries the window's normalisation (÷ its token count, or ÷
        # its micro-batches); the optimizer divides by the micro-batch count once more.
        opt.backward(loss * opt.accumulation_steps)

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        if self.memkern_fsdp2:
            return super()._clip_grad_norm(model)
        return None  # the optimizer clips inside its fused step

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        if self.memkern_fsdp2:
            return super()._get_grad_norm(model, grad_norm)
        return None  # known after the step: log() reads it from the optimizer

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        opt = self.memkern_optimizer
        if "loss" in logs and isinstance(opt, ShardedOptimizer) and opt.grad_norm is not None:
            logs = {**logs, "grad_norm": opt.grad_norm}
        super().log(logs, *args, **kwargs)


class MemkernTrainer(MemkernTrainerMixin, Trainer):
    """``transformers.Trainer`` with memkern layers and ``ShardedOptimizer``: the arguments of
    :class:`MemkernTrainerMixin` (see the module docstring for what each ``TrainingArguments``
    field maps to)."""


def _write_durably(path: str, text: str) -> None:
    """Writes ``path`` whole or not at all (a temporary file, fsynced, renamed over it)."""
    with open(path + ".tmp", "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(path + ".tmp", path)


def _point_grads_at_buffer(opt: ShardedOptimizer) -> None:
    """Zeroes the flat gradient buffer and makes every ``p.grad`` its view again.

    ``Trainer`` zeroes gradients with ``model.zero_grad()``, which sets ``p.grad`` to None:
    the next backward would allocate a fresh gradient per parameter beside the buffer."""
    opt.zero_grad()
    for bucket in opt.grad_buffer.buckets:
        if bucket.grads_are_views:
            for p, view in zip(bucket.params, bucket.views):
                p.grad = view


class _SkippedStepsHoldTheScheduler(TrainerCallback):
    """``Trainer`` advances the LR scheduler unless accelerate reports a skipped step, which it
    knows for its own GradScaler only: report the optimizer's overflow skips to it."""

    def __init__(self, trainer: MemkernTrainerMixin) -> None:
        self.trainer = trainer
        self.skipped = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # A resumed run's optimizer has loaded the skips counted before its checkpoint.
        opt = self.trainer.memkern_optimizer
        self.skipped = opt.skipped_steps if opt.scaler.dynamic else 0

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        opt = self.trainer.memkern_optimizer
        if opt.scaler.dynamic:
            skipped = opt.skipped_steps  # reads the device: only with loss scaling
            # accelerate's AcceleratedOptimizer.step_was_skipped returns this attribute.
            self.trainer.optimizer._is_overflow = skipped > self.skipped
            self.skipped = skipped
