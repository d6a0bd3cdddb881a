"""memkern.patch(model): swaps torch.nn Linear/LayerNorm/RMSNorm/Dropout and the MLP blocks of
GPT-2-style and Llama-style models in place. On small random models — plain torch ones and
Hugging Face ``transformers`` GPT-2 and Llama built from configs (no download) — the loss and
every gradient are unchanged, parameters keep identity, names, dtype, device and
requires_grad, the state_dict is the same, patching twice changes nothing, and the bytes saved
for backward drop.
"""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memkern as mk
from compare import rel_err
from conftest import needs_layer_extension
from memkern.profile import saved_bytes


class TinyGPT(nn.Module):
    """A GPT-2-like model from plain torch.nn: MLP blocks are nn.Sequential(fc, GELU, proj,
    drop)."""

    def __init__(self, vocab=97, d=48, heads=4, layers=2, p=0.1):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.drop = nn.Dropout(p)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            blk = nn.Module()
            blk.ln_1, blk.attn, blk.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
            blk.ln_2 = nn.LayerNorm(d)
            blk.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"),
                                    nn.Linear(4 * d, d), nn.Dropout(p))
            self.blocks.append(blk)
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied
        self.heads = heads

    def forward(self, ids):
        x = self.drop(self.wte(ids))
        B, T, C = x.shape
        for blk in self.blocks:
            q, k, v = blk.attn(blk.ln_1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            a = a.transpose(1, 2).reshape(B, T, C)
            x = x + blk.proj(a)
            x = x + blk.mlp(blk.ln_2(x))
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


class TinyLlama(nn.Module):
    """A Llama-like model from plain torch.nn: nn.RMSNorm and gate/up/down nn.Linear."""

    def __init__(self, vocab=97, d=48, hidden=80, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            blk = nn.Module()
            blk.norm1, blk.norm2 = nn.RMSNorm(d, eps=1e-6), nn.RMSNorm(d, eps=1e-6)
            blk.qkv, blk.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
            blk.gate, blk.up, blk.down = (nn.Linear(d, hidden, bias=False),
                                          nn.Linear(d, hidden, bias=False),
                                          nn.Linear(hidden, d, bias=False))
            self.layers.append(blk)
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        B, T, C = x.shape
        for blk in self.layers:
            q, k, v = blk.qkv(blk.norm1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, 4, -1).transpose(1, 2) for t in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            a = a.transpose(1, 2).reshape(B, T, C)
            x = x + blk.o(a)
            h = blk.norm2(x)
            x = x + blk.down(F.silu(blk.gate(h)) * blk.up(h))
        return F.cross_entropy(self.head(self.norm(x))[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _hf_gpt2(dropout: float):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=101, n_positions=32,
                                  resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0,
                                  attn_implementation="sdpa")
    model = transformers.GPT2LMHeadModel(cfg)
    return model, lambda ids: model(input_ids=ids, labels=ids).loss


def _hf_llama(dropout: float):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=101,
                                   max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
                                   attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg)
    return model, lambda ids: model(input_ids=ids, labels=ids).loss


def _plain(cls):
    def make(dropout: float):
        model = cls(p=dropout) if cls is TinyGPT else cls()
        return model, lambda ids: model(ids)
    return make


MODELS = {"torch-gpt": _plain(TinyGPT), "torch-llama": _plain(TinyLlama),
          "hf-gpt2": _hf_gpt2, "hf-llama": _hf_llama}


def _snapshot(model):
    return {n: (p, p.dtype, p.device, p.requires_grad, p.detach().clone())
            for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(MODELS))
def test_patch_keeps_loss_gradients_and_parameters(name):
    model, loss_fn = MODELS[name](0.0)
    model.train()
    first = next(iter(model.parameters()))
    first.requires_grad_(False)  # requires_grad must survive
    ref = copy.deepcopy(model)
    before = _snapshot(model)
    keys = list(model.state_dict())
    ids = torch.randint(0, 97, (2, 17))

    assert mk.patch(model) is model
    after = _snapshot(model)
    assert list(after) == list(before)
    for n, (p, dtype, device, rg, value) in after.items():
        p0, dtype0, device0, rg0, value0 = before[n]
        assert p is p0 and dtype == dtype0 and device == device0 and rg == rg0
        assert torch.equal(value, value0)
    assert list(model.state_dict()) == keys
    report = mk.nn.patch_report(model)
    assert len(report.swapped) > 0

    loss = loss_fn(ids)
    ref_loss = _loss_of(name, ref, ids)
    assert rel_err(loss.detach(), ref_loss.detach()) < 1e-6
    loss.backward()
    ref_loss.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is None:
            assert p.grad is None, n
            continue
        assert rel_err(p.grad, q.grad) < 1e-5, n


def _loss_of(name, model, ids):
    if name.startswith("hf"):
        return model(input_ids=ids, labels=ids).loss
    return model(ids)


@needs_layer_extension
@pytest.mark.parametrize("name", list(MODELS))
def test_patch_reduces_saved_bytes(name):
    model, loss_fn = MODELS[name](0.1)
    model.train()
    ids = torch.randint(0, 97, (2, 17))
    before = saved_bytes(loss_fn, ids)
    mk.patch(model)
    after = saved_bytes(loss_fn, ids)
    assert after < 0.85 * before, after / before
    print(f"{name}: saved bytes after/before = {after / before:.3f}")


def test_patch_swaps_the_expected_layers():
    model, _ = _plain(TinyGPT)(0.1)
    mk.patch(model)
    blk = model.blocks[0]
    assert type(blk.attn) is mk.nn.Linear and type(blk.ln_1) is mk.nn.LayerNorm
    assert type(model.drop) is mk.nn.Dropout
    assert type(blk.mlp).__name__ == "SequentialMLP" and isinstance(blk.mlp, nn.Sequential)
    assert blk.mlp._memkern_mlp["activation"] == "gelu_tanh"
    assert model.head.weight is model.wte.weight  # tying kept
    assert isinstance(blk.attn, nn.Linear)  # isinstance checks still hold


class ScaledLinear(nn.Linear):
    """A subclass of nn.Linear with a forward of its own (as LoRA-style layers have)."""

    def forward(self, x):
        return 2.0 * super().forward(x) + 1.0


def test_patch_leaves_a_linear_subclass_with_its_own_forward_alone():
    torch.manual_seed(0)
    model = nn.Sequential(ScaledLinear(7, 5), nn.ReLU(), nn.Linear(5, 3))  # not an MLP block
    x = torch.randn(4, 7)
    expected = model(x)
    mk.patch(model)
    assert type(model[0]) is ScaledLinear and type(model) is nn.Sequential
    assert type(model[2]) is mk.nn.Linear
    assert torch.equal(model(x), expected)


def test_patch_is_idempotent_and_respects_flags():
    model, _ = _plain(TinyGPT)(0.1)
    mk.patch(model, linear=False, mlp=False)
    assert type(model.blocks[0].attn) is nn.Linear and type(model.blocks[0].ln_1) is mk.nn.LayerNorm
    n1 = len(mk.nn.patch_report(model).swapped)
    mk.patch(model, linear=False, mlp=False)
    assert len(mk.nn.patch_report(model).swapped) == n1
    mk.patch(model)
    n2 = len(mk.nn.patch_report(model).swapped)
    assert n2 > n1 and type(model.blocks[0].attn) is mk.nn.Linear
    mk.patch(model)
    assert len(mk.nn.patch_report(model).swapped) == n2
    with pytest.raises(ValueError, match="recompute='lots'"):
        mk.patch(model, recompute="lots")


@needs_layer_extension
def test_patch_recompute_full_saves_even_less():
    a, fa = _plain(TinyGPT)(0.0)
    b = copy.deepcopy(a)
    ids = torch.randint(0, 97, (2, 17))
    mk.patch(a, recompute="activation")
    mk.patch(b, recompute="full")
    assert saved_bytes(lambda: b(ids)) < saved_bytes(fa, ids)


@pytest.mark.parametrize("name", ["hf-gpt2", "hf-llama"])
def test_patched_hf_model_keeps_isinstance_and_pickles(name):
    model, loss_fn = MODELS[name](0.0)
    kinds = {n: type(m) for n, m in model.named_modules()}
    mk.patch(model)
    for n, m in model.named_modules():
        assert isinstance(m, kinds[n]), n
    clone = pickle.loads(pickle.dumps(model))
    ids = torch.randint(0, 97, (2, 9))
    assert type(clone.lm_head) is type(model.lm_head)
    assert rel_err(_loss_of(name, clone, ids).detach(), loss_fn(ids).detach()) < 1e-6


class _LoRA(nn.Module):
    """A LoRA adapter as peft puts one in a linear layer's place: it wraps the layer, exposes
    its weight and bias, and adds its own low-rank term."""

    def __init__(self, base: nn.Module, features: tuple[int, int], rank: int = 3):
        super().__init__()
        self.base_layer = base
        g = torch.Generator().manual_seed(5)
        self.A = nn.Parameter(torch.randn(rank, features[0], generator=g, dtype=torch.float64))
        self.B = nn.Parameter(torch.randn(features[1], rank, generator=g, dtype=torch.float64))

    @property
    def weight(self):
        return self.base_layer.weight

    @property
    def bias(self):
        return self.base_layer.bias

    def forward(self, x):
        return self.base_layer(x) + (x @ self.A.t() @ self.B.t()) * 0.1


# per model: the MLP layer an adapter replaces (hf-gpt2's is a Conv1D), its in/out features
_ADAPTED = {"torch-gpt": ("blocks.1.mlp.2", (192, 48)),
            "hf-gpt2": ("transformer.h.1.mlp.c_fc", (64, 256)),
            "hf-llama": ("model.layers.0.mlp.up_proj", (64, 112))}


@pytest.mark.parametrize("change", ["adapter", "hook"])
@pytest.mark.parametrize("name", list(_ADAPTED))
def test_fused_mlp_runs_a_layer_replaced_or_hooked_after_patch(name, change):
    """A fused MLP reads its layers' weights; a LoRA adapter put in a layer's place after
    ``patch``, or a hook on it, must still run (the block then computes unfused), as in the
    unpatched model with the same change."""
    model, loss_fn = MODELS[name](0.0)
    model.double().train()
    ref = copy.deepcopy(model)
    mk.patch(model)
    layer_name, features = _ADAPTED[name]
    parent, child = layer_name.rsplit(".", 1)
    for m in (model, ref):
        layer = m.get_submodule(layer_name)
        if change == "adapter":
            m.get_submodule(parent).register_module(child, _LoRA(layer, features))
        else:
            layer.register_forward_hook(lambda mod, args, out: out * 1.5)
    ids = torch.randint(0, 97, (2, 13))
    loss, ref_loss = loss_fn(ids), _loss_of(name, ref, ids)
    assert rel_err(loss.detach(), ref_loss.detach()) < 1e-6  # (the fused loss: float32 inside)
    loss.backward()
    ref_loss.backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if q.grad is not None:
            assert rel_err(p.grad, q.grad) < 1e-5, n
