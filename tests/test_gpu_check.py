"""scripts/gpu_check.sh's plan, read from its dry run (no GPU, no torch: bash and grep only):
the steps' time limits add up to the budget, each starts where the ones before it end at the
latest, every figure of issue 37 has its step, and a budget the plan overflows says which steps
are cut."""
from __future__ import annotations

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")
ROW = re.compile(r"^(\S+)\s+(\d+)(\+?)\s+(\d+)s\s+(.*)$")


def dry_run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GPU_CHECK_BUDGET", "GPU_CHECK_STEPS", "GPU_CHECK_SKIP")}
    return subprocess.run(["bash", SCRIPT, "--dry-run", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def plan(stdout: str) -> list[tuple[str, int, bool, int, str]]:
    """(step, limit, takes the rest, latest start, the rest of its row) for each step."""
    return [(m[1], int(m[2]), m[3] == "+", int(m[4]), m[5])
            for m in map(ROW.match, stdout.splitlines()) if m]


def test_limits_add_up_to_the_budget_in_order():
    result = dry_run()
    assert result.returncode == 0, result.stderr
    steps = plan(result.stdout)
    assert steps[0][0] == "build" and steps[-1][0] == "cuda-tests" and steps[-1][2]
    start = 0
    for name, limit, _, latest, _ in steps:
        assert latest == start, name
        start += limit
    assert start == 590
    assert "limits: 590s of the 590s budget" in result.stdout
    assert "cut to" not in result.stdout and "longer than the budget" not in result.stdout
    covered = {int(n) for n in re.findall(r"#37\.(\d)", result.stdout)}
    assert covered == set(range(1, 9)), covered


def test_a_short_budget_names_the_steps_it_cuts():
    result = dry_run("300")
    assert result.returncode == 0, result.stderr
    rows = {name: rest for name, _, _, _, rest in plan(result.stdout)}
    assert rows["kernels"].endswith(" run")
    assert "cut to 5s" in rows["overhead-bfloat16"] and "cut to 0s" in rows["cuda-tests"]
    assert "the plan is longer than the budget" in result.stdout


@pytest.mark.parametrize("budget", ["0", "ten", "-5"])
def test_a_bad_budget_is_refused(budget):
    result = dry_run(budget)
    assert result.returncode == 2
    message = f"BUDGET_SECONDS must be a whole number of seconds above 0, got '{budget}'"
    assert message in result.stderr
