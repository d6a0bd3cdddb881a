"""Killed anywhere, resumed exactly: a 2-rank ZeRO-2 run, one with offload="cpu" and 8-bit
state, one with gradients="host" (streamed to host memory) and 8-bit state, and one process's
offload="cpu" on each rank (its host steps start during backward, on host copies of the
weights; it resumes by loading the optimizer's state before the model's weights, which the
optimizer must take rather than overwrite: issue 45). Each checkpoints every EVERY windows
under ``torchrun --max-restarts``, each rank SIGKILLed at seeded points
(tests/scripts/kill_resume_train.py has the points and the hooks): inside backward (also while
buckets stream to the host), inside the fused step, inside the host step, between a
checkpoint's publishing renames. torchrun restarts both ranks each time, the run resumes from
the last complete checkpoint by itself, loses at most EVERY windows, and ends with parameters
and optimizer state equal to the uninterrupted run's bit for bit. ``scripts/kill_resume.py``
kills at random moments instead, as many times as asked.

The same for ``MemkernTrainer`` (tests/scripts/kill_resume_trainer.py: Hugging Face's Trainer
saving a checkpoint every TRAINER_EVERY steps, fp16 with skipped steps, ZeRO-2), killed in
backward, inside the fused step and in the middle of a checkpoint's files; it resumes by
itself (``resume_from_checkpoint=last_complete_checkpoint(output_dir)``)."""
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "scripts", "kill_resume_train.py")
TRAINER_SCRIPT = os.path.join(REPO, "tests", "scripts", "kill_resume_trainer.py")
EVERY, WINDOWS = 4, 10
KILLS = ["zero2:backward:2:1", "zero2:step:5:0",
         "offload-8bit:step:2:1", "offload-8bit:renamed:7:0",
         "streamed-8bit:backward:3:0", "streamed-8bit:step:6:1",
         "offload-1proc:step:2:0", "offload-1proc:backward:5:1"]
"""``<mode>:<point>:<window>:<rank>``: the seeded kills of the CI run."""
TRAINER_EVERY, TRAINER_STEPS = 2, 8
TRAINER_KILLS = ["trainer:backward:1:1", "trainer:step:4:0", "trainer:saved:5:0"]
"""``trainer:<point>:<steps done>:<rank>``: the seeded kills of MemkernTrainer's CI run."""


def torchrun_command(directory: str, restarts: int, windows: int = WINDOWS,
                     every: int = EVERY, phases: str = "reference,resumed",
                     slow: float = 0.0, trainer: bool = False) -> list[str]:
    """The training script (``trainer``: MemkernTrainer's, ``windows`` its steps) in 2
    processes under torchrun (a fresh port)."""
    script, length = (TRAINER_SCRIPT, "--steps") if trainer else (SCRIPT, "--windows")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", "--max-restarts", str(restarts), script, "--dir", directory, length,
            str(windows), "--every", str(every), "--phases", phases, "--slow", str(slow)]


def torchrun_env(kills: list[str]) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1",
            "MEMKERN_KILL_AT": ",".join(kills)}


def lost_windows(directory: str, rank: int) -> dict[str, list[tuple[int, int]]]:
    """Per mode, ``(windows done when killed, window resumed at)`` per restart of the resumed
    run, from the rank's log."""
    restarts: dict[str, list[tuple[int, int]]] = {}
    done: dict[str, int] = {}
    with open(os.path.join(directory, f"log.{rank}")) as fh:
        for line in fh:
            mode, phase, what, window = line.split()
            if phase != "resumed":
                continue
            if what == "done":
                done[mode] = int(window) + 1
                continue
            if mode in done:  # not the run's first start
                restarts.setdefault(mode, []).append((done[mode], int(window)))
            done[mode] = int(window)
    return restarts


def assert_equal_runs(directory: str, mode: str) -> None:
    """The resumed run's parameters and optimizer state equal the reference's bit for bit."""
    ref = torch.load(os.path.join(directory, mode, "reference", "final.pt"), weights_only=False)
    got = torch.load(os.path.join(directory, mode, "resumed", "final.pt"), weights_only=False)
    for i, (a, b) in enumerate(zip(ref["params"], got["params"])):
        assert torch.equal(a, b), f"{mode}: parameter {i}"
    assert (ref["loss_scale"], ref["skipped"]) == (got["loss_scale"], got["skipped"])
    assert ref["skipped"] >= 1  # overflowing windows were skipped in both
    assert ref["state"]["param_groups"] == got["state"]["param_groups"]
    assert ref["state"]["memkern"]["loss_scaler"] == got["state"]["memkern"]["loss_scaler"]
    for i, state in ref["state"]["state"].items():
        for key, value in state.items():
            other = got["state"]["state"][i][key]
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            assert same, f"{mode}: state {key!r} of parameter {i}"


def check_run(directory: str, modes: list[str], every: int) -> int:
    """Asserts every mode's resumed run equals its reference and no restart lost more than
    ``every`` windows or resumed elsewhere than at a checkpoint; returns the restarts seen."""
    restarts = 0
    for rank in (0, 1):
        for mode, resumes in lost_windows(directory, rank).items():
            for done, start in resumes:
                assert start % every == 0 and 0 <= done - start <= every, (mode, done, start)
            restarts += len(resumes) if rank == 0 else 0
    for mode in modes:
        assert_equal_runs(directory, mode)
    return restarts


def run_killed(directory, kills: list[str], **command) -> None:
    """Runs the training script under torchrun, killed at ``kills``; asserts that it finished
    and that every kill fired."""
    run = subprocess.run(torchrun_command(str(directory), restarts=len(kills), **command),
                         cwd=REPO, env=torchrun_env(kills), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    fired = sum(len(open(directory / f"fired.{r}").read().split())
                for r in (0, 1) if os.path.exists(directory / f"fired.{r}"))
    assert fired == len(kills)


@pytest.mark.slow
def test_killed_at_seeded_points_resumes_bit_for_bit(tmp_path):
    run_killed(tmp_path, KILLS)
    assert check_run(str(tmp_path), ["zero2", "offload-8bit", "streamed-8bit", "offload-1proc"],
                     EVERY) == len(KILLS)


@pytest.mark.slow
def test_memkern_trainer_killed_at_seeded_points_resumes_bit_for_bit(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    run_killed(tmp_path, TRAINER_KILLS, trainer=True, windows=TRAINER_STEPS,
               every=TRAINER_EVERY)
    assert check_run(str(tmp_path), ["trainer"], TRAINER_EVERY) == len(TRAINER_KILLS)
