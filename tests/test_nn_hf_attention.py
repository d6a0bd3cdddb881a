"""memkern.patch's attention (:mod:`memkern.nn.hf_attention`): transformers' SDPA attention with
the ``[b, h, t, t]`` probabilities recomputed in backward.

Oracles: the unpatched model in float64, with attention dropout on and the same seed (the
recomputation must draw the forward's mask: any other mask changes the gradients), and with
dropout off through the recomputing path; for the dropout itself, uniform probabilities
(``q = k = 0``) times an identity ``value`` make the output the dropped probability matrix,
whose zeros, scale and gradient are checked against float64 torch ops.
"""
from __future__ import annotations

import copy
import math
import pickle
import subprocess
import sys

import pytest
import torch

import memkern as mk
from compare import rel_err
from memkern.nn import hf_attention
from memkern.profile import SavedTensorsRecorder

transformers = pytest.importorskip("transformers")

D, T = 24, 21


def _model(family: str, attention_dropout: float):
    if family == "vit":
        cfg = transformers.AutoConfig.for_model(
            "vit", hidden_size=D, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=40, image_size=12, patch_size=4, num_labels=3,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=attention_dropout)
        return transformers.ViTForImageClassification(cfg)
    cfg = transformers.AutoConfig.for_model(
        family, hidden_size=D, num_hidden_layers=2, num_attention_heads=2, intermediate_size=40,
        vocab_size=67, max_position_embeddings=T + 3, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=attention_dropout)
    return transformers.AutoModelForSequenceClassification.from_config(cfg)


def _batch(family: str, g: torch.Generator) -> dict:
    labels = torch.randint(0, 3, (3,), generator=g)
    if family == "vit":
        return dict(pixel_values=torch.randn(3, 3, 12, 12, generator=g, dtype=torch.float64),
                    labels=labels)
    mask = torch.ones(3, T, dtype=torch.long)
    mask[1, -5:] = 0  # padding: an additive mask reaches the attention
    return dict(input_ids=torch.randint(3, 67, (3, T), generator=g), attention_mask=mask,
                labels=labels)


def _loss_and_grads(model, batch, seed):
    torch.manual_seed(seed)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(model, ref, batch):
    seed = int(torch.randint(0, 2**31, ()))
    loss, grads = _loss_and_grads(model, batch, seed)
    ref_loss, ref_grads = _loss_and_grads(ref, batch, seed)
    assert rel_err(loss, ref_loss) < 1e-12
    assert grads.keys() == ref_grads.keys()
    for n, g in grads.items():
        assert torch.allclose(g, ref_grads[n], rtol=1e-10, atol=1e-14), n


@pytest.mark.parametrize("family", ["bert", "xlm-roberta", "vit"])
def test_dropout_on_equals_the_unpatched_model_and_keeps_no_probabilities(family):
    torch.manual_seed(0)
    ref = _model(family, attention_dropout=0.3).double().train()
    model = mk.patch(copy.deepcopy(ref), dropout=False)  # torch's dropout elsewhere: same draws
    assert ref.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == hf_attention.NAME
    batch = _batch(family, torch.Generator().manual_seed(1))
    _assert_same(model, ref, batch)
    tokens = 10 if family == "vit" else T
    with SavedTensorsRecorder() as rec:
        model(**batch)
    kept = [e for e in rec.entries.values() if tuple(e.shape[-2:]) == (tokens, tokens)]
    assert all(e.dtype == torch.bool and e.shape[1] == 1 for e in kept), kept  # the mask only


def test_dropout_off_through_the_recomputing_path_equals_the_unpatched_model(monkeypatch):
    torch.manual_seed(0)
    ref = _model("bert", attention_dropout=0.0).double().train()
    model = mk.patch(copy.deepcopy(ref))
    calls = []

    def always(*args):
        calls.append(args)
        return True
    monkeypatch.setattr(hf_attention, "_sdpa_keeps_probabilities", always)
    _assert_same(model, ref, _batch("bert", torch.Generator().manual_seed(2)))
    assert len(calls) == 2  # one per layer: the recomputing path ran


def test_dropout_drops_a_p_fraction_and_backward_uses_the_forward_mask():
    p, b, h, t = 0.3, 2, 3, 37
    module = torch.nn.Module()
    q = torch.zeros(b, h, t, t, dtype=torch.float64, requires_grad=True)
    k = torch.zeros(b, h, t, t, dtype=torch.float64)
    v = torch.eye(t, dtype=torch.float64).expand(b, h, t, t).clone().requires_grad_()
    out, _ = hf_attention.sdpa_attention_forward(module, q, k, v, None, dropout=p,
                                                 is_causal=False)
    dropped = out.transpose(1, 2)  # [b, h, t, t]: the dropped probabilities themselves
    kept = dropped != 0
    frac = 1 - kept.double().mean().item()
    assert abs(frac - p) < 5 * math.sqrt(p * (1 - p) / kept.numel()), frac
    assert rel_err(dropped[kept], torch.full_like(dropped[kept], 1 / (t * (1 - p)))) < 1e-14
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, v, g)[0]
    want = dropped.transpose(-1, -2) @ g.transpose(1, 2)  # d(P @ V)/dV with the forward's P
    assert rel_err(got, want) < 1e-12


def test_install_needs_sdpa_and_patch_reports_it():
    eager = _model("bert", 0.1)
    eager.set_attn_implementation("eager")
    mk.patch(eager)
    assert eager.config._attn_implementation == "eager"
    assert any("attention not recomputed" in why for _, why in mk.nn.patch_report(eager).skipped)
    off = mk.patch(_model("bert", 0.1), attention=False)
    assert off.config._attn_implementation == "sdpa"
    model = mk.patch(mk.patch(_model("bert", 0.1)))
    assert sum("attention" in old for _, old, _ in mk.nn.patch_report(model).swapped) == 1


def test_patched_model_unpickles_in_a_new_process_with_its_attention(tmp_path):
    model = mk.patch(_model("bert", 0.1))
    path = tmp_path / "model.pt"
    path.write_bytes(pickle.dumps(model))
    code = ("import pickle, sys, torch; m = pickle.loads(open(sys.argv[1], 'rb').read()).train(); "
            "print(m.config._attn_implementation, "
            "m(input_ids=torch.randint(3, 60, (2, 9))).logits.shape[-1])")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [hf_attention.NAME, "3"]


def test_a_gpu_step_planned_on_the_cpu_keeps_sdpa_as_a_gpu_runs_it():
    """A GPU's SDPA applies dropout in its fused kernels: a plan for one must not recompute."""
    q = torch.randn(2, 3, 9, 5, requires_grad=True)
    assert hf_attention._sdpa_keeps_probabilities(q, q, q, None, 0.1, False, None)
    with mk.backend.planning_for("cuda"):
        assert not hf_attention._sdpa_keeps_probabilities(q, q, q, None, 0.1, False, None)
