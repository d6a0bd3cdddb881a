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
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

from trl.kernels import ChunkedLogProbFunction  # noqa: E402

import memkern as mk  # noqa: E402
from compare import params_rel_err, rel_err  # noqa: E402
from memkern.integrations import trl as trl_head  # noqa: E402
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
          head=None, dtype=torch.float32, **config):
    """Trains a seeded tiny Llama with trl's ``kind`` trainer; returns (trainer, logged
    losses, each trainable parameter's change). ``patched``: memkern.patch first (with
    ``mixin``: the mixin patches). ``mixin``: keyword arguments of MemkernTrainerMixin, whose
    optimizer then steps the model. ``head``: a function given the built trainer (e.g.
    use_memkern_head); ``dtype``: the model's."""
    torch.manual_seed(seed)
    model = tiny_llama().to(dtype)
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
    if head is not None:
        head(trainer)
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


# ----------------------------------------------------------------------------------------------
# memkern's per-token log-prob head in trl's fused forward (memkern.integrations.trl)

ALL_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
HEAD_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")


class Float64Head:
    """The oracle head: trl's head's outputs over the whole logits in float64, plain torch
    (``(scale * z)`` soft-capped, over the temperature; entropy ``-sum p log p``; argmax)."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap=None,
              logit_scale=1.0, outputs=ALL_OUTPUTS):
        z = F.linear(hidden.double(), weight.double(), None if bias is None else bias.double())
        z = z * logit_scale
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        z = z / temperature
        logp = torch.log_softmax(z, -1)
        ask = {"log_probs": logp.gather(-1, targets[:, None])[:, 0],
               "entropy": -(logp.exp() * logp).sum(-1),
               "log_sum_sq_probs": torch.logsumexp(2 * logp, -1).detach(),
               "mean_logits": z.detach().mean(-1), "is_top1": z.argmax(-1) == targets}
        return tuple(ask[name] if name in outputs else None for name in ALL_OUTPUTS)


@pytest.mark.parametrize("settings", [
    dict(temperature=1.0, logit_scale=1.0, softcap=None, bias=False),
    dict(temperature=0.7, logit_scale=1.0, softcap=None, bias=True),
    dict(temperature=0.6, logit_scale=0.5, softcap=4.0, bias=True),
], ids=["plain", "temperature-bias", "temperature-scale-softcap"])
def test_memkern_head_matches_trls_and_float64(settings):
    """MemkernLogProbHead.apply (what trl's fused forward calls once swapped) against trl's
    ChunkedLogProbFunction and the float64 oracle: every output trl's trainers ask for, and
    the gradients of g1 * log_probs + g2 * entropy. 41 tokens of 333 classes (memkern: chunks
    of 8 tokens, blocks of 64 classes; trl: tiles of 128)."""
    gen = torch.Generator().manual_seed(3)
    n, v, h = 41, 333, 16
    x = torch.randn(n, h, generator=gen)
    w = torch.randn(v, h, generator=gen) * 0.5
    t = torch.randint(0, v, (n,), generator=gen)
    t[::3] = (x[::3] @ w.T).argmax(1)  # a third of the tokens top-1
    b = torch.randn(v, generator=gen) * 0.1 if settings["bias"] else None
    args = (settings["temperature"], 128, settings["softcap"], settings["logit_scale"])
    g1, g2 = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    results = {}
    for name, head in (("memkern", trl_head.MemkernLogProbHead), ("trl", ChunkedLogProbFunction),
                       ("float64", Float64Head)):
        leaves = [a.clone().requires_grad_() for a in (x, w) + ((b,) if b is not None else ())]
        with mock.patch.dict("os.environ", {"MEMKERN_LCE_CHUNK": "8",
                                            "MEMKERN_LCE_VOCAB_BLOCK": "64"}):
            out = head.apply(leaves[0], leaves[1], leaves[2] if b is not None else None, t,
                             *args, HEAD_OUTPUTS)
        grads = torch.autograd.grad((g1.double() * out[0]).sum() + (g2.double() * out[1]).sum(),
                                    leaves)
        results[name] = (out, grads)
    (want, want_grads) = results["float64"]
    for name in ("memkern", "trl"):
        out, grads = results[name]
        assert out[2] is None
        for k in (0, 1, 3):
            assert rel_err(out[k].double(), want[k]) < 2e-5, (name, k)
        assert torch.equal(out[4], want[4]), name
        for g, ref in zip(grads, want_grads):
            assert rel_err(g.double(), ref) < 2e-5, name


def test_memkern_head_leaves_wpo_to_trl():
    """log_sum_sq_probs (DPO's WPO weighting), which memkern's loops do not compute: trl's
    head runs, and gives it."""
    x, w, t = torch.randn(5, 8), torch.randn(11, 8), torch.randint(0, 11, (5,))
    got = trl_head.MemkernLogProbHead.apply(x, w, None, t, 1.0, 16, None, 1.0, ALL_OUTPUTS)
    want = ChunkedLogProbFunction.apply(x, w, None, t, 1.0, 16, None, 1.0, ALL_OUTPUTS)
    for a, c in zip(got, want):
        assert torch.equal(a, c)


class GradRecorder(transformers.TrainerCallback):
    """Appends the trained parameters' gradients to ``into`` before each optimizer step."""

    def __init__(self, trainer, into: list) -> None:
        self.trainer, self.into = trainer, into

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.into.append([p.grad.detach().double().clone()
                          for p in self.trainer.model.parameters() if p.requires_grad])


def _logged(trainer) -> dict[str, torch.Tensor]:
    """Every logged number that is the model's (not a time, step or epoch), by name."""
    skip = ("runtime", "per_second", "epoch", "step", "flos", "learning_rate")
    names = {k for h in trainer.state.log_history for k in h if not any(s in k for s in skip)}
    return {k: torch.tensor([h[k] for h in trainer.state.log_history if k in h],
                            dtype=torch.float64) for k in sorted(names)}


@pytest.mark.slow
@pytest.mark.parametrize("kind,config", [
    ("sft", {}), ("dpo", {}),
    ("grpo", {"entropy_coef": 0.5, "top_entropy_quantile": 0.5})],
    ids=["sft", "dpo", "grpo-entropy-bonus"])
def test_trainers_with_memkerns_head(kind, config, tmp_path):
    """A step of SFT, DPO (with its reference model) and GRPO (its entropy bonus
    differentiating the entropy, its high-entropy mask) with memkern's head: every logged loss
    and metric (entropy, token accuracy, logits and log-probabilities, rewards) equal to trl's
    own head's within float32 rounding, and the step — SGD: the gradient — against a float64
    model with a plain torch head over the whole logits."""
    options = dict(patched=False, use_peft=False, bf16=False, optim="sgd", steps=1,
                   max_grad_norm=0.0, **config)
    grads = {}

    def memkern_head(name):
        def swap(trainer):
            trl_head.use_memkern_head(trainer)
            trainer.add_callback(GradRecorder(trainer, grads.setdefault(name, [])))
        return swap

    ours = train(kind, tmp_path, head=memkern_head("memkern"), **options)
    theirs = train(kind, tmp_path, **options)
    with mock.patch.object(trl_head, "MemkernLogProbHead", Float64Head):
        train(kind, tmp_path, head=memkern_head("float64"), dtype=torch.float64, **options)
    swapped = trl_head.use_memkern_head(ours[0])  # again: nothing changes
    assert swapped and all(m.forward.__func__.__globals__["_ChunkedLogProbFunction"]
                           is trl_head.MemkernLogProbHead for m in swapped)
    got, want = _logged(ours[0]), _logged(theirs[0])
    assert got.keys() == want.keys() and "loss" in got
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=2e-5, atol=1e-6, msg=name)
    (mine,), (exact,) = grads["memkern"], grads["float64"]
    assert params_rel_err(mine, exact) < 1e-4
