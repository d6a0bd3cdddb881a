"""Kills a 2-rank training run at random moments and checks that it resumes exactly: the
randomised, long form of ``tests/test_optim_kill_resume.py``.

    python scripts/kill_resume.py --runs 10 --kills 4 --seed 1

Runs ``tests/scripts/kill_resume_train.py`` (ZeRO-2, and ZeRO-2 with ``offload="cpu"`` and
8-bit state; a checkpoint every ``--every`` windows) once without kills, as the reference, then
``--runs`` times under ``torchrun --max-restarts`` while this driver SIGKILLs a random rank
after a random delay (uniform in ``--gap`` seconds) once it trains again, up to ``--kills``
times a run: whatever the rank is doing then (backward, the step, the host step, a
checkpoint's writes or renames, a collective). Each run must end with parameters and
optimizer state equal to the reference's bit for bit, every restart resuming at a checkpoint
with at most ``--every`` windows lost. Prints one line per run and the totals; exits 1 on any
failure.

``--trainer`` runs ``tests/scripts/kill_resume_trainer.py`` instead: ``MemkernTrainer`` (fp16,
ZeRO-2) saving a Hugging Face checkpoint every ``--every`` steps (``--windows``: its steps).
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))

from test_optim_kill_resume import check_run, torchrun_command, torchrun_env  # noqa: E402

MODES = ["zero2", "offload-8bit", "streamed-8bit", "offload-1proc"]


def starts(directory: str) -> int:
    """How many times rank 0 has started training (its log's ``start`` lines)."""
    try:
        with open(os.path.join(directory, "log.0")) as fh:
            return sum(" start " in line for line in fh)
    except OSError:
        return 0


def kill_randomly(proc: subprocess.Popen, directory: str, kills: int, gap: tuple[float, float],
                  rng: random.Random) -> int:
    """Once the run trains (again), SIGKILLs a random rank after a random delay; until
    ``kills`` were sent or the run ended. Returns the kills sent."""
    sent = seen = 0
    while sent < kills and proc.poll() is None:
        while starts(directory) == seen and proc.poll() is None:
            time.sleep(0.2)  # the (restarted) ranks are importing, loading
        seen = starts(directory)
        time.sleep(rng.uniform(*gap))
        rank = rng.randrange(2)
        try:
            with open(os.path.join(directory, "pids", str(rank))) as fh:
                pid = int(fh.read())
            os.kill(pid, signal.SIGKILL)
            sent += 1
        except (OSError, ValueError):  # not started yet, or already gone
            continue
    return sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--kills", type=int, default=4, help="kills per run, at most")
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--gap", type=float, nargs=2, default=(2.0, 12.0),
                        help="seconds between kills: uniform in [low, high]")
    parser.add_argument("--slow", type=float, default=0.2, help="sleep per window (seconds)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit", type=float, default=float("inf"),
                        help="seconds: start no run after this long")
    parser.add_argument("--trainer", action="store_true",
                        help="kill MemkernTrainer's run instead of the optimizer's")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    modes = ["trainer"] if args.trainer else MODES
    out = args.out or tempfile.mkdtemp(prefix="memkern-kill-resume-")
    start = time.monotonic()

    reference = os.path.join(out, "reference")
    command = torchrun_command(reference, 0, args.windows, args.every, phases="reference",
                               slow=0.0, trainer=args.trainer)
    subprocess.run(command, cwd=REPO, env=torchrun_env([]), check=True, capture_output=True)

    runs, failed, kills_sent, restarts = 0, 0, 0, 0
    for n in range(args.runs):
        if time.monotonic() - start > args.time_limit:
            break
        directory = os.path.join(out, f"run-{n:03d}")
        for mode in modes:
            shutil.copytree(os.path.join(reference, mode, "reference"),
                            os.path.join(directory, mode, "reference"))
        command = torchrun_command(directory, args.kills + 2, args.windows, args.every,
                                   phases="resumed", slow=args.slow, trainer=args.trainer)
        with open(os.path.join(out, f"run-{n:03d}.log"), "w") as log:
            proc = subprocess.Popen(command, cwd=REPO, env=torchrun_env([]), stdout=log,
                                    stderr=subprocess.STDOUT)
            sent = kill_randomly(proc, directory, args.kills, tuple(args.gap), rng)
            code = proc.wait()
        runs += 1
        kills_sent += sent
        try:
            assert code == 0, f"torchrun exit {code}"
            seen = check_run(directory, modes, args.every)
            restarts += seen
            print(f"run {n}: ok, {sent} kills, {seen} restarts", flush=True)
        except (AssertionError, OSError) as e:
            failed += 1
            print(f"run {n}: FAILED ({sent} kills): {e}", flush=True)
    print(f"{runs} runs, {kills_sent} SIGKILLs sent, {restarts} restarts resumed, "
          f"{runs - failed}/{runs} runs equal to the uninterrupted run bit for bit ({out})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
