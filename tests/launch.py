"""Launching multi-process tests through a launcher that starts the ranks itself (``torchrun``,
``accelerate launch``): every launch runs under a timeout, and a launch that fails or times out
reports every rank's output, not the first failure alone.

The launcher runs with ``--tee 3``, so each rank's lines reach its output prefixed with
``[default<rank>]:``; the report sorts them out by rank. It runs in a session of its own: a
timeout kills the launcher and the ranks it started, and nothing outlives the test.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAIL = 4000
"""Characters of each rank's output a failure report shows (its end: the traceback)."""


def environment(**extra: str) -> dict[str, str]:
    """The ranks' environment: this tree first on the path, one intra-op thread per process
    (the ranks share the machine's cores)."""
    return {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", **extra}


def free_port() -> int:
    """A TCP port nothing listens on now, for a launcher's rendezvous (``--main_process_port``):
    launches from parallel pytest workers must not share one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(proc: subprocess.Popen) -> str:
    """Kills the process's session (a launcher's ranks included); returns what it wrote."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.communicate()[0] or ""


def _report(what: str, outputs: dict[str, str]) -> str:
    return what + "".join(f"\n----- {who} (last {TAIL} characters):\n{out[-TAIL:]}"
                          for who, out in outputs.items())


_RANK_PREFIX = re.compile(r"^\[\w*?(\d+)\]:", re.M)


def by_rank(output: str) -> dict[str, str]:
    """A ``--tee 3`` launcher's output split by rank (``[default1]:...`` lines go to rank 1),
    the launcher's own lines under "launcher"."""
    parts: dict[str, list[str]] = {}
    for line in output.splitlines():
        match = _RANK_PREFIX.match(line)
        who = f"rank {match.group(1)}" if match else "launcher"
        parts.setdefault(who, []).append(line[match.end():] if match else line)
    return {who: "\n".join(lines) for who, lines in sorted(parts.items())}


def run_launcher(argv: list[str], *, timeout: float, what: str, env: dict[str, str] | None = None,
                 cwd: str = REPO) -> str:
    """Runs a launcher command line that starts the ranks itself (with ``--tee 3``) until it
    ends or ``timeout`` seconds pass; returns its output. A timeout or a non-zero exit fails
    the test with each rank's output and the launcher's own."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env or environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        pytest.fail(_report(f"{what}: did not finish in {timeout:.0f} s", by_rank(_kill(proc))))
    if proc.returncode:
        pytest.fail(_report(f"{what}: exit {proc.returncode}", by_rank(output)))
    return output
