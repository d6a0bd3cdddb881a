"""What ``memkern bench`` prints around its tables: the header first (before any training), the
thread count from the cores other processes use now, every configuration's name explained,
and the caution on too few timed rounds (the "held" column against each row's measured bytes
is in test_cli.py, on its bench run).

Oracles: by hand (``/proc/stat`` ticks and their busy cores, the steps that give enough
rounds); the model's own parameter count.
"""
from __future__ import annotations

import io

import pytest
import torch

from memkern import cli
from memkern.bench import timing
from memkern.bench.configs import CONFIGS, DESCRIPTIONS, MIN_STEPS
from memkern.bench.model import GPT
from memkern.bench.runner import Row, untimed_steps


def _row(name: str, step_times: list[float], **bytes_) -> Row:
    median = sorted(step_times)[len(step_times) // 2]
    return Row(name, 3 << 20, 1 << 20, bytes_.get("params", 1), bytes_.get("grads", 1),
               bytes_.get("master", 1), bytes_.get("state", 1), 1000, 16.0, median,
               4096 / median, [2.5, 2.4], step_times=step_times)


def _output(capsys, monkeypatch, rows, steps: int) -> str:
    monkeypatch.setenv("COLUMNS", "100")
    args = cli._parser().parse_args(["bench", "--size", "tiny", "--steps", str(steps)])
    cli._print_bench(rows, cli.SIZES["tiny"], args, torch.device("cpu"))
    return capsys.readouterr().out


# ------------------------------------------------------------------------------- threads
def _fake_proc_stat(monkeypatch, samples: list[str]) -> None:
    """``/proc/stat``'s first line, one per read, and no waiting."""
    lines = iter(samples)
    real_open = open

    def fake_open(path, *args, **kwargs):
        if path == "/proc/stat":
            return io.StringIO(next(lines) + "\ncpu0 1 2 3\n")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    monkeypatch.setattr(timing.time, "sleep", lambda seconds: None)


def test_busy_cores_are_the_non_idle_share_of_the_machine_now(monkeypatch):
    """Between the two samples 400 ticks passed, 200 of them idle or waiting for I/O (150 +
    50): half the machine's time was busy, 2 of its 4 CPUs. Guest time (the 9th and 10th
    columns) is already inside user time and is not added again."""
    _fake_proc_stat(monkeypatch, ["cpu  100 0 100 700 100 0 0 0 55 55",
                                  "cpu  250 0 150 850 150 0 0 0 99 99"])
    monkeypatch.setattr(timing.os, "cpu_count", lambda: 4)
    assert timing.busy_cores() == pytest.approx(2.0)


def test_threads_leave_the_cores_busy_now_not_the_load_average(monkeypatch):
    """Right after a compile the 1-minute load average still reads ~2 on 2 cores; what is
    busy now is 0.3 of a core: 2 threads, and the header says why."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(timing, "busy_cores", lambda seconds=0.25: 0.3)
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (1.97, 1.2, 0.6))
    threads = timing.choose_threads(default=2, cores=2)
    assert threads.count == 2
    assert threads.reason == "2 cores, 0.3 busy with other processes now (measured over 0.25 s)"


def test_threads_fall_back_to_the_load_average_without_proc_stat(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def missing(path, *args, **kwargs):
        raise FileNotFoundError(path)

    monkeypatch.setattr("builtins.open", missing)
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (1.2, 1.0, 1.0))
    assert timing.busy_cores() is None
    threads = timing.choose_threads(default=4, cores=4)
    assert threads == timing.Threads(3, "4 cores, load average 1.2 from other processes")


# -------------------------------------------------------------------------------- header
def test_header_prints_before_any_training(capsys, monkeypatch):
    """The model, its parameter count, the steps, rounds and threads are on stdout before the
    first configuration is built."""
    seen = {}

    def fake_run(names, cfg, corpus, **kwargs):
        seen["before training"] = capsys.readouterr().out
        return [_row(name, [0.1] * 6) for name in names]

    monkeypatch.setattr("memkern.bench.runner.run", fake_run)
    monkeypatch.setattr("memkern.bench.data.stdlib_corpus", lambda: torch.zeros(10))
    args = cli._parser().parse_args(["bench", "--size", "tiny", "--steps", "11", "--threads",
                                     "1", "--configs", "torch-amp,memkern-full", "--quiet"])
    assert cli._bench(args) == 0
    header = " ".join(seen["before training"].split())
    params = sum(p.numel() for p in GPT(cli._model_config(args, torch.device("cpu")))
                 .parameters())
    assert header.startswith(f"memkern bench: GPT tiny ({params / 1e6:.2f}M params, 2 layers")
    assert "11 steps (6 timed rounds)" in header and "1 thread (--threads)" in header


# ---------------------------------------------------------------------- what is printed
def test_every_configuration_is_explained_in_the_output_and_help(capsys, monkeypatch):
    rows = [_row(name, [0.1, 0.2, 0.1, 0.1, 0.2]) for name in CONFIGS]
    out = " ".join(_output(capsys, monkeypatch, rows, 10).split())
    helptext = " ".join(cli._parser()._subparsers._group_actions[0].choices["bench"]
                        .format_help().split())
    for name, what in DESCRIPTIONS.items():
        assert f"{name}: {' '.join(what.split())}" in out
        assert f"{name} {' '.join(what.split())}" in helptext
    assert "ckpt: recomputed in backward" in out and "automatic recomputation" in out


def test_too_few_rounds_give_no_spread_and_a_caution(capsys, monkeypatch):
    """One timed round (``--steps 4``): no spread (a dash), and a note naming the steps that
    give enough rounds; enough rounds: a spread and no such note."""
    steps = 4
    one = [_row("torch-amp", [0.1]), _row("memkern-full", [0.05])]
    out = _output(capsys, monkeypatch, one, steps)
    table = out.split("time, ms per step")[1].split("\n\n")[0]
    assert [ln.split()[-1] for ln in table.splitlines() if ln.startswith("memkern-full")] == ["-"]
    enough = next(n for n in range(MIN_STEPS, 100)
                  if n - untimed_steps(n) >= cli.MIN_ROUNDS_FOR_SPREAD)
    assert enough == 9  # 2 untimed + 3 warm-up + 4 rounds
    note = " ".join(out[out.index("note:"):].split())
    assert note.startswith("note: only 1 timed round:") and f"--steps {enough} or more" in note
    many = [_row("torch-amp", [0.1] * 4), _row("memkern-full", [0.05] * 4)]
    out = _output(capsys, monkeypatch, many, enough)
    assert "note:" not in out and "0%" in out.split("time, ms per step")[1]
