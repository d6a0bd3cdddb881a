"""memkern.patch with PEFT's LoRA, end to end, on a config-built Llama (nothing downloaded): patch
before or after ``get_peft_model``.

Oracles: the unpatched PEFT model in float64 (loss and every trainable parameter's gradient),
for LoRA, DoRA, ``modules_to_save`` and an adapter on ``lm_head``; for saved bytes, the patched
model training the seven projections' weights directly (the adapters must add nothing); plain
PEFT's own ``merge_and_unload`` weights and ``save_pretrained`` files (exactly equal); the other
order
(the same module classes, the same saved bytes, the same losses and gradients under one seed
with adapter dropout on); a 4-bit-like base layer (an ``nn.Linear`` subclass with its own
forward, as bitsandbytes' ``Linear4bit`` is) left alone and still called; QLoRA with
bitsandbytes' own 4-bit layers where bitsandbytes is installed (plain PEFT on the same quantized
model, float32).
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memkern as mk
from compare import rel_err
from conftest import needs_layer_extension
from memkern.profile import saved_bytes

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TOL = 5e-5  # float32 against float64: plain PEFT in float32 is 1.3e-5 off on these gradients
VOCAB = 61
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16, bos_token_id=0,
        eos_token_id=0, pad_token_id=0, attn_implementation="sdpa")).train()


def _config(**kw):
    return peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
                              "target_modules": PROJECTIONS, "init_lora_weights": False} | kw)


def _batch():
    ids = torch.randint(1, VOCAB, (2, 9))
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def _variants(**kw):
    """plain PEFT, its float64 copy, patch-then-peft and peft-then-patch, one adapter's weights."""
    base = _llama()
    plain = peft.get_peft_model(copy.deepcopy(base), _config(**kw))
    before = peft.get_peft_model(mk.patch(copy.deepcopy(base)), _config(**kw))
    after = mk.patch(peft.get_peft_model(copy.deepcopy(base), _config(**kw)))
    for model in (before, after):
        model.load_state_dict(plain.state_dict())
    return plain, copy.deepcopy(plain).double(), {"patch-then-peft": before,
                                                   "peft-then-patch": after}


def _loss_and_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _check_against_oracle(oracle, patched):
    ids, labels = _batch()
    want_loss, want = _loss_and_grads(oracle, ids, labels)
    for order, model in patched.items():
        loss, grads = _loss_and_grads(model, ids, labels)
        assert rel_err(loss, want_loss) < TOL, order
        assert grads.keys() == want.keys(), order
        for name, g in grads.items():
            assert g is not None and rel_err(g, want[name]) < TOL, (order, name)


def _classes(model):
    return {n.removeprefix("base_model.model."): type(m) for n, m in model.named_modules()
            if n.startswith("base_model.model.")}


@needs_layer_extension
def test_either_order_same_layers_same_memory_and_float64_gradients():
    plain, oracle, patched = _variants()
    before, after = patched.values()
    assert _classes(before) == _classes(after)
    wrapper = before.base_model.model.model.layers[0].self_attn.q_proj
    assert type(wrapper).__name__.startswith("Memkern__") and isinstance(
        wrapper, peft.tuners.lora.Linear)
    assert type(wrapper.base_layer) is mk.nn.Linear
    assert type(wrapper.lora_A["default"]) is nn.Linear  # read, not swapped
    reported = {n for n, _, _ in mk.nn.patch_report(before).swapped}
    assert "model.layers.0.self_attn.q_proj" in " ".join(reported)  # named within the model
    ids, labels = _batch()
    saved = {order: saved_bytes(lambda m=m: m(input_ids=ids, labels=labels).loss)
             for order, m in patched.items()}
    # the adapters keep nothing beyond what the patched model keeps to train the seven
    # projections' weights themselves (the rest frozen)
    direct = mk.patch(_llama()).requires_grad_(False)
    for name, p in direct.named_parameters():
        p.requires_grad_(name.split(".")[-2] in PROJECTIONS)
    assert saved["patch-then-peft"] == saved["peft-then-patch"] == saved_bytes(
        lambda: direct(input_ids=ids, labels=labels).loss)
    assert saved["patch-then-peft"] < 0.65 * saved_bytes(  # 0.61 here, 0.49 at 4 x 512 tokens
        lambda: plain(input_ids=ids, labels=labels).loss)
    _check_against_oracle(oracle, patched)


@needs_layer_extension
def test_dora_gradients_equal_float64():
    _, oracle, patched = _variants(use_dora=True)
    _check_against_oracle(oracle, patched)


@needs_layer_extension
def test_modules_to_save_gradients_equal_float64():
    _, oracle, patched = _variants(modules_to_save=["lm_head"])
    _check_against_oracle(oracle, patched)


@needs_layer_extension
def test_an_adapter_on_lm_head_gets_its_gradient():
    """The fused loss would read the head's weight and skip the adapter: the head's logits and
    loss are computed as without memkern, and the report says so."""
    _, oracle, patched = _variants(target_modules=PROJECTIONS + ["lm_head"])
    for model in patched.values():
        assert any("LoRA adapter" in why for _, why in mk.nn.patch_report(model).skipped)
    _check_against_oracle(oracle, patched)
    for model in patched.values():
        head = model.base_model.model.lm_head
        assert head.lora_A["default"].weight.grad.abs().sum() > 0


@needs_layer_extension
def test_adapter_dropout_draws_the_same_in_either_order():
    _, _, patched = _variants(lora_dropout=0.2)
    ids, labels = _batch()
    results = []
    for model in patched.values():
        torch.manual_seed(7)
        results.append(_loss_and_grads(model, ids, labels))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    torch.manual_seed(8)
    assert not torch.equal(_loss_and_grads(patched["patch-then-peft"], ids, labels)[0], loss_a)


@needs_layer_extension
def test_merge_and_unload_gives_plain_peft_weights():
    plain, _, patched = _variants()
    ids, _ = _batch()
    want = plain.merge_and_unload().state_dict()
    for order, model in patched.items():
        with torch.no_grad():
            unmerged = model(input_ids=ids).logits
        merged = model.merge_and_unload()
        state = merged.state_dict()
        assert state.keys() == want.keys(), order
        assert all(torch.equal(state[k], want[k]) for k in want), order
        assert type(merged.model.layers[0].self_attn.q_proj) is mk.nn.Linear
        with torch.no_grad():
            assert rel_err(merged(input_ids=ids).logits, unmerged) < 1e-5


@needs_layer_extension
def test_save_and_load_the_adapter_as_plain_peft(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    plain, _, patched = _variants()
    plain.save_pretrained(tmp_path / "plain")
    want = safetensors.load_file(tmp_path / "plain" / "adapter_model.safetensors")
    for order, model in patched.items():
        model.save_pretrained(tmp_path / order)
        assert sorted(p.name for p in (tmp_path / order).iterdir()) == sorted(
            p.name for p in (tmp_path / "plain").iterdir())
        got = safetensors.load_file(tmp_path / order / "adapter_model.safetensors")
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    loaded = peft.PeftModel.from_pretrained(mk.patch(_llama()), tmp_path / "plain",
                                            is_trainable=True)
    assert _classes(loaded) == _classes(patched["patch-then-peft"])
    ids, labels = _batch()
    with torch.no_grad():
        assert rel_err(loaded(input_ids=ids, labels=labels).loss,
                       plain(input_ids=ids, labels=labels).loss) < TOL


class FourBitLikeLinear(nn.Linear):
    """Stands in for bitsandbytes' ``Linear4bit``: an ``nn.Linear`` subclass with its own
    forward (here a counted ``F.linear``), which ``patch`` must leave to its library."""

    calls = 0

    def forward(self, x):
        type(self).calls += 1
        return nn.functional.linear(x, self.weight, self.bias)


@needs_layer_extension
def test_a_four_bit_like_base_layer_is_left_alone_and_its_adapter_patched():
    base = _llama()
    for layer in base.model.layers:
        for name in ("q_proj", "v_proj"):
            old = getattr(layer.self_attn, name)
            new = FourBitLikeLinear(old.in_features, old.out_features, bias=False)
            new.weight = old.weight
            setattr(layer.self_attn, name, new)
    config = _config(target_modules=["q_proj", "v_proj"])
    plain = peft.get_peft_model(copy.deepcopy(base), config)
    oracle = copy.deepcopy(plain).double()
    patched = {"patch-then-peft": peft.get_peft_model(mk.patch(copy.deepcopy(base)), config),
               "peft-then-patch": mk.patch(peft.get_peft_model(copy.deepcopy(base), config))}
    for model in patched.values():
        model.load_state_dict(plain.state_dict())
        q = model.base_model.model.model.layers[1].self_attn.q_proj
        assert type(q.base_layer) is FourBitLikeLinear
        assert type(q).__name__.startswith("Memkern__")
    FourBitLikeLinear.calls = 0
    _check_against_oracle(oracle, patched)
    assert FourBitLikeLinear.calls == 3 * 4  # oracle and both orders, 2 layers x 2 projections


def _four_bit(model):
    """``model``'s seven projections as bitsandbytes 4-bit layers (NF4, float32 compute),
    quantized from their weights."""
    bnb = pytest.importorskip("bitsandbytes")
    for layer in model.model.layers:
        for parent, names in ((layer.self_attn, PROJECTIONS[:4]), (layer.mlp, PROJECTIONS[4:])):
            for name in names:
                old = getattr(parent, name)
                new = bnb.nn.Linear4bit(old.in_features, old.out_features, bias=False,
                                        compute_dtype=torch.float32, quant_type="nf4")
                new.load_state_dict(old.state_dict())
                setattr(parent, name, new.to("cpu"))  # quantized as it is moved
    return model


@needs_layer_extension
def test_qlora_four_bit_layers_left_to_bitsandbytes():
    """QLoRA, where bitsandbytes runs (its 4-bit layers on the CPU: 0.50): the 4-bit layers
    stay bitsandbytes', everything around them is patched; the oracle is plain PEFT on the same
    quantized model (float32: bitsandbytes has no float64)."""
    base = _four_bit(_llama())
    plain = peft.get_peft_model(copy.deepcopy(base), _config())
    patched = {"patch-then-peft": peft.get_peft_model(mk.patch(copy.deepcopy(base)), _config()),
               "peft-then-patch": mk.patch(peft.get_peft_model(copy.deepcopy(base), _config()))}
    for model in patched.values():  # the same adapters (the quantized weights are copies)
        peft.set_peft_model_state_dict(model, peft.get_peft_model_state_dict(plain))
        q = model.base_model.model.model.layers[0].self_attn.q_proj
        assert type(q.base_layer).__module__.startswith("bitsandbytes.")
        assert type(q).__name__.startswith("Memkern__")
    before, after = patched.values()
    assert _classes(before) == _classes(after)
    _check_against_oracle(plain, patched)
    ids, labels = _batch()
    saved = {o: saved_bytes(lambda m=m: m(input_ids=ids, labels=labels).loss)
             for o, m in patched.items()}
    assert saved["patch-then-peft"] == saved["peft-then-patch"] < 0.65 * saved_bytes(
        lambda: plain(input_ids=ids, labels=labels).loss)
