"""The planner's host memory: what offloading keeps on the host, planned apart from the device's.

Oracles:
* a GPU plan of ``ShardedOptimizer(offload="cpu")``: every host byte counted by hand from the
  parameters' shapes (the flat layout's 256-element slots, torch's pinned allocator rounding a
  request up to a power of two, 4 bytes per float32 element), and the device keeping nothing
  of the optimizer's;
* a CPU plan of the same optimizer (host and device are one memory there): the same step run
  for real and measured by the profiler's allocation trace plus the storages the model and the
  optimizer reach, within 3%, with 32-bit and 8-bit state, clipping and a window of two
  micro-batches;
* the host allocator's model: block sizes and reuse worked out by hand.
"""
from __future__ import annotations

import pytest
import torch

import memkern as mk
from memkern import _fake
from memkern.profile import allocation_stats
from memkern.profile.caching_allocator import HostAllocator
from memkern.profile.memory import reachable_bytes
from memkern.profile.plan import TrainingSetup, plan_training_step

TOLERANCE = 0.03


def _parts(offload, state_precision="32bit", window=1, sizes=(37, 41, 3), gradients="device"):
    model = torch.nn.Sequential(torch.nn.Linear(sizes[0], sizes[1]), torch.nn.Tanh(),
                                torch.nn.Linear(sizes[1], sizes[2])).to(torch.bfloat16)
    opt = mk.optim.ShardedOptimizer(model.parameters(), "adamw", lr=1e-3, offload=offload,
                                    state_precision=state_precision, max_grad_norm=1.0,
                                    accumulation_steps=window, gradients=gradients)
    x = torch.randn(window, 5, sizes[0], dtype=torch.bfloat16)

    def step():
        for i in range(window):
            opt.backward(model(x[i]).float().square().mean())
        opt.step()
        opt.zero_grad()

    return model, opt, x, step


def _build(offload, state_precision="32bit", window=1, sizes=(37, 41, 3), gradients="device"):
    def build() -> TrainingSetup:
        model, opt, _, step = _parts(offload, state_precision, window, sizes, gradients)
        return TrainingSetup(model, opt, step)

    return build


def test_offload_for_a_gpu_keeps_the_optimizer_on_the_host_counted_by_hand():
    plan = plan_training_step(_build("cpu"), device="cuda")
    # one unit of slots: 37*41 -> 1536, 41 -> 256, 41*3 -> 256, 3 -> 256 elements
    n = 1536 + 256 + 256 + 256
    pinned_copy = 8192  # 2 * n = 4608 bytes of bf16, rounded up to a power of two
    scalars = 8 + 4 + 8  # the pinned verdict, multiplier and speculation scalars
    state = 2 * 4 * n + 4  # the two float32 moments and the step counter
    verdict = 1  # step(): "is the multiplier the speculative one?", a bool made on the host
    expected = {"weights": pinned_copy, "gradients": pinned_copy, "master weights": 4 * n,
                "optimizer state": state + scalars + verdict,
                "state copies": 4 * n + state}  # a speculative step's copy of master + state
    assert plan.host_by_category == expected
    assert plan.host_peak == sum(expected.values())
    assert plan.host_pinned == 2 * pinned_copy + scalars
    # on the device: the 16-bit weights and gradients, none of the optimizer's state
    assert plan.held["parameters"] == plan.held["gradients"] == 2 * n
    assert plan.held["master weights"] == plan.held["optimizer state"] == 0


def test_offload_on_one_rank_of_two_for_a_gpu_keeps_its_shard_on_the_host():
    """ZeRO-2 with offload, rank 0 of 2, planned for a GPU: the host holds this rank's half,
    counted by hand (no speculative copies: across ranks the host step waits for the
    verdict); the device none of the optimizer's state."""
    def build() -> TrainingSetup:
        model = torch.nn.Sequential(torch.nn.Linear(512, 512),
                                    torch.nn.Linear(512, 512)).to(torch.bfloat16)
        opt = mk.optim.ShardedOptimizer(model.parameters(), "adamw", lr=1e-3, offload="cpu",
                                        zero_stage=2)
        x = torch.randn(4, 512, dtype=torch.bfloat16)

        def step():
            opt.backward(model(x).float().square().mean())
            opt.step()
            opt.zero_grad()

        return TrainingSetup(model, opt, step)

    plan = plan_training_step(build, device="cuda", world_size=2)
    shard = (262144 + 512) * 2 // 2  # two layers' slots (weight, bias), half on this rank
    pinned_copy = 1 << 20  # 2 * shard = 525312 bytes, rounded up to a power of two
    assert plan.host_by_category == {"weights": pinned_copy, "gradients": pinned_copy,
                                     "master weights": 4 * shard,
                                     "optimizer state": 8 * shard + 4 + 8}  # + step, scalars
    assert plan.held["master weights"] == plan.held["optimizer state"] == 0


@pytest.mark.parametrize("state_precision", ["32bit", "8bit"])
@pytest.mark.parametrize("offload,gradients", [(None, "device"), ("cpu", "device"),
                                               (None, "host")])
def test_offload_plan_matches_the_measured_cpu_step(monkeypatch, offload, gradients,
                                                     state_precision):
    """On the CPU host memory is the device's: the planned peak is the measured one. The host
    steps run on the step's thread, as the planner runs them (a worker thread's race with
    step() decides which buckets a real run steps speculatively, with a copy of their state;
    the plan counts them all)."""
    monkeypatch.setattr(_fake, "thread_pool",
                        lambda like, workers, **kwargs: _fake._OnTheCallersThread())
    plan = plan_training_step(_build(offload, state_precision, 2, (61, 97, 5), gradients),
                              device="cpu")
    torch.manual_seed(1)
    model, opt, x, step = _parts(offload, state_precision, 2, (61, 97, 5), gradients)
    step()  # the optimizer's state (and offload's copies) exist from here on, as in the plan
    measured = reachable_bytes(model, opt, x) + allocation_stats(step).peak
    assert abs(plan.peak_bytes / measured - 1) <= TOLERANCE, (plan.peak_bytes, measured)
    assert (plan.host_peak > 0) == (offload is not None or gradients == "host")


def test_host_allocator_rounds_pinned_blocks_and_reuses_them_by_size():
    a = HostAllocator()
    first = a.malloc(5000, "pinned")  # an 8192-byte block
    assert (a.pinned, a.allocated) == (8192, 8192)
    a.free(first)  # cached, not returned
    assert (a.pinned, a.cached, a.allocated) == (8192, 8192, 8192)
    a.malloc(8000, "pinned")  # the same rounded size: the cached block again
    assert (a.pinned, a.cached) == (8192, 0)
    a.malloc(3000, "pinned")  # 4096: a new block
    exact = a.malloc(3000, "pinned exact")  # page-locked at its size
    assert a.pinned == 8192 + 4096 + 3000
    a.free(exact)
    assert a.pinned == 8192 + 4096
    page = a.malloc(12345, "pageable")
    assert a.allocated == 8192 + 4096 + 12345
    a.free(page)
    assert a.allocated == 8192 + 4096
    assert a.peak_allocated == 8192 + 4096 + 12345


def test_plan_command_shows_the_host_memory_of_offload(capsys):
    from memkern import cli

    tiny = ["--hf", "llama", "--set", "hidden_size=32", "--set", "intermediate_size=64",
            "--set", "num_hidden_layers=2", "--set", "num_attention_heads=2",
            "--set", "num_key_value_heads=1", "--set", "vocab_size=96"]
    assert cli.main(["plan", *tiny, "--batch", "2", "--seq", "9", "--variant", "patch",
                     "--offload", "cpu", "--state-precision", "8bit"]) == 0
    out = capsys.readouterr().out
    assert 'offload="cpu"' in out.splitlines()[1] and 'state_precision="8bit"' in out
    header = next(line for line in out.splitlines() if line.startswith("plan ") and "peak" in line)
    assert header.split()[-1] == "host"
    assert "host memory: peak" in out and "master weights" in out


_LLAMA = dict(hidden_size=96, intermediate_size=200, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=301, max_position_embeddings=64,
              attn_implementation="sdpa")


def test_full_host_plan_matches_the_measured_cpu_step():
    """memkern.checkpoint(block, "full-host") on every decoder layer of a transformers Llama:
    the CPU plan against the same step run for real, measured as the other transformers plans
    are (tests/test_profile_plan.py: the step's peak above its start, with the parameters and
    the optimizer state), within 3%; the host buffers, which persist from step to step, counted
    by hand."""
    import transformers

    from memkern.profile import hf_config, hf_workload
    from memkern.profile.blocks import repeated_blocks

    cfg = hf_config("llama", _LLAMA)
    plan = plan_training_step(hf_workload(cfg, batch=9, seq=61, dtype=torch.float32, patch={},
                                          optimizer="adamw", checkpoint="full-host"),
                              device="cpu")
    planned = plan.held["parameters"] + plan.held["optimizer state"] + plan.step_peak_above_start
    model = mk.patch(transformers.AutoModelForCausalLM.from_config(cfg).train())
    for _, block in repeated_blocks(model):
        mk.checkpoint(block, "full-host")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    ids = torch.randint(1, cfg.vocab_size, (9, 61))

    def step():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    held = sum(t.untyped_storage().nbytes() for t in model.parameters()) + sum(
        v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values()
        if v.dim())
    measured = held + allocation_stats(step).peak
    assert abs(planned / measured - 1) <= TOLERANCE, (planned, measured)
    # the inputs of every layer but the last wait in (pageable) host memory: float32 here
    assert plan.host_by_category == {"activations": (6 - 1) * 9 * 61 * 96 * 4}


def test_full_host_for_a_gpu_keeps_the_blocks_inputs_on_the_host_counted_by_hand():
    """Planned for a GPU: the inputs of every decoder layer but the last (whose backward comes
    first, at once) wait on the host, pinned at their exact size: (layers - 1) x batch x seq x
    hidden x 2 bytes of bf16."""
    from memkern.profile import hf_config, hf_workload

    cfg = hf_config("llama", _LLAMA)
    plan = plan_training_step(hf_workload(cfg, batch=3, seq=61, patch={}, optimizer="sharded",
                                          checkpoint="full-host"), device="cuda")
    inputs = (6 - 1) * 3 * 61 * 96 * 2
    assert plan.host_by_category == {"activations": inputs}
    assert plan.host_pinned == inputs
