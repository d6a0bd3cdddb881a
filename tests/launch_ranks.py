"""Runs a test file's scenarios in W real processes (gloo on the CPU) and collects their results.

A multi-process test file defines ``scenario_<name>(rank, world, seed, out)`` functions, calls
:func:`serve` from its ``if __name__ == "__main__"`` block, and from its tests calls
:func:`launch`, which runs the file as a script in W processes, each running the named
scenarios in order and saving what each returned; the tests compare. The processes meet through
a file store in a fresh directory, not a TCP port, so launches from parallel pytest workers
(``pytest -n``) cannot collide. Every collective has the process group's 60 s timeout and every
launch an overall timeout; when a rank fails the others get a few seconds to fail too (a rank
left waiting in a collective for the failed one is killed), and the test failure shows every
rank's exit status and the end of its output: nothing hangs, and no rank's error is lost.

:func:`run_launcher` does the same for a launcher that starts the ranks itself (``torchrun``,
``accelerate launch``) with ``--tee 3``: each rank's lines reach its output prefixed with
``[default<rank>]:``, and a failure or a timeout reports them rank by rank. The launcher runs
in a session of its own, so that a timeout kills it with the ranks it started.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from clean_exit import end_finished_rank

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH_TIMEOUT = 300
GRACE = 10
"""Seconds the other ranks get to finish once one rank has failed."""

Scenario = Callable[[int, int, int, str], object]


def scenarios_of(namespace: dict[str, object]) -> dict[str, Scenario]:
    """A module's ``scenario_<name>`` functions by name (pass ``globals()``)."""
    return {name.removeprefix("scenario_"): fn for name, fn in namespace.items()
            if name.startswith("scenario_")}


def serve(namespace: dict[str, object], group_kept_by: str | None = None) -> None:
    """A test file run as a script by :func:`launch` (``script worker ...``): one rank running
    the file's scenarios (pass ``globals()``). A rank ends as a user's script does, through
    the interpreter's finalization, after checking that ``destroy_process_group()`` freed the
    group; ``group_kept_by``: what keeps it alive in this file's scenarios, where a rank ends
    without the interpreter's finalization instead (tests/clean_exit.py)."""
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2:], scenarios_of(namespace), group_kept_by)


def fresh_seed() -> int:
    """A random seed for a launch's data, printed so that a failure can be replayed."""
    seed = int(torch.randint(2**20, ()))
    print(f"multi-process seed: {seed}")
    return seed


def worker(argv: list[str], scenarios: dict[str, Scenario], group_kept_by: str | None = None
           ) -> None:
    """One rank: joins the process group and runs the scenarios named on its command line
    (``group_kept_by``: :func:`serve`)."""
    parser = argparse.ArgumentParser()
    for arg in ("rank", "world", "seed"):
        parser.add_argument(f"--{arg}", type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--scenarios", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # W processes share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{args.store}",
                            rank=args.rank, world_size=args.world,
                            timeout=timedelta(seconds=60))
    try:
        for name in args.scenarios.split(","):
            result = scenarios[name](args.rank, args.world, args.seed, args.out)
            torch.save(result, os.path.join(args.out, f"{name}.{args.rank}.pt"))
    finally:
        dist.destroy_process_group()
    end_finished_rank(group_kept_by)


def new_store(parent: str) -> str:
    """A path under ``parent`` for a rendezvous file store that nothing else uses (the file
    must not exist yet)."""
    return os.path.join(tempfile.mkdtemp(prefix="store-", dir=parent), "store")


def _report(world: int, scenarios: list[str], what: str, procs, logs: list[str]) -> str:
    lines = [f"world size {world}, {scenarios}: {what}"]
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        status = "killed (still running)" if proc.returncode is None or proc.returncode < 0 \
            else f"exit status {proc.returncode}"
        with open(log, errors="replace") as f:
            tail = f.read()[-4000:]
        lines.append(f"----- rank {rank}: {status}\n{tail}")
    return "\n".join(lines)


def launch(script: str, world: int, scenarios: list[str], out: str, seed: int,
           timeout: float = LAUNCH_TIMEOUT) -> dict[str, list]:
    """Runs ``script``'s scenarios in ``world`` processes; returns each scenario's per-rank
    results. Fails the calling test, with every rank's output, if a rank fails or the launch
    takes longer than ``timeout`` seconds."""
    store = new_store(out)
    env = rank_environment()
    logs = [os.path.join(os.path.dirname(store), f"rank{r}.log") for r in range(world)]
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen(
                [sys.executable, script, "worker", "--rank", str(rank), "--world", str(world),
                 "--store", store, "--seed", str(seed), "--scenarios", ",".join(scenarios),
                 "--out", out], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    failure = None
    while [p.poll() for p in procs].count(None):  # polls every rank (any() would stop early)
        if failure is None and any(p.returncode for p in procs if p.returncode is not None):
            failure = "a rank failed"
            deadline = min(deadline, time.monotonic() + GRACE)
        if time.monotonic() > deadline:
            failure = failure or f"did not finish in {timeout:.0f} s"
            break
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    if failure is not None or any(p.returncode for p in procs):
        pytest.fail(_report(world, scenarios, failure or "a rank failed", procs, logs),
                    pytrace=False)
    return {name: [torch.load(os.path.join(out, f"{name}.{r}.pt"), weights_only=False)
                   for r in range(world)] for name in scenarios}


# ---------------------------------------------------------------- launchers (torchrun, accelerate)
TAIL = 4000
"""Characters of each rank's output a launcher's failure report shows (its end)."""


def rank_environment(**extra: str) -> dict[str, str]:
    """The ranks' environment: this tree first on the path, one intra-op thread per process
    (the ranks share the machine's cores)."""
    return {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", **extra}


def free_port() -> int:
    """A TCP port nothing listens on now, for a launcher's rendezvous (``--main_process_port``):
    launches from parallel pytest workers must not share one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_RANK_PREFIX = re.compile(r"^\[\w*?(\d+)\]:")


def by_rank(output: str) -> dict[str, str]:
    """A ``--tee 3`` launcher's output split by rank (``[default1]:...`` lines go to rank 1),
    the launcher's own lines under "launcher"."""
    parts: dict[str, list[str]] = {}
    for line in output.splitlines():
        match = _RANK_PREFIX.match(line)
        who = f"rank {match.group(1)}" if match else "launcher"
        parts.setdefault(who, []).append(line[match.end():] if match else line)
    return {who: "\n".join(lines) for who, lines in sorted(parts.items())}


def _launcher_report(what: str, output: str) -> str:
    return what + "".join(f"\n----- {who} (last {TAIL} characters):\n{out[-TAIL:]}"
                          for who, out in by_rank(output).items())


def run_launcher(argv: list[str], *, timeout: float = LAUNCH_TIMEOUT, what: str,
                 **env: str) -> str:
    """Runs a launcher command line that starts the ranks itself (with ``--tee 3``) in the
    repository, with ``env`` added to the environment, until it ends or ``timeout`` seconds
    pass; returns its output. A timeout or a non-zero exit fails the test with each rank's
    output and the launcher's own."""
    proc = subprocess.Popen(argv, cwd=REPO, env=rank_environment(**env),
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the ranks it started
        pytest.fail(_launcher_report(f"{what}: did not finish in {timeout:.0f} s",
                                     proc.communicate()[0] or ""), pytrace=False)
    if proc.returncode:
        pytest.fail(_launcher_report(f"{what}: exit {proc.returncode}", output), pytrace=False)
    return output
