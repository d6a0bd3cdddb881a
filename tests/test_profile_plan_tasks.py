"""The planner on transformers models of every task (``memkern plan --hf MODEL --task ...``),
and a GPU script's ``torch.autocast("cuda")`` planned on the CPU stand-in.

Oracles: a real CPU run's saved-for-backward bytes (:func:`memkern.profile.saved_bytes`) under
the CPU's autocast with the same dtype; the plain and patched plans of the same step.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from memkern.profile import TrainingSetup, plan_training_step, saved_bytes
from memkern.profile.plan import on_host
from memkern.profile.workloads import TASKS, hf_config, hf_workload

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=72)
MODELS = {"causal-lm": "gpt2", "masked-lm": "bert", "sequence-classification": "xlm-roberta",
          "token-classification": "electra", "image-classification": "vit"}


def _config(task: str):
    extra = {"image_size": 16, "patch_size": 4} if task == "image-classification" else \
        {"vocab_size": 3001, "max_position_embeddings": 64}
    if task == "causal-lm":
        return hf_config("gpt2", dict(n_embd=32, n_layer=2, n_head=2, n_inner=72, vocab_size=3001,
                                      n_positions=64))
    return hf_config(MODELS[task], {**TINY, **extra, **({"embedding_size": 32} if
                                                       MODELS[task] == "electra" else {})})


@pytest.mark.parametrize("task", list(TASKS))
def test_every_task_plans_and_patch_saves_less(task):
    cfg = _config(task)
    plans = {name: plan_training_step(hf_workload(cfg, batch=2, seq=31, dtype=torch.float32,
                                                  patch=patch, optimizer="adamw", task=task),
                                      device="cpu")
             for name, patch in (("plain", None), ("patch", {}))}
    saved = {n: max(m.by_category["saved for backward"] for m in p.phase_peaks.values())
             for n, p in plans.items()}
    assert 0 < saved["patch"] < saved["plain"], saved
    model_class = getattr(transformers, TASKS[task])._model_mapping[type(cfg)]
    assert plans["patch"].description.startswith(model_class.__name__ + " memkern.patch()")


@pytest.mark.parametrize("task", ["causal-lm", "masked-lm"])
def test_plan_holds_the_parameters_of_the_model_as_built(task):
    """GPT-2's and BERT's output layers share the embeddings' weight: the plan holds each
    parameter once, as the model transformers builds from the config does (the planner builds
    it without initialising weights, which in transformers 5 also skipped the tying)."""
    cfg = _config(task)
    built = getattr(transformers, TASKS[task]).from_config(cfg)
    parameter_bytes = sum(p.numel() * 4 for p in built.parameters())  # unique, float32
    plan = plan_training_step(hf_workload(cfg, batch=2, seq=31, dtype=torch.float32,
                                          optimizer="adamw", task=task), device="cpu")
    assert plan.held["parameters"] == parameter_bytes


def test_masked_lm_plan_holds_no_logits():
    cfg = hf_config("xlm-roberta", {**TINY, "vocab_size": 20011, "max_position_embeddings": 70})
    logits = 3 * 64 * 20011 * 4
    plans = [plan_training_step(hf_workload(cfg, batch=3, seq=64, dtype=torch.float32,
                                            patch=patch, optimizer="adamw", task="masked-lm"),
                                device="cpu") for patch in (None, {})]
    plain, patched = (p.phase_peaks["forward"].allocated - p.step_start for p in plans)
    # without the compiled kernels the reference cross-entropy rows op holds three copies of
    # each logits block (the block, log_softmax's, logsumexp's temporary), the kernels one
    from memkern._extension import compiled

    assert plain > logits and patched < logits / (4 if compiled.has_cpu else 2), (
        plain, patched, logits)


def _xlmr_step(cfg, device_type: str | None, dtype=torch.bfloat16):
    def build() -> TrainingSetup:
        with on_host():
            model = transformers.XLMRobertaForSequenceClassification(cfg)
        model.train()
        opt = torch.optim.AdamW(model.parameters())
        ids = torch.randint(3, cfg.vocab_size, (2, 29))
        labels = torch.randint(0, 2, (2,))

        def step():
            with torch.autocast(device_type or "cpu", dtype=dtype, enabled=device_type is not None):
                loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        return TrainingSetup(model, opt, step)
    return build


def test_cuda_autocast_of_a_gpu_script_is_planned_as_the_cpus_autocast():
    cfg = hf_config("xlm-roberta", {**TINY, "vocab_size": 3001, "max_position_embeddings": 64})
    cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = 0.0
    saved = {}
    for name, device_type in (("fp32", None), ("amp", "cuda")):
        plan = plan_training_step(_xlmr_step(cfg, device_type), device="cuda")
        saved[name] = plan.phase_peaks["forward"].by_category["saved for backward"]
    assert saved["amp"] < saved["fp32"], saved
    # the real CPU run under the CPU's autocast saves what the cuda plan's step does
    model = transformers.XLMRobertaForSequenceClassification(cfg).train()
    ids, labels = torch.randint(3, 3001, (2, 29)), torch.randint(0, 2, (2,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        real_amp = saved_bytes(lambda: model(input_ids=ids, labels=labels).loss)
    real_fp32 = saved_bytes(lambda: model(input_ids=ids, labels=labels).loss)
    assert real_amp / real_fp32 == pytest.approx(saved["amp"] / saved["fp32"], rel=0.1)


def test_plan_command_task_needs_hf():
    proc = subprocess.run([sys.executable, "-m", "memkern.cli", "plan", "--task", "masked-lm"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--task" in proc.stderr and "--hf" in proc.stderr, proc.stderr
