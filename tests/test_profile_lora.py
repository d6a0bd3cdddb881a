"""Planning a LoRA fine-tune (``memkern plan`` / ``memkern fit --lora``: the options, PEFT's
adapters on the planned model, the optimizer on the adapters only).

Oracles, by hand: the options the text names; the adapters' parameter count of the planned
Llama (r × (in + out) per adapted linear layer), whose AdamW state is 8 bytes per parameter
(two float32 moments: PEFT keeps a bf16 model's adapters in float32) and a float32 step per
tensor, all the optimizer state there is (none for the frozen base weights).
"""
from __future__ import annotations

import re

import pytest
import torch

from memkern.profile import hf_config, hf_workload, plan_training_step
from memkern.profile.workloads import lora_options

pytest.importorskip("peft")

HIDDEN, INTERMEDIATE, KV, LAYERS, R = 64, 96, 32, 2, 4


def test_lora_options():
    assert lora_options("") == {"r": 16, "alpha": 32, "dropout": 0.0, "targets": "all-linear"}
    assert lora_options("r=8,dropout=0.05,targets=q_proj+v_proj") == {
        "r": 8, "alpha": 32, "dropout": 0.05, "targets": "q_proj+v_proj"}
    for text, needle in (("rank=8", "key one of r, alpha"), ("r=eight", "not a number"),
                         ("r=0", "r must be at least 1"), ("dropout=1", "dropout in [0, 1)")):
        with pytest.raises(ValueError, match=re.escape(needle)):
            lora_options(text)


def _plan(patch, lora):
    config = hf_config("llama", dict(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                     num_hidden_layers=LAYERS, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=97))
    return plan_training_step(hf_workload(config, batch=2, seq=32, dtype=torch.bfloat16,
                                          patch=patch, lora=lora), device="cpu")


def test_a_lora_plan_steps_the_adapters_only():
    lora = lora_options(f"r={R}")
    # q, o: HIDDEN -> HIDDEN; k, v: HIDDEN -> KV (2 of 4 heads); gate, up: HIDDEN ->
    # INTERMEDIATE; down: INTERMEDIATE -> HIDDEN
    pairs = [(HIDDEN, HIDDEN)] * 2 + [(HIDDEN, KV)] * 2 + [(HIDDEN, INTERMEDIATE)] * 2 + [
        (INTERMEDIATE, HIDDEN)]
    adapters = LAYERS * sum(R * (i + o) for i, o in pairs)
    state = 8 * adapters + 4 * LAYERS * 2 * len(pairs)  # and fused AdamW's float32 step per A, B
    plain, patched = _plan(None, lora), _plan({}, lora)
    for plan in (plain, patched):
        assert plan.peak.by_category["optimizer state"] == state
    assert patched.peak_bytes < plain.peak_bytes
