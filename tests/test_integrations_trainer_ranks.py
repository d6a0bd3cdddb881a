"""MemkernTrainer across processes: ``torchrun`` and ``accelerate launch`` with 2 gloo ranks on
the CPU, ShardedOptimizer ZeRO-1 and ZeRO-2, against plain ``transformers.Trainer`` in one
process with the same global batch (tests/scripts/trainer_ranks.py: the tiny Llama of
test_integrations_transformers.py, windows of 2, 2 and 1 micro-batches whose token counts
differ between the ranks, clipping and a warm-up schedule, fp32).

One launch trains 6 steps at W=2 (ZeRO-1, torchrun) and saves a checkpoint at step 3; a second
resumes it at W=2 (ZeRO-2, accelerate launch), a third in one process: every logged loss equals
plain Trainer's. In the first launch rank 1 lingers after writing its files of the first
checkpoint (``--late-rank``) and watches for rank 0's completion marker, which must not come
before it is done. The torchrun and accelerate commands of docs/distributed.md run as written.
Each launch runs under a timeout that reports every rank's output (tests/launch_ranks.py).

``MemkernTrainer(fsdp2=True)`` (FSDP2 + memkern's FusedAdamW on the patched model): 2 ranks under
torchrun save at step 3; resumed at 1 rank (torchrun): every logged loss equals plain
Trainer's.
"""
import importlib.util
import json
import os
import re
import shlex
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from launch_ranks import REPO, free_port, run_launcher  # noqa: E402
from memkern.optim.grad_buffer import ALIGN  # noqa: E402
from test_integrations_transformers import one_thread  # noqa: E402

SCRIPT = os.path.join(REPO, "tests", "scripts", "trainer_ranks.py")
STEPS, SAVED_AT = 6, 3
TOLERANCE = 1e-4
"""Relative, on the logged float32 losses (the same math, the ranks' gradients summed in
another order; measured: at most 1e-7)."""


def _in_process(*argv: str) -> None:
    spec = importlib.util.spec_from_file_location("trainer_ranks", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with one_thread():
        module.main(list(argv))


def _result(path) -> dict:
    with open(path) as fh:
        result = json.load(fh)
    result["losses"] = {int(step): loss for step, loss in result["losses"].items()}
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer_ranks")
    seed = str(int(torch.randint(0, 2**16, ())))
    print(f"trainer ranks seed: {seed}")
    common = ["--steps", str(STEPS), "--seed", seed]
    _in_process("--trainer", "plain", "--out", str(tmp / "plain"),
                "--result", str(tmp / "plain.json"), *common)
    run_launcher([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc-per-node", "2", "--tee", "3", SCRIPT, "--zero-stage", "1",
                  "--save-steps", str(SAVED_AT), "--out", str(tmp / "zero1"), "--late-rank",
                  "--result", str(tmp / "zero1.json"), *common],
                 what="torchrun, 2 ranks, ZeRO-1")
    checkpoint = str(tmp / "zero1" / f"checkpoint-{SAVED_AT}")
    run_launcher([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                  "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                  "--dynamo_backend", "no", "--main_process_port", str(free_port()),
                  "--tee", "3", SCRIPT, "--zero-stage", "2", "--resume", checkpoint,
                  "--out", str(tmp / "zero2"), "--result", str(tmp / "zero2.json"), *common],
                 what="accelerate launch, 2 ranks, ZeRO-2, resumed")
    _in_process("--resume", checkpoint, "--out", str(tmp / "one"),
                "--result", str(tmp / "one.json"), *common)
    return {"seed": seed, "checkpoint_files": sorted(os.listdir(checkpoint)),
            **{name: _result(tmp / f"{name}.json") for name in ("plain", "zero1", "zero2", "one")}}


@pytest.fixture(scope="module")
def fsdp2_runs(runs, tmp_path_factory):
    """Plain Trainer's run of ``runs`` (its seed), then MemkernTrainer(fsdp2=True)."""
    tmp = tmp_path_factory.mktemp("trainer_fsdp2")
    common = ["--fsdp2", "--steps", str(STEPS), "--seed", str(runs["seed"])]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--tee", "3"]
    run_launcher([*torchrun, "--nproc-per-node", "2", SCRIPT, "--save-steps", str(SAVED_AT),
                  "--out", str(tmp / "two"), "--result", str(tmp / "two.json"), *common],
                 what="torchrun, 2 ranks, fsdp2")
    checkpoint = str(tmp / "two" / f"checkpoint-{SAVED_AT}")
    run_launcher([*torchrun, "--nproc-per-node", "1", SCRIPT, "--resume", checkpoint,
                  "--out", str(tmp / "one"), "--result", str(tmp / "one.json"), *common],
                 what="torchrun, 1 rank, fsdp2, resumed")
    return {name: _result(tmp / f"{name}.json") for name in ("two", "one")}


def _assert_losses_equal(got: dict, expected: dict, steps) -> None:
    assert sorted(got) == list(steps)
    worst = max(abs(got[s] / expected[s] - 1) for s in steps)
    print(f"steps {steps[0]}-{steps[-1]}: logged losses within {worst:.1e} of plain Trainer's")
    assert worst <= TOLERANCE, (got, expected)


@pytest.mark.slow
def test_two_ranks_log_plain_trainers_losses_with_half_the_state_each(runs):
    plain, zero1, one = runs["plain"], runs["zero1"], runs["one"]
    assert plain["losses"][STEPS] < 0.97 * plain["losses"][1]  # it trains
    _assert_losses_equal(zero1["losses"], plain["losses"], range(1, STEPS + 1))
    # Not wrapped in DistributedDataParallel; each rank holds half of the one-process state
    # (two moments per parameter), give or take the padding of each moment to ALIGN x W.
    whole = one["ranks"][0]["state_elements"]
    assert whole >= 2 * zero1["parameters"]
    for rank in zero1["ranks"]:
        assert rank["wrapper"] == "LlamaForCausalLM" and rank["world"] == 2
        assert abs(rank["state_elements"] - whole / 2) <= 2 * 2 * ALIGN, (rank, whole)


@pytest.mark.slow
def test_two_rank_checkpoint_holds_the_optimizer_in_shards(runs):
    """Across ranks each rank writes its own shards of the optimizer (no rank gathers the
    whole state): a memkern-optimizer folder, no Trainer-style optimizer.pt."""
    from memkern.integrations.transformers import SHARDED_OPTIMIZER
    assert SHARDED_OPTIMIZER in runs["checkpoint_files"]
    assert "optimizer.pt" not in runs["checkpoint_files"]
    assert "scheduler.pt" in runs["checkpoint_files"]


@pytest.mark.slow
def test_a_checkpoint_is_marked_complete_only_once_every_rank_wrote_its_files(runs):
    """Rank 1 of the ZeRO-1 launch lingered after writing its files of the first checkpoint
    (``--late-rank``): rank 0 must not have marked that checkpoint complete meanwhile."""
    ranks = runs["zero1"]["ranks"]
    assert ranks[0]["late"] is None
    assert ranks[1]["late"] == {"marked_before_this_rank_was_done": False}


@pytest.mark.slow
@pytest.mark.parametrize("name,world,stage", [("zero2", 2, 2), ("one", 1, 1)],
                         ids=["same-world-size-zero2", "one-process"])
def test_resumed_from_the_two_rank_checkpoint(runs, name, world, stage):
    """Saved at step 3 by the 2-rank ZeRO-1 run, resumed at 2 ranks with ZeRO-2 (accelerate
    launch) and in one process: steps 4-6 log plain Trainer's losses."""
    resumed = runs[name]
    _assert_losses_equal(resumed["losses"], runs["plain"]["losses"],
                         range(SAVED_AT + 1, STEPS + 1))
    assert [(r["world"], r["zero_stage"]) for r in resumed["ranks"]] == [(world, stage)] * world


@pytest.mark.slow
def test_fsdp2_two_ranks_log_plain_trainers_losses_with_half_the_state_each(runs, fsdp2_runs):
    two, one = fsdp2_runs["two"], fsdp2_runs["one"]
    _assert_losses_equal(two["losses"], runs["plain"]["losses"], range(1, STEPS + 1))
    # FSDP2 units on the patched model, memkern's optimizer; each rank holds the moments of
    # its shards: half of one rank's (dim 0 of an odd size splits unevenly).
    whole = one["ranks"][0]["state_elements"]
    assert whole == 2 * two["parameters"]
    for rank in two["ranks"]:
        assert (rank["wrapper"], rank["optimizer"], rank["world"]) == \
            ("FSDPLlamaForCausalLM", "FusedAdamW", 2)
    assert sum(rank["state_elements"] for rank in two["ranks"]) == whole


@pytest.mark.slow
def test_fsdp2_resumed_at_one_rank_from_the_two_rank_checkpoint(runs, fsdp2_runs):
    """Saved at step 3 by the 2-rank run (full model and optimizer state), resumed at 1 rank
    (torchrun): steps 4-6 log plain Trainer's losses."""
    resumed = fsdp2_runs["one"]
    _assert_losses_equal(resumed["losses"], runs["plain"]["losses"],
                         range(SAVED_AT + 1, STEPS + 1))
    assert [r["world"] for r in resumed["ranks"]] == [1]


LAUNCHERS = {"torchrun": [sys.executable, "-m", "torch.distributed.run", "--tee", "3"],
             "accelerate launch": [sys.executable, "-m", "accelerate.commands.launch",
                                   "--tee", "3"]}
"""A command's launcher as this interpreter runs it, with each rank's output prefixed."""


def _documented_launches() -> list[str]:
    text = open(os.path.join(REPO, "docs", "distributed.md")).read()
    section = text.split("## Launching", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return block.strip().splitlines()


@pytest.mark.slow
@pytest.mark.parametrize("command", _documented_launches())
def test_documented_launch_commands_run_as_written(command, tmp_path):
    launcher = next(name for name in LAUNCHERS if command.startswith(name + " "))
    argv = LAUNCHERS[launcher] + shlex.split(command[len(launcher):])
    output = run_launcher(argv, what=command, TMPDIR=str(tmp_path))  # checkpoints there
    zero = re.search(r"--zero-stage (\d)", command)
    sharding = "FSDP2" if "--fsdp2" in command else f"ZeRO-{zero.group(1) if zero else 1}"
    assert re.search(rf"trained 4 steps, .* 2 process\(es\), {sharding}", output), \
        output[-3000:]


def test_fsdp_settings_are_refused_in_one_line(tmp_path):
    """On the CPU accelerate drops TrainingArguments' fsdp settings and Trainer wraps the model
    in DDP; MemkernTrainer says what to do instead."""
    from memkern.integrations.transformers import MemkernTrainer
    from test_integrations_transformers import Sequences, arguments, tiny_gpt2

    with pytest.raises(ValueError, match=r"drop the fsdp/deepspeed settings and pass "
                                         r"MemkernTrainer\(\.\.\., fsdp2=True\)"):
        MemkernTrainer(model=tiny_gpt2(), train_dataset=Sequences(8, 0),
                       args=arguments(tmp_path, fsdp=True, fsdp_config={"version": 2}))


@pytest.mark.parametrize("settings,message", [
    ({"zero_stage": 2}, r"offload= and zero_stage= are ShardedOptimizer's"),
    ({"offload": "cpu"}, r"offload= and zero_stage= are ShardedOptimizer's"),
    ({"fp16": True}, r"fp16 needs loss scaling"),
    ({"optimizer": True}, r"optimizers=\(opt, \.\.\.\) is not supported; MemkernTrainer builds"),
    ({}, r"FSDP2 needs a process group: launch with torchrun"),
])
def test_fsdp2_refuses_what_it_cannot_run_in_one_line(tmp_path, settings, message):
    from memkern.integrations.transformers import MemkernTrainer
    from test_integrations_transformers import Sequences, arguments, tiny_gpt2

    fp16 = settings.pop("fp16", False)
    model = tiny_gpt2()
    if settings.pop("optimizer", False):
        settings["optimizers"] = (torch.optim.SGD(model.parameters(), lr=0.1), None)
    with pytest.raises(ValueError, match=message):  # in one process: no process group
        MemkernTrainer(model=model, train_dataset=Sequences(8, 0), fsdp2=True,
                       args=arguments(tmp_path, fp16=fp16), **settings)
