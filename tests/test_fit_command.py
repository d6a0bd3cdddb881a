"""``memkern fit``: the cheapest configuration that fits a budget, device and host memory both.

Oracles:
* the choice among configurations: a stand-in for ``memkern.fit`` whose peaks, host memory and
  recomputed FLOPs are set by hand, and the costs worked out by hand from the rates
  (``memkern.profile.costs``' model written out in each case);
* the command's figures: ``memkern plan`` run on the same model and optimizer (plan and fit
  agree, and both say which optimizer they train with);
* the printed ``apply`` lines: executed as Python on a real model and batch, then a real
  training step with the optimizer they make;
* units: a budget in GB is powers of ten (11 GB = 10.24 GiB, by hand).
"""
from __future__ import annotations

import re
import types

import pytest
import torch

import memkern
from memkern import cli, fit_command
from memkern.profile.costs import Rates
from memkern.profile.fit import FitReport, MemoryBudgetError

TINY_LLAMA = ["--hf", "llama", "--set", "hidden_size=32", "--set", "intermediate_size=64",
              "--set", "num_hidden_layers=2", "--set", "num_attention_heads=2",
              "--set", "num_key_value_heads=1", "--set", "vocab_size=96"]


# ------------------------------------------------------------------------------- the choice

# (where the optimizer steps, state precision) -> device peak with every block kept, with every
# block "full", and the host memory; a model of 1000 bf16 parameters: weights 2000 bytes, so the
# devices' floors are 16000 (32-bit state: weights, gradients, masters, moments), 8000 (8-bit),
# 4000 (on the host: weights and gradients) and 2000 (gradients streamed: the weights)
PEAKS = {("gpu", "32bit"): (30000, 20000, 0), ("gpu", "8bit"): (25000, 18000, 0),
         ("host", "32bit"): (12000, 9000, 28000), ("host", "8bit"): (12000, 9000, 16000),
         ("streamed", "32bit"): (10000, 7000, 30000), ("streamed", "8bit"): (10000, 7000, 18000)}
RATES = Rates(flops_per_s=1e12, host_params_per_s=lambda precision: 1e6, pcie_bytes_per_s=1e6)
STEP_FLOPS = 10**9  # 1 ms at 1e12: backward 2/3 ms


def _fake_fit(calls: list):
    """memkern.fit's stand-in: recomputation grows from 0 (budget >= keep) to 1e9 FLOPs
    (budget = full), linearly in the budget."""
    def fit(budget: int, **options) -> FitReport:
        where = ("streamed" if options.get("gradients") == "host" else
                 "host" if options.get("offload") == "cpu" else "gpu")
        key = (where, options.get("state_precision", "32bit"))
        calls.append(key)
        keep, full, host = PEAKS[key]
        if budget < full:
            raise MemoryBudgetError("no", full)
        extra = 0 if budget >= keep else 10**9 * (keep - budget) // (keep - full)
        plan = types.SimpleNamespace(flops=STEP_FLOPS + extra, host_peak=host,
                                     host_by_category={})
        return FitReport(budget, "cuda", {"layers.0": "keep"}, min(keep, budget), keep, extra,
                         1e12, False, 3, 0.1, plan)

    return fit


GPU32, GPU8 = ("gpu", "32bit"), ("gpu", "8bit")
HOST, STREAMED = [("host", "32bit"), ("host", "8bit")], [("streamed", "32bit"),
                                                          ("streamed", "8bit")]


# by hand: the host step's exposed time = max(host step, gradients down) - backward + weights
#   up = max(1000 / 1e6 * (1 + 24/28), 2000 / 1e6) - 2/3 ms + 2 ms = 3.333 ms (32-bit and
#   8-bit, on the host and streamed: the copy down, 2 ms, is the longer); recomputation:
#   extra FLOPs / 1e12
@pytest.mark.parametrize("budget,host_budget,chosen,tried", [
    (40000, None, "32-bit optimizer state", [GPU32]),  # fits as it is: nothing else
    # 32-bit recomputes 0.3e9 (0.3 ms); 8-bit fits as it is (0 ms): chosen, nothing after it
    (27000, None, "8-bit optimizer state", [GPU32, GPU8]),
    # 32-bit needs 20000; 8-bit recomputes 6/7e9 (0.86 ms); the host's least, the weights'
    # 2 ms copy up, is more: not planned
    (19000, None, "8-bit optimizer state", [GPU32, GPU8]),
    # 32-bit's floor (16000) is over the budget: not planned; 8-bit needs 18000; on the host
    # and streamed, every one costs 3.33 ms: the first is kept
    (15000, None, "the optimizer on the host", [GPU8] + HOST + STREAMED),
    # the host budget leaves 32-bit state out (28000 and 30000 of host memory)
    (15000, 20000, "the optimizer on the host, 8-bit state", [GPU8] + HOST + STREAMED),
    # only the streamed gradients fit (recomputing 0.5e9: 3.83 ms)
    (8500, None, "gradients streamed to the host", [GPU8] + HOST + STREAMED),
    (5000, None, None, HOST + STREAMED),  # all need more
    (1500, None, None, []),  # even the weights are more: nothing planned
])
def test_fit_chooses_the_cheapest_configuration_that_fits(budget, host_budget, chosen, tried):
    model = torch.nn.Linear(100, 10, bias=False).bfloat16()
    calls = []
    candidates = fit_command.choose(_fake_fit(calls), budget, model, lambda: RATES,
                                    host_budget, margin=0.0)
    assert calls == tried
    best = candidates[0]
    assert (best.name if best.fits else None) == chosen
    assert len(candidates) == len(fit_command.CANDIDATES)
    if chosen == "the optimizer on the host":
        assert best.cost.exposed == pytest.approx(2e-3 - 2e-3 / 3 + 2e-3)
        assert "costs about 3 ms" in candidates[-1].why_not  # streamed 8-bit fits too
    if chosen == "gradients streamed to the host":
        assert best.cost.exposed == pytest.approx(0.5e-3 + 2e-3 - 2e-3 / 3 + 2e-3)
    if chosen is None:
        assert all(c.why_not for c in candidates)


# ------------------------------------------------------------------------------- the command


def _run(capsys, *args: str) -> tuple[int, list[str]]:
    code = cli.main(list(args))
    return code, capsys.readouterr().out.splitlines()


def test_fit_and_plan_agree_and_say_which_optimizer(capsys):
    """A budget the step fits as it is: 32-bit state, no recomputation, and the planned peak
    is the one ``memkern plan`` prints for the same patched model (its default optimizer is
    fit's, stated by both in the same words)."""
    code, fit_out = _run(capsys, "fit", *TINY_LLAMA, "--batch", "3", "--seq", "17",
                         "--memory-budget", "1GiB", "--device", "cpu")
    assert code == 0
    assert fit_out[2] == "fits with: memkern.patch(model), 32-bit optimizer state"
    assert fit_out[4] == "  costs nothing: recomputes nothing beyond memkern's layers' defaults"
    code, plan_out = _run(capsys, "plan", *TINY_LLAMA, "--batch", "3", "--seq", "17",
                          "--variant", "patch", "--device", "cpu")
    assert code == 0
    row = next(line.split() for line in plan_out if line.startswith("patch "))  # peaks table
    assert fit_out[3].startswith(f"  planned peak {row[1]} MiB of 1.00 GiB"), (fit_out, row)
    optimizer = re.search(r"memkern\.optim\.ShardedOptimizer\(model\.parameters\(\), [^)]*\)",
                          fit_out[1]).group(0)
    assert optimizer in plan_out[1], (fit_out[1], plan_out[1])


def _llama(vocab: int):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1,
                                   vocab_size=vocab, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).train()


def test_only_the_host_optimizer_fits_and_the_apply_lines_run(capsys):
    """A model whose optimizer state outweighs its activations (a large vocabulary, a short
    batch), planned for a GPU at a budget between the host optimizer's planned peak and the
    least the GPU-state configurations need: fit chooses the optimizer on the host, and its
    apply lines, run as written on the real model, make that optimizer and train a step."""
    from memkern.profile import hf_config, hf_workload, plan_training_step

    sets = ["hidden_size=64", "intermediate_size=128", "num_hidden_layers=2",
            "num_attention_heads=2", "num_key_value_heads=1", "vocab_size=20011",
            "max_position_embeddings=64"]
    cfg = hf_config("llama", sets)

    def peak(checkpoint=None, **options) -> int:
        return plan_training_step(hf_workload(
            cfg, batch=1, seq=8, patch={}, optimizer="sharded", optimizer_options=options,
            checkpoint=checkpoint), device="cuda").peak_bytes

    on_host, eight_bit_least = peak(offload="cpu"), peak("full", state_precision="8bit")
    margin = memkern.profile.fit.DEFAULT_MARGIN
    assert on_host / (1 - margin) < 0.95 * eight_bit_least, (on_host, eight_bit_least)
    budget = (on_host / (1 - margin) + eight_bit_least) // 2
    flags = [a for s in sets for a in ("--set", s)]
    code, out = _run(capsys, "fit", "--hf", "llama", *flags, "--batch", "1", "--seq", "8",
                     "--memory-budget", str(int(budget)), "--host-step-rate", "1e8")
    assert code == 0, out
    assert out[3].startswith("fits with: memkern.patch(model), the optimizer on the host"), out
    assert "host memory" in out[4] and "pinned" in out[4]
    assert "host step" in out[5] and "PCIe copies" in out[5]
    start = out.index("  apply (model: your transformers model; batch: one batch of its "
                      "inputs and labels):")
    code_lines = [line.strip() for line in out[start + 1:start + 6]]
    torch.manual_seed(0)
    model = _llama(20011)
    ids = torch.randint(0, 20011, (1, 8))
    scope = {"memkern": memkern, "model": model, "batch": {"input_ids": ids, "labels": ids}}
    assert code_lines[0].startswith("model.config.use_cache = False")
    exec("\n".join(code_lines), scope)
    opt = scope["optimizer"]
    assert isinstance(opt, memkern.optim.ShardedOptimizer) and opt.offload == "cpu"
    assert ("8-bit" in out[3]) == any(seg.quantized for seg in opt._segments)
    before = [p.detach().clone() for p in scope["model"].parameters()]
    opt.backward(scope["model"](**scope["batch"]).loss)
    assert bool(opt.step())  # (a device tensor with loss scaling: no host sync)
    assert any(not torch.equal(p, b) for p, b in zip(scope["model"].parameters(), before))


def test_a_budget_below_the_weights_is_refused_before_any_planning(capsys, monkeypatch):
    def no_planning(*args, **kwargs):
        raise AssertionError("memkern.fit was called")

    monkeypatch.setattr(memkern, "fit", no_planning)
    code, out = _run(capsys, "fit", *TINY_LLAMA, "--batch", "1", "--seq", "8",
                     "--memory-budget", "1KiB")
    assert code == 1
    assert out[-1].startswith("nothing fits 0.0 MiB: the model's bfloat16 weights alone take "), out


def test_a_budget_in_gb_is_powers_of_ten(capsys):
    """11 GB = 11e9 bytes = 10.24 GiB (not 11 GiB): the budget line says what was read."""
    code, out = _run(capsys, "fit", *TINY_LLAMA, "--batch", "1", "--seq", "8",
                     "--memory-budget", "11GB", "--device", "cpu")
    assert code == 0
    assert ", budget 10.24 GiB on CPU" in out[0], out[0]


def test_nothing_fits_says_what_each_configuration_needs(capsys):
    code, out = _run(capsys, "fit", *TINY_LLAMA, "--batch", "4", "--seq", "64",
                     "--memory-budget", "120KiB", "--device", "cpu", "--host-step-rate", "1e8")
    assert code == 1
    assert out[2] == "nothing fits 0.1 MiB:"
    names = [name for name, _, _ in fit_command.CANDIDATES]
    for name, line in zip(names, out[3:3 + len(names)]):
        assert line.startswith(f"  {name}: ") and ("needs" in line or "at least" in line), line


def test_a_transformers_model_recomputes_without_its_key_value_cache():
    """With the cache a transformers model keeps by default in training, a recomputed layer
    appends its keys again and torch's checkpoint refuses the step: "selective", "full" and
    "full-host" are left out, and the report says why; with ``use_cache=False`` (what
    ``memkern fit`` passes and its apply lines set) every level runs."""
    model = memkern.patch(_llama(500))
    ids = torch.randint(0, 500, (4, 64))
    kwargs = dict(device="cpu", apply=False, throughput=1e12)
    batch = {"input_ids": ids, "labels": ids}
    base = memkern.fit(model, batch, 1 << 40, **kwargs).baseline_peak
    cached = memkern.fit(model, batch, base, **kwargs)  # under the margin: recomputes something
    assert set(cached.skipped) == {"selective", "full", "full-host"}
    assert all("model.config.use_cache = False" in why for why in cached.skipped.values())
    uncached = memkern.fit(model, {**batch, "use_cache": False}, base, **kwargs)
    assert uncached.skipped == {}
