"""The planner (memkern.profile.plan_training_step): a training step measured on fake tensors.

Oracles:
* the CUDA caching allocator model: block sizes worked out by hand from the rules of
  c10/cuda/CUDACachingAllocator.cpp (512-byte rounding, 2 MiB / 20 MiB / rounded segments,
  the split thresholds, best fit, merging);
* the planned peak of a CPU step: the same step run for real and measured by the profiler's
  allocation trace (``memkern bench``'s own measurement, and ``allocation_stats`` for
  transformers models) — independent of the planner's dispatch-mode bookkeeping. Within 5%.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import memkern as mk
from conftest import needs_layer_extension
from memkern.bench.data import stdlib_corpus
from memkern.bench.model import SIZES, GPTConfig
from memkern.bench.runner import run
from memkern.bench.workload import bench_workload
from memkern.profile import allocation_stats
from memkern.profile.caching_allocator import CudaCachingAllocator
from memkern.profile.plan import CATEGORIES, plan_training_step
from memkern.profile.workloads import hf_config, hf_workload

KIB, MIB = 1 << 10, 1 << 20
TOLERANCE = 0.05


# ---------------------------------------------------------------------------------- allocator


def test_small_requests_round_to_512_and_share_a_2mib_segment():
    a = CudaCachingAllocator()
    blocks = [a.malloc(n) for n in (1, 511, 512, 513, 1000 * KIB)]
    assert [b.size for b in blocks] == [512, 512, 512, 1024, 1000 * KIB]
    assert a.reserved == 2 * MIB and a.allocated == 2560 + 1000 * KIB
    a.malloc(1000 * KIB)  # fits the segment's remainder (1 MiB + 21 KiB)
    assert a.reserved == 2 * MIB
    a.malloc(1000 * KIB)  # the remainder (45.5 KiB) is too small: a second segment
    assert a.reserved == 4 * MIB


def test_large_request_splits_only_above_1mib_remainder():
    a = CudaCachingAllocator()
    mid = a.malloc(9 * MIB)  # under 10 MiB: a 20 MiB segment, 11 MiB left > 1 MiB: split
    assert mid.size == 9 * MIB and a.reserved == 20 * MIB
    rest = a.malloc(10 * MIB + 512)  # the 11 MiB remainder fits; 1 MiB - 512 left: not split
    assert rest.size == 11 * MIB and a.reserved == 20 * MIB
    odd = a.malloc(23 * MIB + 1)  # its own segment, rounded to 24 MiB; 1 MiB - 512 left
    assert odd.size == 24 * MIB and a.reserved == 44 * MIB
    assert a.allocated == a.peak_allocated == 44 * MIB


def test_a_1mib_request_is_the_small_pools_largest_and_one_byte_more_is_large():
    """The pools' boundary: kSmallSize (1 MiB) itself is small (``size <= kSmallSize``)."""
    a = CudaCachingAllocator()
    small = a.malloc(MIB)  # a 2 MiB small segment, split: 1 MiB left for the small pool
    assert small.size == MIB and small.small and a.reserved == 2 * MIB
    again = a.malloc(MIB)  # the remainder fits exactly: no second segment
    assert again.size == MIB and a.reserved == 2 * MIB
    large = a.malloc(MIB + 1)  # 1 MiB + 512 after rounding: a 20 MiB large segment, split
    assert large.size == MIB + 512 and not large.small and a.reserved == 22 * MIB
    assert a.allocated == a.peak_allocated == 3 * MIB + 512


def test_best_fit_reuse_and_merge_on_free():
    a = CudaCachingAllocator()
    x, y, z = (a.malloc(n * MIB) for n in (4, 3, 5))  # one 20 MiB segment: 4 | 3 | 5 | 8 free
    assert a.reserved == 20 * MIB
    a.free(y)
    w = a.malloc(2 * MIB)  # best fit: the 3 MiB hole, not the 8 MiB tail; 1 MiB left: whole
    assert w.size == 3 * MIB and a.reserved == 20 * MIB
    a.free(w)
    a.free(x)
    a.free(z)  # everything merges back into one free 20 MiB block
    big = a.malloc(19 * MIB + 512)
    assert big.size == 20 * MIB and a.reserved == 20 * MIB
    assert a.peak_allocated == 20 * MIB


# ---------------------------------------------------------------------------------- planner


def _bench_peak(config: str, size: str, batch: int, seq: int) -> int:
    base = SIZES[size]
    cfg = GPTConfig(base.layers, base.width, base.heads, seq=seq, vocab=base.vocab)
    [row] = run([config], cfg, stdlib_corpus(), steps=3, batch=batch, device=torch.device("cpu"),
                progress=False)
    return row.peak_bytes


PLANNABLE = ("torch-fp32", "torch-amp", "memkern-modules", "memkern-full", "memkern-full-ckpt",
             "memkern-full-8bit")


@pytest.mark.parametrize("size,batch,seq", [("tiny", 3, 37), ("small", 2, 64)])
@pytest.mark.parametrize("config", PLANNABLE)
def test_plan_matches_memkern_bench_on_the_cpu(config, size, batch, seq):
    plan = plan_training_step(bench_workload(config, size, batch=batch, seq=seq), device="cpu")
    # memkern bench's CPU peak: the persistent state at the step's start + the step's peak
    # allocation above its start (the profiler's trace of one step)
    planned = sum(plan.held.values()) + plan.step_peak_above_start
    measured = _bench_peak(config, size, batch, seq)
    assert abs(planned / measured - 1) <= TOLERANCE, (planned / MIB, measured / MIB)
    assert sum(plan.peak.by_category.values()) == plan.peak_bytes
    assert set(plan.peak.by_category) == set(CATEGORIES)


@pytest.mark.parametrize("patch", [None, {}, {"recompute": "full"}, {"loss": False}])
def test_plan_matches_a_transformers_step_on_the_cpu(patch):
    cfg = hf_config("llama", dict(hidden_size=96, intermediate_size=200, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=3001,
                                  max_position_embeddings=64, attn_implementation="sdpa"))
    workload = hf_workload(cfg, batch=3, seq=61, dtype=torch.float32, patch=patch,
                           optimizer="adamw")
    plan = plan_training_step(workload, device="cpu")
    planned = plan.held["parameters"] + plan.held["optimizer state"] + plan.step_peak_above_start

    import transformers

    import memkern

    model = transformers.AutoModelForCausalLM.from_config(cfg).train()
    if patch is not None:
        memkern.patch(model, **patch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    ids = torch.randint(1, cfg.vocab_size, (3, 61))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer's state exists from here on, as in the plan's measured step
    held = sum(t.untyped_storage().nbytes() for t in model.parameters()) + sum(
        v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values()
        if v.device.type == "cpu" and v.dim())
    measured = held + allocation_stats(step).peak
    assert abs(planned / measured - 1) <= TOLERANCE, (planned / MIB, measured / MIB)


def test_each_persistent_category_holds_its_own_bytes():
    """A bf16 model under ShardedOptimizer's AdamW, every byte counted by hand: weights and
    gradients in one flat buffer each, the float32 master, the two moments and the step
    counter each in their own category (not only their sum)."""
    import memkern as mk
    from memkern.profile.plan import TrainingSetup

    def setup():
        model = torch.nn.Sequential(torch.nn.Linear(37, 29), torch.nn.Tanh(),
                                    torch.nn.Linear(29, 3)).to(torch.bfloat16)
        opt = mk.optim.ShardedOptimizer(model.parameters(), "adamw", lr=1e-3)
        x = torch.randn(5, 37, dtype=torch.bfloat16)

        def step():
            opt.backward(model(x).float().square().mean())
            opt.step()
            opt.zero_grad()

        return TrainingSetup(model, opt, step)

    plan = plan_training_step(setup, device="cpu")
    # each parameter in a slot of a multiple of 256 elements: 37*29, 29, 29*3, 3 elements
    slots = 1280 + 256 + 256 + 256
    expected = {"parameters": 2 * slots, "gradients": 2 * slots, "master weights": 4 * slots,
                "optimizer state": 2 * 4 * slots + 4}
    assert {k: plan.held[k] for k in expected} == expected
    optimizer_phase = plan.phase_peaks["optimizer"].by_category
    assert {k: optimizer_phase[k] for k in expected} == expected


def test_peak_phases_and_second_moment():
    """The step's phases are all measured; the second-highest moment is another phase's peak,
    no higher than the peak; a GPU plan counts cuBLAS's two workspaces (main and backward
    thread), which a CPU plan does not have."""
    cuda = plan_training_step(bench_workload("memkern-full", "tiny", batch=2, seq=16))
    cpu = plan_training_step(bench_workload("memkern-full", "tiny", batch=2, seq=16),
                             device="cpu")
    for plan in (cuda, cpu):
        assert set(plan.phase_peaks) == {"forward", "backward", "optimizer"}
        assert plan.second.phase != plan.peak.phase
        assert plan.second.allocated <= plan.peak.allocated <= plan.run_peak
    workspaces = {op for m in cuda.phase_peaks.values() for op in m.by_op["transient"]
                  if op.startswith("cuBLAS workspace")}
    assert {w.split(")")[0] for w in workspaces} == {"cuBLAS workspace (main thread",
                                                     "cuBLAS workspace (backward thread"}
    assert not any("cuBLAS" in op for m in cpu.phase_peaks.values()
                   for op in m.by_op["transient"])


def test_attention_output_has_the_kernels_layout():
    """What the planner relies on, with no correction: the stand-in's attention op under fake
    tensors lays its output out as the kernels do — torch's CPU flash kernel (run here) and
    the CUDA kernels (``empty_like`` of ``q.transpose(1, 2)``, transposed back: worked out by
    hand) — for a dense ``q`` and for GPT-2's strided ``qkv`` split. A layout that differed
    would make the consumer's ``transpose(1, 2).reshape`` copy in the plan and not on the
    device."""
    from memkern._fake import fake_mode

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    b, t, h, d = 3, 17, 4, 8
    layouts = {"dense": (lambda x: x.reshape(b, t, 3 * h, d).transpose(1, 2).contiguous()
                         .view(b, 3, h, t, d).unbind(1), (h * t * d, t * d, d, 1)),
               "split": (lambda x: [y.transpose(1, 2) for y in x.unbind(2)],
                         (t * h * d, d, h * d, 1))}
    for name, (split, cuda) in layouts.items():
        q, k, v = split(torch.randn(b, t, 3, h, d))
        kernel = op(q, k, v, 0.0, True)[0]
        with fake_mode():
            planned = op(*split(torch.empty(b, t, 3, h, d)), 0.0, True)[0]
        assert planned.shape == kernel.shape and planned.stride() == kernel.stride() == cuda, name


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "memkern.cli", "plan", *args],
                          capture_output=True, text=True, env=env, timeout=600)


def test_plan_command_writes_table_json_and_plot(tmp_path):
    json_path, png_path = tmp_path / "plan.json", tmp_path / "plan.png"
    proc = _cli("--device", "cpu", "--size", "tiny", "--batch", "3", "--seq", "19", "--configs",
                "torch-fp32,memkern-full", "--json", str(json_path), "--plot", str(png_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(png_path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(json_path) as fh:
        plans = json.load(fh)["plans"]
    assert set(plans) == {"torch-fp32", "memkern-full"}
    for plan in plans.values():
        peak = plan["peak"]
        assert sum(peak["by_category"].values()) == peak["allocated"]
        assert f"{peak['allocated'] / MIB:.1f}" in proc.stdout  # the summary row
        assert set(plan["phase_peaks"]) == {"forward", "backward", "optimizer"}


@pytest.mark.parametrize("flags,needle", [
    (["--hf", "llama", "--variant", "patch:frobnicate=1"], "--variant"),
    (["--set", "hidden_size=64"], "--hf"),
    (["--hf", "not-a-model-type"], "not-a-model-type"),
    (["--hf", "bert-base-uncased"], "Hub model ids are not fetched"),
    (["--hf", "llama", "--optimizer", "adamw", "--offload", "cpu"], "--optimizer sharded"),
    (["--offload", "cpu"], "--hf"),
    (["--configs", "torch-amp-compiled"], "compile"),
])
def test_plan_command_bad_input_is_one_line(flags, needle):
    proc = _cli("--device", "cpu", *flags)
    assert proc.returncode == 2
    assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_plan_counts_logsumexp_temporary_on_the_cpu():
    """torch's CPU ``logsumexp`` takes ``exp(x - max)`` into a temporary of its input's size
    (the reference cross-entropy runs it on every logits block): a step that takes the
    log-sum-exp of a [183, 3001] float32 activation is planned within 5% of its measured CPU
    peak, and the plan names the workspace at least the input's size."""
    from memkern.profile import TrainingSetup
    from memkern.profile.allocations import allocation_stats

    def build() -> TrainingSetup:
        model = torch.nn.Linear(96, 3001)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(183, 96)

        def step():
            torch.logsumexp(model(x), 1).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return TrainingSetup(model, opt, step)

    plan = plan_training_step(build, device="cpu")
    workspaces = {op: b for m in plan.phase_peaks.values()
                  for op, b in m.by_op["transient"].items() if "logsumexp workspace" in op}
    assert workspaces and max(workspaces.values()) >= 183 * 3001 * 4, workspaces
    setup = build()
    setup.step()
    held = sum(p.untyped_storage().nbytes() for p in setup.model.parameters())
    measured = held + allocation_stats(setup.step).peak
    planned = sum(plan.held.values()) + plan.step_peak_above_start
    assert abs(planned / measured - 1) <= TOLERANCE, (planned, measured)


class _SumsItsOwnIntermediate(torch.autograd.Function):
    """Its backward returns ``2 * g + g``: a sum of the node's own intermediate, which autograd
    never writes in place (only the engine's sums of two nodes' gradients are)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        doubled = g * 2
        return doubled + g


def _plan_and_measure(loss_of):
    """(planned, measured) bytes of an SGD step on a [3001, 67] parameter whose loss is
    ``loss_of(w, a, c)`` (``a`` [5, 3001], ``c`` [7, 3001]): the [3001, 67] blocks dominate."""
    from memkern.profile import TrainingSetup

    def build() -> TrainingSetup:
        torch.manual_seed(0)
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.randn(3001, 67))
        a, c = torch.randn(5, 3001), torch.randn(7, 3001)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step():
            loss_of(model.w, a, c).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return TrainingSetup(model, opt, step)

    plan = plan_training_step(build, device="cpu")
    setup = build()
    setup.step()
    measured = setup.model.w.untyped_storage().nbytes() + allocation_stats(setup.step).peak
    return sum(plan.held.values()) + plan.step_peak_above_start, measured


def test_plan_sums_two_nodes_gradients_in_place_as_autograd_does():
    """A parameter used twice gets two gradients, which autograd's engine sums over the first
    (``InputBuffer``: in place when it holds the last reference) — but never for fake tensors;
    the plan must not hold the sum beside both (it planned 1.33x the measured peak)."""
    planned, measured = _plan_and_measure(lambda w, a, c: (a @ w).sum() + (c @ w).square().sum())
    assert abs(planned / measured - 1) <= TOLERANCE, (planned, measured)


def test_plan_keeps_a_nodes_own_sum_out_of_place():
    """...while a node's sum of its own intermediate takes a block of its own, on the device as
    in the plan (taking it for the engine's sum planned 0.67x the measured peak)."""
    planned, measured = _plan_and_measure(lambda w, a, c: _SumsItsOwnIntermediate.apply(w).sum())
    assert abs(planned / measured - 1) <= TOLERANCE, (planned, measured)



@needs_layer_extension
def test_plan_sees_the_linear_cross_entropy_blocks_and_the_planned_devices_gemm():
    """The linear cross-entropy's C++ node reaches its loop ops through the dispatcher; the
    planner runs their references there, so a plan sees the forward's [chunk, V] block and the
    backward's [N, width] block (the ops' fake implementations make only their outputs) and
    takes the planned device's float16 weight-gradient GEMM: cuBLAS's float32-out GEMM on a
    GPU (aten::mm.dtype), float32 copies of the operands on the CPU (aten::to.dtype)."""
    from memkern.ops.linear_cross_entropy import block_sizes
    from memkern.profile import TrainingSetup

    N, H, V = 517, 256, 5003
    chunk, width = block_sizes(N, V, H, 2, True, True)

    def build() -> TrainingSetup:
        model = mk.nn.LinearCrossEntropy(H, V).to(torch.float16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(N, H, dtype=torch.float16, requires_grad=True)
        t = torch.randint(0, V, (N,))

        def step():
            model(x, t).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return TrainingSetup(model, opt, step)

    for device, gemm, not_gemm in (("cuda", "aten::mm.dtype", "aten::to.dtype"),
                                   ("cpu", "aten::to.dtype", "aten::mm.dtype")):
        plan = plan_training_step(build, device=device)
        forward = plan.phase_peaks["forward"].by_op["transient"]
        backward = plan.phase_peaks["backward"].by_op["transient"]
        node = " @ memkern::LinearCrossEntropyBackward"
        assert forward["aten::new_empty @ LinearCrossEntropy"] >= chunk * V * 2, forward
        assert backward["aten::new_empty" + node] >= N * width * 2, backward
        assert backward[gemm + node] >= width * H * 4 and not_gemm + node not in backward, \
            (device, backward)
