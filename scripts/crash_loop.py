"""Runs the world-size-2 launch of ``tests/test_optim_distributed.py`` again and again under CPU
load and reports every run that did not exit cleanly: the check that a finished multi-process
run never dies at exit (``terminate called without an active exception`` and the like).

    python scripts/crash_loop.py --runs 50 --load 2 --time-limit 3000

Each run is the test's W=2 launch (its scenarios, two ranks, gloo on a file store), with core
dumps on (``ulimit -c unlimited``: a crashed rank leaves ``core*`` in ``--out``'s run folder,
read with ``gdb python <core>``) and ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` unless ``--no-debug``.
``--load N`` runs N busy-looping processes beside it. Prints one line per run and a summary;
exits 1 if any run failed.
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
TEST = os.path.join(REPO, "tests", "test_optim_distributed.py")
sys.path.insert(0, os.path.join(REPO, "tests"))


def _cores_on() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def run_once(scenarios: list[str], out: str, seed: int, debug: bool, timeout: float
             ) -> tuple[list[int | None], list[str]]:
    """One W=2 launch in ``out``; returns each rank's exit code (None: killed at the timeout)
    and output."""
    from test_optim_distributed import new_store

    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    if debug:
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    store = new_store(out)
    procs = [subprocess.Popen(
        [sys.executable, TEST, "worker", "--rank", str(rank), "--world", "2", "--store", store,
         "--seed", str(seed), "--scenarios", ",".join(scenarios), "--out", out],
        cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=_cores_on) for rank in range(2)]
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
    from test_optim_distributed import LAUNCHES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--load", type=int, default=2, help="busy-looping processes beside")
    parser.add_argument("--time-limit", type=float, default=float("inf"),
                        help="seconds: start no run after this long")
    parser.add_argument("--run-timeout", type=float, default=600)
    parser.add_argument("--scenarios", default=",".join(LAUNCHES[2]),
                        help="the W=2 scenarios to run (default: the test's)")
    parser.add_argument("--no-debug", action="store_true",
                        help="without TORCH_DISTRIBUTED_DEBUG=DETAIL")
    parser.add_argument("--out", default=None, help="where failed runs are kept")
    args = parser.parse_args()

    out = args.out or tempfile.mkdtemp(prefix="memkern-crash-loop-")
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.load)]
    start = time.monotonic()
    done, failed = 0, []
    try:
        for run in range(args.runs):
            if time.monotonic() - start > args.time_limit:
                break
            folder = os.path.join(out, f"run-{run:03d}")
            os.makedirs(folder)
            t0 = time.monotonic()
            codes, outputs = run_once(args.scenarios.split(","), folder, seed=run,
                                      debug=not args.no_debug, timeout=args.run_timeout)
            done += 1
            bad = [r for r, code in enumerate(codes) if code != 0]
            what = "ok"
            if bad:
                rank = bad[0]
                last = outputs[rank].strip().splitlines()[-1:] or ["(no output)"]
                what = f"rank {rank} exit {codes[rank]}: {last[0][:200]}"
                failed.append((run, what))
                with open(os.path.join(folder, "output.txt"), "w") as fh:
                    for r, text in enumerate(outputs):
                        fh.write(f"===== rank {r}, exit {codes[r]}\n{text}\n")
            else:
                shutil.rmtree(folder)
            print(f"run {run}: {what} ({time.monotonic() - t0:.0f} s)", flush=True)
    finally:
        for proc in load:
            proc.kill()
            proc.wait()
    print(f"{done} runs of the W=2 launch under load {args.load}: {len(failed)} failed"
          + (f" (kept in {out})" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
