"""memkern's layers and fused head + loss under FSDP2's ``fully_shard``, across real processes
(2 gloo ranks on the CPU), in every usual unit layout: the root only; each decoder block and the
root; the final norm and the output layer as one unit (torchtitan's layout); the output layer
alone; ``reshard_after_forward=False``; activation checkpointing per block (memkern.checkpoint
and torch's, through transformers' gradient checkpointing); bfloat16 mixed precision.

Oracle: the plain transformers model, unpatched and unsharded, on each rank's batch, its
gradients averaged over the ranks as FSDP2 averages them. Float32: every gradient within 1e-6
(norm-wise relative) of that model's in float64, or, where float32 itself cannot get that
close (a bias whose gradient sums tokens that cancel: plain torch's float32 gradient was 1.40e-6
off the float64 one, memkern's 1.39e-6), no further off than twice plain torch's float32
gradient is. Under mixed precision: the plain model sharded the same way, within bfloat16's
rounding. Tiny GPT-2
(tied embeddings), Llama and Qwen2 built from their configs. Launched through
tests/launch_ranks.py. In one process: a wrapper that subclasses the output layer and makes its
weight present only during its call (as FSDP2 does), against the plain model.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import launch_ranks
import memkern as mk
from clean_exit import DTENSOR_CACHES
from compare import params_rel_err, rel_err

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ = 131, 2, 13
_COMMON = dict(hidden_size=48, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
               bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="sdpa")


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=48, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="sdpa"))


FAMILIES = {
    "gpt2": _gpt2,
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**_COMMON)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_COMMON)),
}
LAYOUTS = {  # name -> (units, fully_shard options, activation checkpointing)
    "root": ((), {}, None),
    "blocks": (("blocks",), {}, None),
    "blocks+norm_head": (("blocks", "norm_head"), {}, None),
    "blocks+head": (("blocks", "head"), {}, None),
    "keep_unsharded": (("blocks", "norm_head"), {"reshard_after_forward": False}, None),
    "memkern_checkpoint": (("blocks", "norm_head"), {}, "memkern"),
    "torch_checkpoint": (("blocks", "norm_head"), {}, "torch"),
    "bf16": (("blocks", "norm_head"), {"mp_policy": MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}, None),
}
# GPT-2's output layer is its input embedding: it stays in the root's unit (a parameter lives
# in one unit), so the layouts that only differ by the output layer's unit are left out.
CASES = [(family, layout) for family in FAMILIES for layout in LAYOUTS
         if not (family == "gpt2" and layout in ("blocks+norm_head", "blocks+head"))]


def blocks_and_final_norm(model):
    """The decoder blocks and the final norm of a transformers causal LM."""
    if hasattr(model, "transformer"):  # GPT-2
        return list(model.transformer.h), model.transformer.ln_f
    return list(model.model.layers), model.model.norm


def shard(model, layout: str, mesh):
    units, options, recompute = LAYOUTS[layout]
    blocks, norm = blocks_and_final_norm(model)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if recompute == "memkern":
        for block in blocks:
            mk.checkpoint(block)
    elif recompute == "torch":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if "blocks" in units:
        for block in blocks:
            fully_shard(block, mesh=mesh, **options)
    if "norm_head" in units and not tied:
        fully_shard([norm, model.lm_head], mesh=mesh, **options)
    if "head" in units and not tied:
        fully_shard(model.lm_head, mesh=mesh, **options)
    return fully_shard(model, mesh=mesh, **options)


def batch(seed: int, rank: int):
    g = torch.Generator().manual_seed(seed * 10 + rank)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # an untrained prompt
    return ids, labels


def gradients(model, ids, labels) -> dict[str, torch.Tensor]:
    """The gradients (gathered) and the loss, in the parameters' dtype."""
    output = model(input_ids=ids, labels=labels)
    loss = output.loss
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = grad.detach().clone()
    model.zero_grad()
    # the fused loss leaves no logits
    return dict(grads, loss=loss.detach().float()), output.logits is None


def averaged(model, rank: int, world: int, seed: int) -> dict[str, torch.Tensor]:
    """The unsharded model's gradients averaged over the ranks' batches, and this rank's loss."""
    per_rank = [gradients(model, *batch(seed, r))[0] for r in range(world)]
    expected = {k: sum(g[k] for g in per_rank) / world for k in per_rank[0]}
    expected["loss"] = per_rank[rank]["loss"]
    return expected


def scenario_gradients(rank, world, seed, out):
    """Every (family, layout): the patched sharded model's gradients (gathered), and the
    oracle's: the plain model's, unsharded and averaged over the ranks' batches, in float32
    and in float64 (float32 layouts), or sharded the same way (bfloat16 mixed precision)."""
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for family, layout in CASES:
        torch.manual_seed(seed)
        plain = FAMILIES[family]().train()
        model = mk.patch(copy.deepcopy(plain))
        ids, labels = batch(seed, rank)
        got, fused = gradients(shard(model, layout, mesh), ids, labels)
        if "mp_policy" in LAYOUTS[layout][1]:
            expected, _ = gradients(shard(plain, layout, mesh), ids, labels)
            results[family, layout] = dict(got=got, expected=expected, fused=fused)
            continue
        results[family, layout] = dict(
            got=got, expected=averaged(plain, rank, world, seed), fused=fused,
            exact=averaged(copy.deepcopy(plain).double(), rank, world, seed))
    return results


if __name__ == "__main__":
    launch_ranks.serve(globals(), group_kept_by=DTENSOR_CACHES)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    seed = launch_ranks.fresh_seed()
    return launch_ranks.launch(__file__, 2, ["gradients"], str(tmp_path_factory.mktemp("fsdp2")),
                               seed)["gradients"]


TOLERANCE = 1e-6
"""Float32, norm-wise relative (compare.params_rel_err says why norm-wise), against the
float64 gradient; or twice plain torch's own float32 error, where that is larger."""


@pytest.mark.parametrize("family, layout", CASES, ids=[f"{f}-{lay}" for f, lay in CASES])
def test_gradients_equal_the_plain_model(runs, family, layout):
    bf16 = "mp_policy" in LAYOUTS[layout][1]
    for rank, result in enumerate(runs):
        r = result[family, layout]
        assert r["fused"]
        assert r["got"].keys() == r["expected"].keys()
        for name, expected in r["expected"].items():
            got = r["got"][name]
            if bf16:
                assert params_rel_err([got], [expected]) <= 3e-2, (rank, name)
                continue
            # A gradient summed from terms that cancel is as far from the float64 one as
            # float32's rounding of the terms puts it, in any summation order: measure plain
            # torch's float32 error too, and allow memkern's summation order (each rank's
            # half, then FSDP2's reduce-scatter) twice that, never more than needed.
            exact = r["exact"][name]
            err, torch_err = params_rel_err([got], [exact]), params_rel_err([expected], [exact])
            assert err <= max(TOLERANCE, 2 * torch_err), (rank, name, err, torch_err)


class _Wrapper:
    """A mixin with no forward of its own, as FSDP2's FSDPModule: a wrapper subclasses the
    module's class dynamically."""


def test_fused_loss_reads_the_head_weight_only_inside_its_call():
    """In one process: the output layer is given a dynamic subclass whose hooks make its
    weight present only during its call (as FSDP2 unshards and reshards it). The fused loss
    still runs, calls the layer once, and gives the plain model's loss and gradients."""
    torch.manual_seed(0)
    plain = FAMILIES["llama"]().train()
    model = mk.patch(copy.deepcopy(plain))
    head = model.lm_head
    weight, absent = head.weight, torch.nn.Parameter(torch.empty(0))
    head.__class__ = type(f"Wrapped{type(head).__name__}", (_Wrapper, type(head)), {})
    calls = []

    def unshard(module, args):
        calls.append(args[0].shape)
        module._parameters["weight"] = weight

    def reshard(module, args, output):
        module._parameters["weight"] = absent

    head.register_forward_pre_hook(unshard)
    head.register_forward_hook(reshard)
    reshard(head, (), None)
    ids, labels = batch(1, 0)
    output = model(input_ids=ids, labels=labels)
    output.loss.backward()
    assert output.logits is None and len(calls) == 1  # fused, and the layer called once
    unshard(head, (ids,))  # to read its gradient
    expected, _ = gradients(plain, ids, labels)
    assert rel_err(output.loss, expected.pop("loss")) <= 1e-6
    for name, p in model.named_parameters():
        assert rel_err(p.grad, expected[name]) <= 1e-6, name
