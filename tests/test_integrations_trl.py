"""trl's trainers (SFTTrainer with its own chunked LM head, DPOTrainer, GRPOTrainer) on a
memkern-patched model, with and without ``peft_config`` (trl wraps the patched model with
PEFT: patch, then LoRA), and with memkern's optimizer through ``MemkernTrainerMixin``.

Tiny Llama built from a config and a character-level tokenizer built here (nothing
downloaded). Oracle: the same trainer on the unpatched model, same seed: each logged loss,
and the trained parameters' change over the run (norm-wise over all of them). Float32 (the
trainers' bf16 default off) except one SFT run with every SFTConfig default. Tolerances, about
10x what was measured on this machine (2 steps, lr 1e-2): torch's SGD on both sides (the
model's math alone), TOL: losses equal, changes within 1.1e-6; memkern's AdamW against torch's
(the mixin), ADAMW_TOL: changes within 9.0e-6; bf16 autocast over the plain model against
memkern's layers, BF16_TOL: losses within 1.6e-4.
"""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

import memkern as mk  # noqa: E402
from compare import params_rel_err  # noqa: E402
from memkern.integrations.transformers import MemkernTrainerMixin  # noqa: E402

TOL, ADAMW_TOL, BF16_TOL = 1e-5, 1e-4, 1e-3
CHARS = "abcdefghijklmnopqrstuvwxyz "
VOCAB = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
TEXTS = ["hello world", "the quick brown fox", "jumps over the lazy dog", "memkern trains",
         "a b c", "zzz top"]
PROMPTS = ["ab", "the", "xy", "mem"]


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """One token per character, built in memory: trl's trainers need a processing class."""
    model = tokenizers.models.WordLevel(VOCAB, unk_token="<unk>")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                eos_token="<eos>", unk_token="<unk>")


def tiny_llama() -> torch.nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=len(VOCAB), max_position_embeddings=64,
        pad_token_id=0, eos_token_id=1, bos_token_id=1))


def lora() -> peft.LoraConfig:
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)


def distinct_letters(completions, **kwargs) -> list[float]:
    """GRPO's reward: varies within a group, so the advantages (and gradients) are not 0."""
    return [float(len(set(c))) for c in completions]


def trainer_setup(kind: str, out, steps: int, **config) -> tuple[type, object, dict]:
    """(trl trainer class, its config, its keyword arguments) for a ``kind`` run."""
    common = dict(max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-2,
                  logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                  disable_tqdm=True, dataloader_num_workers=0)
    common.update(config)
    if kind == "sft":
        return trl.SFTTrainer, trl.SFTConfig(str(out), **common), dict(
            train_dataset=datasets.Dataset.from_dict({"text": TEXTS * 2}))
    if kind == "dpo":
        return trl.DPOTrainer, trl.DPOConfig(str(out), **common), dict(
            train_dataset=datasets.Dataset.from_dict({
                "prompt": PROMPTS * 2, "chosen": [" cd", " fox", " z", "kern"] * 2,
                "rejected": [" zz", " dog", " q", "ory"] * 2}))
    return trl.GRPOTrainer, trl.GRPOConfig(
        str(out), num_generations=2, max_completion_length=6, **common), dict(
            train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS * 2}),
            reward_funcs=distinct_letters)


def train(kind, out, *, patched, use_peft, mixin=None, steps=2, resume=None, seed=0,
          **config):
    """Trains a seeded tiny Llama with trl's ``kind`` trainer; returns (trainer, logged
    losses, each trainable parameter's change). ``patched``: memkern.patch first (with
    ``mixin``: the mixin patches). ``mixin``: keyword arguments of MemkernTrainerMixin, whose
    optimizer then steps the model."""
    torch.manual_seed(seed)
    model = tiny_llama()
    cls, args, kwargs = trainer_setup(kind, out, steps, **config)
    if kind == "dpo" and not use_peft:  # the reference: a copy (with PEFT: adapters off)
        kwargs["ref_model"] = copy.deepcopy(model)
        if patched:
            mk.patch(kwargs["ref_model"])
    if use_peft:
        kwargs["peft_config"] = lora()
    if mixin is not None:
        cls = type(f"Memkern{cls.__name__}", (MemkernTrainerMixin, cls), {})
        kwargs.update(mixin, patch=patched)
    elif patched:
        mk.patch(model)
    trainer = cls(model=model, args=args, processing_class=tokenizer(), **kwargs)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
              if p.requires_grad}
    trainer.train(resume_from_checkpoint=resume)
    losses = torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h],
                          dtype=torch.float64)
    changes = [p.detach() - before[n] for n, p in trainer.model.named_parameters()
               if p.requires_grad]
    assert any(c.abs().max() > 0 for c in changes)
    return trainer, losses, changes


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core machine two threads spin against each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_same_training(got, want, tol):
    """The same logged losses, and the same parameter changes: norm-wise over all of them
    (a tensor whose change is ~0, e.g. LoRA's A after the first step, has no relative error
    of its own)."""
    (_, got_losses, got_changes), (_, want_losses, want_changes) = got, want
    torch.testing.assert_close(got_losses, want_losses, rtol=tol, atol=0)
    got_changes, want_changes = (torch.cat([c.double().flatten() for c in changes])
                                 for changes in (got_changes, want_changes))
    assert torch.linalg.vector_norm(got_changes - want_changes) < (
        tol * torch.linalg.vector_norm(want_changes))


@pytest.mark.slow
@pytest.mark.parametrize("use_peft", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("kind", ["sft", "dpo", "grpo"])
def test_trl_trainer_trains_the_patched_model_as_the_plain_one(kind, use_peft, tmp_path):
    """trl's own LM head (add_fused_lm_head: it reads lm_head.weight during the model's call)
    runs on the patched model: memkern's fused loss steps aside, memkern's layers run."""
    plain = train(kind, tmp_path, patched=False, use_peft=use_peft, bf16=False, optim="sgd")
    patched = train(kind, tmp_path, patched=True, use_peft=use_peft, bf16=False, optim="sgd")
    assert_same_training(patched, plain, TOL)
    model = patched[0].model
    assert type(model.get_output_embeddings()).__module__ == "memkern.nn.causal_lm_loss"


@pytest.mark.slow
def test_sft_trainer_with_every_default_trains_the_patched_model(tmp_path):
    """SFTConfig's defaults: bf16 autocast, gradient checkpointing, trl's chunked LM head."""
    plain = train("sft", tmp_path, patched=False, use_peft=False)
    patched = train("sft", tmp_path, patched=True, use_peft=False)
    assert plain[0].args.bf16 and plain[0].args.gradient_checkpointing
    torch.testing.assert_close(patched[1], plain[1], rtol=BF16_TOL, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("kind,use_peft,options", [
    ("sft", True, {}), ("dpo", False, {"offload": "cpu"}), ("grpo", True, {})],
    ids=["sft-lora", "dpo-full-offload", "grpo-lora"])
def test_mixin_gives_a_trl_trainer_memkerns_optimizer(kind, use_peft, options, tmp_path):
    """MemkernTrainerMixin before a trl trainer: ShardedOptimizer steps the (LoRA) parameters
    with the plain trainer's AdamW's result; SFT's default gradient checkpointing included."""
    plain = train(kind, tmp_path, patched=False, use_peft=use_peft, bf16=False)
    ours = train(kind, tmp_path, patched=True, use_peft=use_peft, mixin=options, bf16=False)
    opt = ours[0].memkern_optimizer
    assert isinstance(opt, mk.optim.ShardedOptimizer) and opt.offload == options.get("offload")
    trained = {p for p in ours[0].model.parameters() if p.requires_grad}
    assert {p for g in opt.param_groups for p in g["params"]} == trained
    assert_same_training(ours, plain, ADAMW_TOL)


@pytest.mark.slow
def test_mixin_resume_restores_the_optimizer(tmp_path):
    """SFT through the mixin: 4 steps straight (saving at 2) against 2 steps resumed from that
    checkpoint, the model initialised from another seed: the same losses and parameters. A
    fresh optimizer (moments and step count lost) would drift at once."""
    options = dict(use_peft=False, patched=True, mixin={}, steps=4, bf16=False)
    straight, losses, _ = train("sft", tmp_path, save_strategy="steps", save_steps=2,
                                **options)
    resumed, logged, _ = train("sft", tmp_path / "resumed", seed=1,
                               resume=str(tmp_path / "checkpoint-2"), **options)
    assert len(logged) == 4  # the checkpoint's 2 steps, then 2 resumed
    torch.testing.assert_close(logged[2:], losses[2:], rtol=1e-6, atol=0)
    trained = [(n, p) for n, p in straight.model.named_parameters() if p.requires_grad]
    again = dict(resumed.model.named_parameters())
    assert params_rel_err([again[n] for n, _ in trained], [p for _, p in trained]) < 1e-6


def test_mixin_after_the_trainer_is_refused():
    with pytest.raises(TypeError, match=r"MemkernTrainerMixin must come before"):
        type("Wrong", (trl.SFTTrainer, MemkernTrainerMixin), {})


def test_positional_arguments_in_another_order_are_refused():
    cls = type("MemkernDPOTrainer", (MemkernTrainerMixin, trl.DPOTrainer), {})
    with pytest.raises(TypeError, match=r"args must be a TrainingArguments .* by keyword"):
        cls(tiny_llama(), tiny_llama())  # DPOTrainer(model, ref_model, args, ...)


def test_a_model_name_is_refused():
    """trl's trainers load a model from a name; the mixin patches a model it is given."""
    cls = type("MemkernSFTTrainer", (MemkernTrainerMixin, trl.SFTTrainer), {})
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got str; load it"):
        cls(model="some/model")
