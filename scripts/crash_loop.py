"""Runs finished multi-process runs again and again under CPU load and reports every run that
did not exit cleanly: the check that a finished run never dies at exit (``terminate called
without an active exception``, SIGABRT, and the like; docs/reliability.md).

    python scripts/crash_loop.py --runs 50 --load 1 --targets memkern,plain

Targets, run in turn (run 0 of each, then run 1 of each, ...), so that they share the load:

- ``memkern``: ``tests/scripts/zero_exit.py``, a ZeRO-2 ``ShardedOptimizer`` run on 2 gloo
  ranks written as users write it (``torch.multiprocessing.spawn``, steps,
  ``destroy_process_group()``, return: no ``os._exit``).
- ``plain``: its plain-torch twin, ``tests/scripts/zero_exit_torch.py`` (memkern never
  imported, the same asynchronous reduce-scatters and all-gathers, the shards stepped by
  ``torch.optim.AdamW``).
- ``plain-hand``: the twin stepping its shards by hand, no torch optimizer (``--hand-step``).
- ``launch``: the world-size-2 launch of ``tests/test_optim_distributed.py`` (its scenarios,
  two ranks, gloo on a file store).

Core dumps are on (``ulimit -c unlimited``: a crashed rank leaves ``core*`` in its run folder
under ``--out``, read with ``gdb python <core>``); ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` with
``--debug``. ``--load N`` runs N busy-looping processes beside. Prints one line per run (with
the 1-minute load average) and a summary per target; exits 1 if any run failed.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "tests", "scripts")
TEST = os.path.join(REPO, "tests", "test_optim_distributed.py")
sys.path.insert(0, os.path.join(REPO, "tests"))

USER_TARGETS = {"memkern": ["zero_exit.py"], "plain": ["zero_exit_torch.py"],
                "plain-hand": ["zero_exit_torch.py", "--hand-step"]}


def _cores_on() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _commands(target: str, out: str, seed: int) -> list[list[str]]:
    """The processes of one run of ``target`` (started together, in ``out``)."""
    if target in USER_TARGETS:
        script, *flags = USER_TARGETS[target]
        return [[sys.executable, os.path.join(SCRIPTS, script), *flags]]
    from launch_ranks import new_store
    from test_optim_distributed import LAUNCHES

    store = new_store(out)
    return [[sys.executable, TEST, "worker", "--rank", str(rank), "--world", "2", "--store",
             store, "--seed", str(seed), "--scenarios", ",".join(LAUNCHES[2]), "--out", out]
            for rank in range(2)]


def run_once(target: str, out: str, seed: int, debug: bool, timeout: float
             ) -> tuple[list[int | None], list[str]]:
    """One run of ``target`` in ``out``; returns each process's exit code (None: killed at the
    timeout) and output."""
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    if debug:
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    procs = [subprocess.Popen(command, cwd=out, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, preexec_fn=_cores_on)
             for command in _commands(target, out, seed)]
    deadline = time.monotonic() + timeout
    codes, outputs = [], []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
            codes.append(proc.returncode)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            outputs.append(proc.communicate()[0])
            codes.append(None)
    return codes, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="runs of each target")
    parser.add_argument("--targets", default="memkern",
                        help=f"comma-separated, of {sorted(USER_TARGETS) + ['launch']}")
    parser.add_argument("--load", type=int, default=1, help="busy-looping processes beside")
    parser.add_argument("--time-limit", type=float, default=float("inf"),
                        help="seconds: start no run after this long")
    parser.add_argument("--run-timeout", type=float, default=600)
    parser.add_argument("--debug", action="store_true", help="TORCH_DISTRIBUTED_DEBUG=DETAIL")
    parser.add_argument("--out", default=None, help="where failed runs are kept")
    args = parser.parse_args()
    targets = args.targets.split(",")
    for target in targets:
        if target not in USER_TARGETS and target != "launch":
            parser.error(f"--targets: unknown target {target!r}; the targets are "
                         f"{sorted(USER_TARGETS) + ['launch']}")

    out = args.out or tempfile.mkdtemp(prefix="memkern-crash-loop-")
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.load)]
    start = time.monotonic()
    done = {t: 0 for t in targets}
    failed: dict[str, list[tuple[int, str]]] = {t: [] for t in targets}
    loads = []
    try:
        for run in range(args.runs):
            if time.monotonic() - start > args.time_limit:
                break
            for target in targets:
                folder = os.path.join(out, f"{target}-{run:03d}")
                os.makedirs(folder)
                t0 = time.monotonic()
                codes, outputs = run_once(target, folder, seed=run, debug=args.debug,
                                          timeout=args.run_timeout)
                loads.append(os.getloadavg()[0])
                done[target] += 1
                bad = [i for i, code in enumerate(codes) if code != 0]
                what = "ok"
                if bad:
                    last = outputs[bad[0]].strip().splitlines()[-1:] or ["(no output)"]
                    what = f"exit {codes[bad[0]]}: {last[0][:200]}"
                    failed[target].append((run, what))
                    with open(os.path.join(folder, "output.txt"), "w") as fh:
                        for i, text in enumerate(outputs):
                            fh.write(f"===== process {i}, exit {codes[i]}\n{text}\n")
                else:
                    shutil.rmtree(folder)
                print(f"{target} run {run}: {what} ({time.monotonic() - t0:.0f} s, "
                      f"load {loads[-1]:.1f})", flush=True)
    finally:
        for proc in load:
            proc.kill()
            proc.wait()
    if loads:
        print(f"load average (1 min) after the runs: {min(loads):.1f}-{max(loads):.1f}, "
              f"mean {sum(loads) / len(loads):.1f}, with {args.load} busy loop(s) beside")
    for target in targets:
        print(f"{target}: {len(failed[target])} of {done[target]} runs failed"
              + (f" (kept in {out})" if failed[target] else ""))
    sys.exit(1 if any(failed.values()) else 0)


if __name__ == "__main__":
    main()
