"""memkern.patch on Hugging Face causal LMs: the training loss goes through the fused linear
cross-entropy (memkern.nn.causal_lm_loss). Tiny models built from configs (nothing downloaded),
one per family: GPT-2 (tied embeddings, Conv1D), Llama, Mistral, Qwen2, Gemma 2 (final-logit
soft-capping; its norms and MLP are not swapped), Mixtral (generic path, router aux loss).

The oracle is the unpatched model (transformers' own logits + ForCausalLMLoss), deep-copied
before patching: loss and every gradient within TOL (float32; the fused loss sums the same
products in another order), with and without ``num_items_in_batch``, with ignored labels.
"""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

import memkern as mk
from compare import rel_err
from conftest import needs_layer_extension
from memkern.nn.causal_lm_loss import MemkernCausalLMHead
from memkern.profile import peak_allocated_bytes, saved_bytes

transformers = pytest.importorskip("transformers")

TOL = 2e-5
VOCAB = 131
_COMMON = dict(hidden_size=48, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
               bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=48, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="sdpa"))


def _family(cls_name, head_scale=1.0, **extra):
    def make():
        cfg = getattr(transformers, cls_name + "Config")(**_COMMON, **extra)
        model = getattr(transformers, cls_name + "ForCausalLM")(cfg)
        with torch.no_grad():  # logits large enough for a soft-cap to matter
            model.get_output_embeddings().weight.mul_(head_scale)
        return model
    return make


FAMILIES = {
    "gpt2": _gpt2,
    "llama": _family("Llama", attn_implementation="sdpa"),
    "mistral": _family("Mistral", attn_implementation="sdpa"),
    "qwen2": _family("Qwen2", attn_implementation="sdpa"),
    "gemma2": _family("Gemma2", head_scale=50.0, head_dim=12, final_logit_softcapping=2.0,
                      attn_logit_softcapping=50.0, attn_implementation="eager"),
    "mixtral": _family("Mixtral", num_local_experts=3, num_experts_per_tok=2,
                       output_router_logits=True, attn_implementation="sdpa"),
}


def _pair(family, **patch_kwargs):
    torch.manual_seed(0)
    ref = FAMILIES[family]().train()
    model = copy.deepcopy(ref)
    mk.patch(model, **patch_kwargs)
    return model, ref


def _batch(batch=3, seq=17):
    ids = torch.randint(1, VOCAB, (batch, seq))
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt that is not trained on
    labels[2, -1] = -100
    labels[1, 7] = -100
    return ids, labels


def _check_grads(model, ref):
    checked = 0
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if q.grad is not None:
            assert rel_err(p.grad, q.grad) < TOL, (n, rel_err(p.grad, q.grad))
            checked += 1
    assert checked > 0


@pytest.mark.parametrize("num_items", ["none", "int", "tensor"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_loss_and_gradients_equal_unpatched(family, num_items):
    model, ref = _pair(family)
    assert type(model.get_output_embeddings()) is MemkernCausalLMHead
    ids, labels = _batch()
    kw = {}
    if num_items != "none":  # the Trainer's count over a whole accumulation window
        n = int((labels[:, 1:] != -100).sum()) + 23
        kw["num_items_in_batch"] = torch.tensor(n) if num_items == "tensor" else n
    out = model(input_ids=ids, labels=labels, **kw)
    want = ref(input_ids=ids, labels=labels, **kw)
    assert out.logits is None  # fused: no [tokens, vocab] logits were computed
    assert torch.isfinite(want.loss) and rel_err(out.loss.detach(), want.loss.detach()) < TOL
    (out.loss * 1.7).backward()
    (want.loss * 1.7).backward()
    _check_grads(model, ref)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_shift_labels_are_used_as_given(family):
    model, ref = _pair(family)
    ids, labels = _batch()
    shifted = torch.roll(labels, -2, dims=1)  # any pre-shifted labels: used without a shift
    got = model(input_ids=ids, labels=labels, shift_labels=shifted).loss
    want = ref(input_ids=ids, labels=labels, shift_labels=shifted).loss
    assert rel_err(got.detach(), want.detach()) < TOL


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("labels_given", ["labels", "shift_labels"])
def test_non_default_ignore_index_reaches_the_fused_loss(family, labels_given):
    """``ignore_index=-1`` passed to the model's forward (transformers hands it to
    loss_function): the -1 labels are ignored, and so is the position the shift pads, which must
    be padded with -1 too (a -100 there would be neither ignored nor a class). With
    ``shift_labels`` the labels are used as given. Loss and every gradient as the unpatched
    model's."""
    model, ref = _pair(family)
    ids, labels = _batch()
    labels[labels == -100] = -1
    kw = {"labels": labels, "ignore_index": -1}
    if labels_given == "shift_labels":
        shifted = torch.roll(labels, -1, dims=1)
        shifted[1, 2] = -1
        kw["shift_labels"] = shifted
    n = torch.tensor(int((labels[:, 1:] != -1).sum()) + 5)
    for extra in ({}, {"num_items_in_batch": n}):
        model.zero_grad(), ref.zero_grad()
        got = model(input_ids=ids, **kw, **extra).loss
        want = ref(input_ids=ids, **kw, **extra).loss
        assert torch.isfinite(want) and rel_err(got.detach(), want.detach()) < TOL
        got.backward()
        want.backward()
        _check_grads(model, ref)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_without_labels_or_in_eval_the_model_is_unchanged(family):
    # only the loss fused: every other layer as it was, so the logits must be bit-identical
    model, ref = _pair(family, linear=False, norm=False, mlp=False, dropout=False)
    ids, labels = _batch()
    assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    model.eval(), ref.eval()
    with torch.no_grad():
        out, want = model(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
    assert torch.equal(out.logits, want.logits) and torch.equal(out.loss, want.loss)
    gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids[:1, :5], **gen), ref.generate(ids[:1, :5], **gen))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_labels_none_in_train_mode_returns_the_unpatched_logits(family):
    """``labels=None`` passed explicitly (as data collators and generation loops do), in
    training mode: no fused loss, the logits of the unpatched model bit for bit."""
    model, ref = _pair(family, linear=False, norm=False, mlp=False, dropout=False)
    ids, _ = _batch()
    out, want = model(input_ids=ids, labels=None), ref(input_ids=ids, labels=None)
    assert model.training and out.loss is None and want.loss is None
    assert torch.equal(out.logits, want.logits)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_a_forward_that_raises_leaves_the_model_as_it_was(family):
    """A fused call whose forward raises (a token id outside the vocabulary, after the call
    opened): no fused call is left open and the config is as it was (Gemma 2's soft-cap), so
    the next calls give the unpatched model's logits and loss."""
    model, ref = _pair(family, linear=False, norm=False, mlp=False, dropout=False)
    ids, labels = _batch()
    bad = ids.clone()
    bad[1, 3] = VOCAB + 7
    config = model.config.to_dict()
    with pytest.raises(IndexError):
        model(input_ids=bad, labels=labels)
    assert model.config.to_dict() == config
    assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    out, want = model(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
    assert out.logits is None
    assert rel_err(out.loss.detach(), want.loss.detach()) < TOL


@pytest.mark.parametrize("family", list(FAMILIES))
def test_state_dict_parameters_and_tying_unchanged(family):
    torch.manual_seed(0)
    model = FAMILIES[family]()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    mk.patch(model)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert all(p is params[n] for n, p in model.named_parameters())
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    if family == "gpt2":
        assert tied


def test_softcap_is_applied_and_restored_in_the_config():
    model, ref = _pair("gemma2")
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels)
    assert model.config.final_logit_softcapping == 2.0  # set back after the fused call
    # the oracle: the capped loss differs from the uncapped one by far more than TOL
    ref.config.final_logit_softcapping = None
    uncapped = ref(input_ids=ids, labels=labels).loss
    assert rel_err(out.loss.detach(), uncapped.detach()) > 1e-3


@pytest.mark.skipif(not mk.compiled.has_cpu, reason=(
    "the bound is the compiled kernels': the reference backend (no extension) keeps float32 "
    "temporaries of each block beside it, 34.0 MB at this size against the logits' 33.6 MB "
    "(MEMKERN_DISABLE_EXT=1 sweep)"))
def test_fused_training_holds_no_logits():
    # a head-dominated model (vocab 8192, width 48, 1024 tokens): the unpatched step holds the
    # logits, their float32 copy and their gradient; the fused step one block of 256 tokens'
    # logits at a time (block_sizes on the CPU)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**_COMMON, "vocab_size": 8192}, attn_implementation="sdpa")
    ref = transformers.LlamaForCausalLM(cfg).train()
    model = mk.patch(copy.deepcopy(ref), linear=False, norm=False, mlp=False, dropout=False)
    ids = torch.randint(1, 8192, (8, 128))
    logits_bytes = 8 * 128 * 8192 * 4

    def step(m):
        m(input_ids=ids, labels=ids).loss.backward()

    plain, fused = peak_allocated_bytes(step, ref), peak_allocated_bytes(step, model)
    assert plain > 3 * logits_bytes
    assert fused < logits_bytes and fused < plain / 3, (fused, plain)


@needs_layer_extension
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_recompute_reaches_the_mlp_blocks(family):
    ids, labels = _batch()
    saved = {}
    for policy in ("activation", "full"):
        model, _ = _pair(family, recompute=policy)
        mlps = [m for m in model.modules() if hasattr(m, "_memkern_mlp")]
        assert len(mlps) == 2 and all(m._memkern_mlp["recompute"] == policy for m in mlps)
        saved[policy] = saved_bytes(
            lambda model=model: model(input_ids=ids, labels=labels).loss)
    assert saved["full"] < saved["activation"]


@pytest.mark.parametrize("family", ["gpt2", "gemma2"])
def test_fused_model_copies_and_pickles(family):
    model, ref = _pair(family)
    ids, labels = _batch()
    want = ref(input_ids=ids, labels=labels).loss.detach()
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        out = clone(input_ids=ids, labels=labels)
        assert out.logits is None and rel_err(out.loss.detach(), want) < TOL
        assert clone.loss_function.head is clone.get_output_embeddings()


def test_patching_twice_fuses_once():
    model, ref = _pair("llama")
    n = len(mk.nn.patch_report(model).swapped)
    mk.patch(model)
    assert len(mk.nn.patch_report(model).swapped) == n
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
    ids, labels = _batch()
    got, want = model(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss
    assert rel_err(got.detach(), want.detach()) < TOL


def test_model_computing_its_loss_inline_is_left_alone():
    model = transformers.GPT2DoubleHeadsModel(transformers.GPT2Config(
        n_embd=48, n_layer=1, n_head=4, vocab_size=VOCAB, n_positions=64))
    mk.patch(model)
    assert type(model.lm_head) is mk.nn.Linear
    reasons = [why for _, why in mk.nn.patch_report(model).skipped]
    assert any("does not compute the loss through self.loss_function" in r for r in reasons)


def test_model_changing_its_logits_before_the_loss_raises_clearly():
    # Cohere multiplies the logits by logit_scale between lm_head and loss_function
    cfg = transformers.CohereConfig(**_COMMON, attn_implementation="sdpa")
    model = mk.patch(transformers.CohereForCausalLM(cfg).train())
    ids, labels = _batch()
    with pytest.raises(RuntimeError, match=r"changes the logits .*loss=False"):
        model(input_ids=ids, labels=labels)
    model = mk.patch(transformers.CohereForCausalLM(cfg).train(), loss=False)
    assert torch.isfinite(model(input_ids=ids, labels=labels).loss)


def test_positional_labels_and_tuple_output():
    model, ref = _pair("llama")
    ids, labels = _batch()
    # LlamaForCausalLM.forward(input_ids, attention_mask, position_ids, past_key_values,
    # inputs_embeds, labels, ...)
    got = model(ids, None, None, None, None, labels)
    assert got.logits is None
    out = model(input_ids=ids, labels=labels, return_dict=False)
    want = ref(input_ids=ids, labels=labels).loss.detach()
    assert isinstance(out, tuple) and out[1] is None
    assert rel_err(got.loss.detach(), want) < TOL and rel_err(out[0].detach(), want) < TOL


def test_output_layer_is_the_same_module_with_its_weight_during_a_fused_call():
    """Code outside the model's own forward (a hook on the final norm; a forward replaced on
    the instance that reads the weight itself, as trl's chunked LM head does) sees the output
    layer itself, with its weight, during a fused call: the fusion never puts anything in its
    seat. The replaced forward computes its own loss and the fused call closes without one."""
    model, ref = _pair("llama")
    head = model.lm_head
    seen = []

    def look(module, args, output):
        seen.append((model.lm_head, model.get_output_embeddings()))

    model.model.norm.register_forward_hook(look)
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None and len(seen) == 1 and all(m is head for m in seen[0])
    want = ref(input_ids=ids, labels=labels).loss

    def reads_the_weight(self, input_ids, labels):  # trl's add_fused_lm_head, in brief
        hidden = self.model(input_ids=input_ids).last_hidden_state
        logits = hidden @ self.get_output_embeddings().weight.T
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)

    model.forward = reads_the_weight.__get__(model)
    assert rel_err(model(input_ids=ids, labels=labels).detach(), want.detach()) < TOL
    assert rel_err(out.loss.detach(), want.detach()) < TOL


def test_a_loss_that_raises_leaves_no_fused_call_open():
    """A training forward that raises in the fused loss, after the output layer's first call
    kept its input (a label outside the vocabulary): the next call of the output layer and the
    next eval forward give the plain model's logits, Gemma 2's soft-cap back in its config
    (raising before the output layer: test_a_forward_that_raises_leaves_the_model_as_it_was)."""
    model, ref = _pair("gemma2", linear=False, norm=False, mlp=False, dropout=False)
    ids, labels = _batch()
    labels[1, 3] = VOCAB + 4
    with pytest.raises(ValueError, match="is not a class index"):
        model(input_ids=ids, labels=labels)
    assert model.config.final_logit_softcapping == 2.0
    x = torch.randn(2, 5, model.config.hidden_size)
    assert torch.equal(model.lm_head(x), ref.lm_head(x))
    model.eval(), ref.eval()
    assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
