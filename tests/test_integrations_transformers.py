"""MemkernTrainer against plain ``transformers.Trainer`` on tiny GPT-2 and Llama models built
from configs (nothing downloaded): the loss curve over 30 optimizer steps with gradient
accumulation (including a short window at each epoch's end), clipping and an LR schedule;
the measured peak memory; checkpoint save and resume; state dicts between patched and plain
models; what plain Trainer does with a memkern optimizer.

The tolerances are measured: over 30 steps the fp32 curves differ by at most 2.6e-7 relative
(the same math, regrouped), the bf16 ones by at most 3.2e-3 (bf16 weights against autocast
over fp32 weights, and a loss reported in bf16 by memkern's fused loss), on this machine.
"""
import contextlib
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)
from transformers.utils import is_accelerate_available  # noqa: E402

import memkern as mk  # noqa: E402
from memkern.integrations.transformers import (  # noqa: E402
    COMPLETE,
    MemkernTrainer,
    last_complete_checkpoint,
)
from memkern.profile import memory_breakdown  # noqa: E402
from memkern.profile.allocations import allocation_stats  # noqa: E402

VOCAB, SEQ = 256, 64
BATCH, WINDOW, MICRO_BATCHES_PER_EPOCH = 8, 2, 5  # windows of 2, 2, 1 micro-batches
STEPS = 30


def tiny_gpt2() -> torch.nn.Module:
    return GPT2LMHeadModel(GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def tiny_llama() -> torch.nn.Module:
    return LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=176, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, bos_token_id=0,
        eos_token_id=0, pad_token_id=0))


MODELS = {"gpt2": tiny_gpt2, "llama": tiny_llama}


class Sequences(torch.utils.data.Dataset):
    """Arithmetic token sequences (learnable), with padding labels (-100) at random tails so
    that the micro-batches of a window hold different numbers of tokens."""

    def __init__(self, n: int, seed: int, seq: int = SEQ) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 5, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(seq)) % VOCAB
        self.labels = self.ids.clone()
        cut = torch.randint(seq // 2, seq + 1, (n,), generator=g)
        self.labels[torch.arange(seq) >= cut[:, None]] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def recording(cls):
    """``cls`` recording each micro-batch's loss as Trainer computed it."""

    class Recording(cls):
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            self.losses.append(loss.detach().double().item())
            return loss

    return Recording


@contextlib.contextmanager
def one_thread():
    """One intra-op thread: on a shared 2-core machine two threads spin against each other
    and these tiny ops run ~50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


NO_ACCELERATE = ("transformers' Trainer and TrainingArguments need accelerate, which is not "
                 "installed here (or older than transformers requires): pip install -U accelerate")


def arguments(out, steps=STEPS, batch=BATCH, **overrides) -> TrainingArguments:
    """The runs' TrainingArguments; skips the test without accelerate, as transformers then
    refuses to build them."""
    if not is_accelerate_available():
        pytest.skip(NO_ACCELERATE)
    settings = dict(max_steps=steps, per_device_train_batch_size=batch,
                    gradient_accumulation_steps=WINDOW, learning_rate=3e-3, weight_decay=0.01,
                    max_grad_norm=0.5, lr_scheduler_type="linear", warmup_steps=3,
                    logging_steps=10, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                    disable_tqdm=True, dataloader_num_workers=0)
    settings.update(overrides)
    return TrainingArguments(str(out), **settings)


def train(cls, model_name, out, seed, steps=STEPS, seq=SEQ, batch=BATCH, **overrides):
    """Trains a fresh seeded model; returns (trainer, losses, measured peak bytes). The peak
    is the persistent bytes (parameters, gradients, master weights, optimizer state) once the
    optimizer exists plus the largest allocation above them during training (the profiler's
    CPU allocation trace)."""
    torch.manual_seed(seed)
    model = MODELS[model_name]()
    trainer = recording(cls)(
        model=model, args=arguments(out, steps, batch, seed=seed, **overrides),
        train_dataset=Sequences(batch * MICRO_BATCHES_PER_EPOCH, seed, seq))
    trainer.losses = []
    # Built before the trace: memkern moves the weights into flat storage here, and the
    # trace cannot see the old storage being freed (allocated before it started).
    trainer.create_optimizer()
    persistent = memory_breakdown(model, getattr(trainer, "memkern_optimizer",
                                                 trainer.optimizer)).total
    stats = allocation_stats(trainer.train)
    return trainer, torch.tensor(trainer.losses, dtype=torch.float64), persistent + stats.peak


@pytest.mark.slow
@pytest.mark.parametrize("model_name,optim", [("gpt2", "adamw_torch"), ("llama", "sgd")])
def test_trainer_follows_plain_trainer_in_less_memory(model_name, optim, tmp_path):
    """fp32, accumulation over 2 micro-batches with a 1-micro-batch window at every epoch's
    end, clipping active (max_grad_norm 0.5 is below the early gradient norms), linear
    warm-up/decay. SGD makes any error in the window's normalisation visible in the update."""
    seed = int(torch.randint(0, 2**16, ()))
    overrides = {"optim": optim, "learning_rate": 3e-3 if optim != "sgd" else 1.0}
    with one_thread():
        plain, reference, plain_peak = train(Trainer, model_name, tmp_path / "a", seed,
                                             **overrides)
        memkern, losses, memkern_peak = train(MemkernTrainer, model_name, tmp_path / "b", seed,
                                              **overrides)
    assert memkern.state.global_step == plain.state.global_step == STEPS
    assert len(losses) == len(reference) == STEPS // 3 * MICRO_BATCHES_PER_EPOCH
    # it trains: each window's losses sum to its mean loss; the last window is 1 long
    assert reference[-1] < 0.9 * reference[:WINDOW].sum()
    assert ((losses - reference).abs() / reference.abs()).max() < 1e-5
    opt = memkern.memkern_optimizer
    assert isinstance(opt, mk.optim.ShardedOptimizer) and opt.max_grad_norm == 0.5
    assert opt.accumulation_steps in (1, WINDOW)  # the last window of an epoch is 1 long
    print(f"{model_name} fp32 peak: Trainer {plain_peak} B, MemkernTrainer {memkern_peak} B "
          f"({memkern_peak / plain_peak:.2f}x); loss rel. diff "
          f"{((losses - reference).abs() / reference.abs()).max():.1e}")
    assert memkern_peak < plain_peak, (memkern_peak, plain_peak)


@pytest.mark.slow
@pytest.mark.skipif(not mk.compiled.has_cpu, reason=(
    "the peak bound is the compiled kernels': on the reference backend (no extension) "
    "MemkernTrainer's bf16 peak was 5.3 MB against plain Trainer's 3.6 MB, the reference ops' "
    "temporaries (MEMKERN_DISABLE_EXT=1 sweep)"))
def test_bf16_trainer_follows_plain_bf16_trainer(tmp_path):
    """bf16: memkern keeps bf16 weights and gradients with float32 masters; plain Trainer
    autocasts over float32 weights. Fewer, shorter steps: bf16 matmuls are slow on a CPU."""
    seed = int(torch.randint(0, 2**16, ()))
    short = dict(steps=12, seq=32, batch=4, bf16=True)
    with one_thread():
        plain, reference, plain_peak = train(Trainer, "gpt2", tmp_path / "a", seed, **short)
        memkern, losses, memkern_peak = train(MemkernTrainer, "gpt2", tmp_path / "b", seed,
                                              **short)
    assert all(p.dtype == torch.bfloat16 for p in memkern.model.parameters())
    masters = [s["master_param"] for s in memkern.memkern_optimizer.state.values()]
    assert masters and all(m.dtype == torch.float32 for m in masters)
    # memkern's fused loss returns the loss in the weights' dtype: bf16 rounds it by up to
    # 2**-9 relative on top of the drift (measured max 3.2e-3; autocast's loss is float32).
    assert ((losses - reference).abs() / reference.abs()).max() < 6e-3
    print(f"gpt2 bf16 peak: Trainer {plain_peak} B, MemkernTrainer {memkern_peak} B "
          f"({memkern_peak / plain_peak:.2f}x); loss rel. diff "
          f"{((losses - reference).abs() / reference.abs()).max():.1e}")
    assert memkern_peak < plain_peak, (memkern_peak, plain_peak)


@pytest.mark.slow
def test_resume_from_checkpoint_restores_the_optimizer(tmp_path):
    """30 steps straight (saving at step 15) against 15 steps resumed from that checkpoint:
    the same losses and the same final weights. Without the optimizer's state (moments,
    step counts) the resumed run would drift at once."""
    seed = int(torch.randint(0, 2**16, ()))
    with one_thread():
        straight, losses, _ = train(MemkernTrainer, "llama", tmp_path, seed,
                                    save_strategy="steps", save_steps=15)
        torch.manual_seed(seed + 1)  # a different initialisation: the checkpoint must win
        model = tiny_llama()
        resumed = recording(MemkernTrainer)(
            model=model, args=arguments(tmp_path, seed=seed, save_strategy="no"),
            train_dataset=Sequences(BATCH * MICRO_BATCHES_PER_EPOCH, seed))
        resumed.losses = []
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-15"))
    saved = torch.load(tmp_path / "checkpoint-15" / "optimizer.pt", weights_only=True)
    assert saved["memkern"]["window"]["micro_batches"] == 0 and saved["state"]
    tail = torch.tensor(resumed.losses, dtype=torch.float64)
    torch.testing.assert_close(tail, losses[-len(tail):], rtol=1e-6, atol=0)
    for p, q in zip(model.parameters(), straight.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    for state, reference in zip(resumed.memkern_optimizer.state.values(),
                                straight.memkern_optimizer.state.values()):
        torch.testing.assert_close(state["exp_avg_sq"], reference["exp_avg_sq"],
                                   rtol=1e-5, atol=1e-12)


def test_resume_true_takes_the_newest_checkpoint_marked_complete(tmp_path):
    """A checkpoint folder without the completion marker (a save killed midway) is passed
    over, steps compare as numbers; with none complete, resume_from_checkpoint=True says so
    (tests/test_optim_kill_resume.py kills real saves)."""
    assert last_complete_checkpoint(tmp_path / "absent") is None
    for step, marked in [(2, True), (10, True), (12, False), (9, True)]:
        (tmp_path / f"checkpoint-{step}").mkdir()
        if marked:
            (tmp_path / f"checkpoint-{step}" / COMPLETE).write_text(f"{step}\n")
    with pytest.raises(ValueError, match=r"resume_from_checkpoint=True, but .* holds no "
                                         r"complete checkpoint; pass None"):
        MemkernTrainer(model=tiny_gpt2(), args=arguments(tmp_path / "empty"),
                       train_dataset=Sequences(8, 0)).train(resume_from_checkpoint=True)
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_patched_state_dict_round_trips_through_the_plain_model(model_name, tmp_path):
    """A patched model (trained one step by the flat optimizer, so its weights are views of
    one flat tensor) saves with save_pretrained, loads into a plain model with
    from_pretrained, and back; outputs agree with the plain model's."""
    torch.manual_seed(int(torch.randint(0, 2**16, ())))
    patched = mk.patch(MODELS[model_name]())
    opt = mk.optim.ShardedOptimizer(patched.parameters(), "adamw", lr=1e-2)
    ids = Sequences(3, 0).ids
    opt.backward(patched(input_ids=ids, labels=ids).loss)
    opt.step()
    patched.save_pretrained(tmp_path / "patched")
    cls = type(patched)
    plain = cls.from_pretrained(tmp_path / "patched")
    assert mk.nn.patch_report(plain).swapped == []
    for (name, a), (name_b, b) in zip(patched.state_dict().items(), plain.state_dict().items()):
        assert name == name_b and torch.equal(a, b), name
    torch.testing.assert_close(patched(input_ids=ids).logits, plain(input_ids=ids).logits,
                               rtol=1e-5, atol=1e-5)
    plain.save_pretrained(tmp_path / "plain")
    again = mk.patch(cls.from_pretrained(tmp_path / "plain"))
    fresh = mk.patch(MODELS[model_name]())
    fresh.load_state_dict(plain.state_dict())
    for a, b, c in zip(again.state_dict().values(), fresh.state_dict().values(),
                       plain.state_dict().values()):
        assert torch.equal(a, c) and torch.equal(b, c)


def test_plain_trainer_with_a_memkern_optimizer_is_refused(tmp_path):
    """Plain Trainer calls loss.backward() (through accelerate): the first step says what to
    use instead rather than stepping on unscaled, uncounted gradients."""
    torch.manual_seed(0)
    model = tiny_gpt2()
    opt = mk.optim.ShardedOptimizer(model.parameters(), "adamw", lr=1e-3)
    trainer = Trainer(model=model, args=arguments(tmp_path, steps=2, max_grad_norm=0.0),
                      train_dataset=Sequences(BATCH * 3, 0), optimizers=(opt, None))
    with one_thread(), pytest.raises(RuntimeError, match="MemkernTrainer"):
        trainer.train()


@pytest.mark.parametrize("overrides,error,needle", [
    ({"optim": "adafactor"}, ValueError, "optim='adafactor' has no memkern equivalent"),
    ({"max_grad_norm": 2.0}, ValueError, "max_grad_norm=1.0 differs"),
    ({"gradient_accumulation_steps": 5, "max_grad_norm": 1.0}, ValueError,
     f"accumulation_steps={WINDOW} differs"),
], ids=["optim", "clipping", "window"])
def test_bad_settings_are_named(overrides, error, needle, tmp_path):
    model = tiny_gpt2()
    given = None
    if "optim" not in overrides:
        given = mk.optim.ShardedOptimizer(model.parameters(), "adamw", lr=1e-3,
                                          accumulation_steps=WINDOW, max_grad_norm=1.0)
    trainer = MemkernTrainer(model=model, args=arguments(tmp_path, **overrides),
                             train_dataset=Sequences(8, 0), optimizers=(given, None))
    with pytest.raises(error, match=needle):
        trainer.create_optimizer()


def test_model_is_required():
    with pytest.raises(ValueError, match="pass model="):
        MemkernTrainer(model_init=tiny_gpt2)


def test_runs_without_transformers_installed_elsewhere():
    """memkern itself never imports transformers (the integration is imported on demand)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['transformers'] = None; import memkern; "
            "import memkern.integrations; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ), timeout=300)
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_skips_with_the_reason_without_accelerate():
    """In a process where accelerate cannot be imported, the tests that build a Trainer are
    skipped with the reason and the others still run: no ImportError. (peft needs accelerate,
    and transformers imports it when it is there: it goes too.)"""
    import subprocess
    import sys

    code = ("import sys; sys.modules['accelerate'] = sys.modules['peft'] = None; "
            "import pytest; sys.exit(pytest.main(sys.argv[1:]))")
    tests = "test_bad_settings_are_named or test_model_is_required"
    proc = subprocess.run([sys.executable, "-c", code, "-q", "-rs", "-p", "no:cacheprovider",
                           __file__, "-k", tests], capture_output=True, text=True,
                          cwd=os.path.dirname(__file__), timeout=300)
    summary = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 0 and "1 passed" in summary and "skipped" in summary, proc.stdout
    assert "need accelerate, which is not installed" in proc.stdout


def test_fp16_overflow_skips_hold_the_scheduler(tmp_path):
    """fp16 weights with dynamic loss scaling: started at a scale of 2**22, the first windows
    overflow and are skipped (the scale halving each time); the LR scheduler advances on the
    other steps only, as plain Trainer's GradScaler path does."""
    torch.manual_seed(int(torch.randint(0, 2**16, ())))
    model = tiny_gpt2()
    trainer = MemkernTrainer(model=model, args=arguments(tmp_path, steps=10, batch=2, fp16=True,
                                                         warmup_steps=0),
                             train_dataset=Sequences(2 * MICRO_BATCHES_PER_EPOCH, 0, seq=16))
    opt = trainer.create_optimizer()
    opt.scaler.load_state_dict({**opt.scaler.state_dict(), "scale": 2.0**22})
    with one_thread():
        trainer.train()
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert opt.scaler.dynamic and 0 < opt.skipped_steps < 10
    assert opt.loss_scale == 2.0**22 / 2**opt.skipped_steps
    assert trainer.lr_scheduler.last_epoch == trainer.state.global_step - opt.skipped_steps
    assert all(torch.isfinite(p).all() for p in model.parameters())
