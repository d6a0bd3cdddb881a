"""memkern.fit: per-block recomputation chosen so that a training step fits a memory budget.

Oracles, on the CPU (the planning target "cpu", exact byte counts):
* the step's peak measured by the profiler's allocation trace (the persistent state at the
  step's start + the batch + the step's peak allocation above its start) stays within the
  budget — the planner's count is not the measure;
* the loss and every gradient equal, bit for bit, those of the same step without the fit
  (recomputation repeats the same ops on the same data);
* across budgets from "nothing needed" to "impossible", a larger budget never chooses more
  recomputation (per block, and in FLOPs), and "impossible" is an error naming a budget that
  does fit (the next fit at that budget succeeds).
"""
from __future__ import annotations

import pytest
import torch

import memkern as mk
from conftest import needs_layer_extension
from memkern.bench.configs import build
from memkern.bench.model import SIZES, GPTConfig
from memkern.profile import allocation_stats, memory_breakdown
from memkern.profile.fit import DEFAULT_MARGIN, LEVELS, parse_bytes, repeated_blocks

MIB = 1 << 20


def _gpt():
    base = SIZES["small"]
    cfg = GPTConfig(base.layers, base.width, base.heads, seq=127, vocab=base.vocab)
    setup = build("memkern-full", cfg, torch.device("cpu"), seed=0, param_dtype=torch.float32)
    batch = torch.randint(0, cfg.vocab, (9, 127))
    return setup.model, (batch, batch), lambda m, b: m(*b)


def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=1001, max_position_embeddings=128,
                                   attn_implementation="sdpa")
    model = mk.patch(transformers.LlamaForCausalLM(cfg).train())
    ids = torch.randint(0, 1001, (7, 127))
    return model, {"input_ids": ids, "labels": ids}, lambda m, b: m(**b).loss


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, foreach=True)


def _steps(model, batch, loss_fn):
    """Three training steps from the model's weights: a warm-up (the optimizer's state exists
    from there on), one measured, one whose loss and gradients are returned (copying them out
    would add to the measured one). Returns (measured peak, loss, gradients)."""
    opt = _optimizer(model.parameters())
    grads = {}

    def step(keep=False):
        loss = loss_fn(model, batch)
        loss.backward()
        if keep:
            grads.update({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    step()
    tensors = batch.values() if isinstance(batch, dict) else batch
    held = memory_breakdown(model, opt).total + sum(
        t.untyped_storage().nbytes() for t in {id(t): t for t in tensors}.values())
    measured = held + allocation_stats(step).peak
    return measured, step(keep=True), grads


# The Llama's peak is lowered by recomputation only once memkern's fused loss keeps no logits:
# without the extension its loss is torch's, whose logits stay the peak at every budget.
@pytest.mark.parametrize("make", [_gpt, pytest.param(_llama, marks=needs_layer_extension)],
                         ids=["bench-gpt", "hf-llama"])
def test_fit_across_budgets(make):
    model, batch, loss_fn = make()
    _, base_loss, base_grads = _steps(model, batch, loss_fn)
    model, batch, loss_fn = make()  # the same weights and batch again

    roomy = mk.fit(model, batch, 1 << 40, loss=loss_fn, optimizer=_optimizer, device="cpu",
                   throughput=1e12, apply=False)
    assert set(roomy.choices.values()) == {"keep"} and roomy.extra_flops == 0
    with pytest.raises(mk.MemoryBudgetError) as err:
        mk.fit(model, batch, roomy.baseline_peak // 4, loss=loss_fn, optimizer=_optimizer,
               device="cpu", apply=False)
    smallest = err.value.smallest_budget
    assert f"{smallest / MIB:.1f} MiB" in str(err.value)
    enough = int(roomy.baseline_peak / (1 - DEFAULT_MARGIN)) + 1  # no recomputation needed
    assert smallest < 0.9 * enough, "recomputation cannot lower this step's peak: a poor case"
    budgets = [smallest, (smallest + enough) // 2, enough]
    previous = None
    for budget in budgets:
        model, batch, loss_fn = make()
        report = mk.fit(model, batch, budget, loss=loss_fn, optimizer=_optimizer, device="cpu",
                        throughput=1e12)
        measured, loss, grads = _steps(model, batch, loss_fn)
        assert measured <= budget, (measured / MIB, budget / MIB, str(report))
        assert torch.equal(loss, base_loss)
        for name, g in base_grads.items():
            assert torch.equal(grads[name], g), name
        order = [LEVELS.index(report.choices[n]) for n in report.choices]
        if previous is not None:  # budgets ascend: never more recomputation than before
            assert all(a <= b for a, b in zip(order, previous[0]))
            assert report.extra_flops <= previous[1]
        previous = (order, report.extra_flops)
    assert previous[0] == [0] * len(previous[0])  # the roomiest budget: nothing recomputed


def test_a_budget_just_above_the_baseline_keeps_the_margin():
    """A budget 1% above the planned peak without recomputation: that peak is not within
    ``budget * (1 - margin)``, so the fit must recompute something and plan under it."""
    base = SIZES["tiny"]
    cfg = GPTConfig(base.layers, base.width, base.heads, seq=63, vocab=base.vocab)
    model = build("memkern-full", cfg, torch.device("cpu"), seed=0,
                  param_dtype=torch.float32).model
    batch = torch.randint(0, cfg.vocab, (5, 63))
    first_block = [repeated_blocks(model)[0][1]]  # one block: fewer steps to plan
    kwargs = dict(loss=lambda m, b: m(*b), optimizer=_optimizer, device="cpu",
                  blocks=first_block, throughput=1e12, apply=False)
    baseline = mk.fit(model, (batch, batch), 1 << 40, **kwargs).baseline_peak
    budget = int(baseline * 1.01)
    report = mk.fit(model, (batch, batch), budget, **kwargs)
    assert report.baseline_peak == baseline
    assert report.planned_peak <= budget * (1 - DEFAULT_MARGIN), str(report)
    assert set(report.choices.values()) != {"keep"}, str(report)


def test_parse_bytes():
    assert parse_bytes("20GiB") == 20 << 30
    assert parse_bytes("2500 MiB") == 2500 << 20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes(4096) == 4096
    for bad in ("20 parsecs", "-1GiB", "0", "GiB"):
        with pytest.raises(ValueError, match="budget"):
            parse_bytes(bad)


def test_the_recompute_of_memkerns_mlp_and_swiglu_modules_is_planned():
    """fit chooses ``recompute`` for memkern's MLP and SwiGLU modules (each in its own file),
    and only for modules that have one."""
    from memkern.profile.fit import _mlps

    block = torch.nn.Module()
    block.mlp, block.swiglu = mk.nn.MLP(8, 16), mk.nn.SwiGLU(8, 16)
    block.linear, block.norm = mk.nn.Linear(8, 8), mk.nn.LayerNorm(8)
    assert _mlps(block) == [block.mlp, block.swiglu]
