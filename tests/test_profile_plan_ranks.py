"""The planner for one rank of several (``plan_training_step(world_size=)``, a fake process
group: nothing computed, nothing sent), against 2 real gloo ranks on the CPU
(tests/scripts/plan_ranks.py under ``torchrun``: rank 0's persistent storages when its step
starts plus the profiler's allocation-trace peak of that step, as test_profile_plan.py
measures a one-process step). ZeRO-1 and ZeRO-2 (``ShardedOptimizer``) and FSDP2 (``fully_shard``
per decoder layer and on the model) on a memkern-patched Llama, and FSDP2 on the plain one
(whose peak, in the loss's backward, holds the all-gathered embedding and output weights that
FSDP2 frees with ``UntypedStorage.resize_(0)``): within 5%, and the held bytes exactly (a
rank's shards, not the whole model).
"""
import json
import os
import sys

import pytest
import torch

pytest.importorskip("transformers")

from launch_ranks import REPO, run_launcher  # noqa: E402
from memkern.profile import hf_config, hf_workload, plan_training_step  # noqa: E402

CONFIG = dict(hidden_size=96, intermediate_size=200, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=3001, max_position_embeddings=64,
              attn_implementation="sdpa")
WORKLOADS = {"zero1": dict(optimizer="sharded", sharding="zero1"),
             "zero2": dict(optimizer="sharded", sharding="zero2"),
             "fsdp2": dict(optimizer="adamw", sharding="fsdp2"),
             "fsdp2-unpatched": dict(optimizer="adamw", sharding="fsdp2", patch=None)}
COMMON = dict(batch=3, seq=61, dtype="float32", patch={})
TOLERANCE = 0.05


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    result = tmp_path_factory.mktemp("plan_ranks") / "measured.json"
    run_launcher([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc-per-node", "2", "--tee", "3", f"{REPO}/tests/scripts/plan_ranks.py",
                  "--config", json.dumps(CONFIG), "--result", str(result), "--workloads",
                  json.dumps([dict(COMMON, **w) for w in WORKLOADS.values()])],
                 what="torchrun, 2 ranks, measuring sharded steps")
    with open(result) as fh:
        return dict(zip(WORKLOADS, json.load(fh)))


@pytest.fixture(scope="module")
def one_process():
    """The plan of the same step in one process (torch AdamW): the state a rank would hold
    without sharding."""
    return plan_training_step(hf_workload(hf_config("llama", CONFIG), optimizer="adamw",
                                          **dict(COMMON, dtype=torch.float32)), device="cpu")


@pytest.mark.slow
@pytest.mark.parametrize("sharding", sorted(WORKLOADS))
def test_plan_for_one_of_two_ranks_matches_a_gloo_rank(measured, one_process, sharding):
    workload = hf_workload(hf_config("llama", CONFIG),
                           **dict(COMMON, dtype=torch.float32, **WORKLOADS[sharding]))
    plan = plan_training_step(workload, device="cpu", world_size=2)
    real = measured[sharding]
    assert sum(plan.held.values()) == real["held"], (plan.held, real)
    planned = sum(plan.held.values()) + plan.step_peak_above_start
    total = real["held"] + real["step_peak"]
    print(f"{sharding}: planned {planned} B, measured {total} B ({planned / total:.3f}x)")
    assert abs(planned / total - 1) <= TOLERANCE, (planned, total)
    # one rank holds half of the model's optimizer state (and with FSDP2 of its parameters)
    one = one_process.held
    assert plan.held["optimizer state"] < 0.51 * one["optimizer state"]
    fsdp2 = sharding.startswith("fsdp2")
    assert plan.held["parameters"] < (0.51 if fsdp2 else 1.01) * one["parameters"]


def test_world_size_and_sharding_are_checked():
    cfg = hf_config("llama", CONFIG)
    with pytest.raises(ValueError, match="world_size=0 must be >= 1"):
        plan_training_step(hf_workload(cfg, batch=1, seq=8), world_size=0)
    with pytest.raises(ValueError, match="sharding='zero3': choose from zero1, zero2, fsdp2"):
        hf_workload(cfg, batch=1, seq=8, sharding="zero3")
    with pytest.raises(ValueError, match="use optimizer='sharded'"):
        hf_workload(cfg, batch=1, seq=8, sharding="zero2")


@pytest.mark.parametrize("flags,needle", [
    (["--world-size", "2"], "--world-size above 1 and --sharding go together"),
    (["--sharding", "zero2", "--optimizer", "adamw"], "use optimizer='sharded'"),
    (["--sharding", "fsdp2"], "not 'sharded'"),  # the default optimizer is ShardedOptimizer
])
def test_plan_command_bad_sharding_is_one_line(flags, needle):
    import subprocess

    # (PYTHONWARNINGS: without the compiled extension memkern warns once at import)
    proc = subprocess.run([sys.executable, "-m", "memkern.cli", "plan", "--device", "cpu",
                           "--hf", "llama", "--world-size", "2", *flags],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 2
    assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
