"""memkern.bench.timing: rounds in rotated order, ratios as medians of per-round ratios, the
thread count for a shared machine; and memkern bench's runner timing its configurations in
those rounds."""
import random
import statistics
import types

import pytest
import torch

from memkern.bench import runner, timing
from memkern.bench.data import stdlib_corpus
from memkern.bench.model import SIZES, GPTConfig


def test_rounds_rotate_the_order_and_every_piece_runs_once_per_round():
    calls = []
    steps = {name: (lambda name=name: calls.append(name) or float(len(calls)))
             for name in "ABC"}
    times = timing.in_rounds(steps, 4)
    assert "".join(calls) == "ABC" "BCA" "CAB" "ABC"
    # each time is the call's position in the whole sequence: round r's entry at index r
    assert times == {"A": [1.0, 6.0, 8.0, 10.0], "B": [2.0, 4.0, 9.0, 11.0],
                     "C": [3.0, 5.0, 7.0, 12.0]}


@pytest.mark.parametrize("rounds", [1, 2, 5, 16, 17])
def test_ratio_is_the_median_and_quartiles_of_per_round_ratios(rounds):
    """Against float64 sums over the sorted per-round ratios, computed here by hand (the
    quartiles by linear interpolation between order statistics, numpy's default)."""
    rng = random.Random(rounds)
    base = [rng.uniform(0.5, 5.0) for _ in range(rounds)]
    times = [b * rng.uniform(0.2, 3.0) for b in base]
    per_round = sorted(t / b for t, b in zip(times, base))

    def quantile(q: float) -> float:
        pos = q * (rounds - 1)
        lo = int(pos)
        hi = min(lo + 1, rounds - 1)
        return per_round[lo] + (pos - lo) * (per_round[hi] - per_round[lo])

    r = timing.ratio(times, base)
    assert r.rounds == rounds
    assert r.median == pytest.approx(quantile(0.5), rel=1e-12)
    assert r.low == pytest.approx(quantile(0.25), rel=1e-12)
    assert r.high == pytest.approx(quantile(0.75), rel=1e-12)
    assert r.spread == pytest.approx((r.high - r.low) / r.median, rel=1e-12)


def test_ratio_ignores_a_burst_that_a_ratio_of_medians_takes_in():
    """Rounds 0-2 slow for both (a burst), rounds 3-6 quiet: the per-round ratio is 2 in every
    round; with a burst on one side only, the ratio of the medians reads 20, the median of the
    per-round ratios still 2."""
    base = [10.0, 10.0, 10.0, 1.0, 1.0, 1.0, 1.0]
    times = [20.0, 20.0, 20.0, 2.0, 2.0, 2.0, 2.0]
    assert timing.ratio(times, base).median == 2.0
    assert timing.ratio(times, base).spread == 0.0
    skewed = [20.0, 20.0, 20.0, 20.0, 2.0, 2.0, 2.0]  # a burst on one side only
    assert statistics.median(skewed) / statistics.median(base) == 20.0
    assert timing.ratio(skewed, base).median == 2.0


def test_ratio_refuses_unpaired_rounds():
    with pytest.raises(ValueError, match="same number"):
        timing.ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="same number"):
        timing.ratio([], [])


@pytest.mark.parametrize("cores,load,default,expected", [
    (2, 0.0, 2, 2),     # idle: torch's default
    (2, 1.0, 2, 1),     # another job on one core
    (2, 13.9, 2, 1),    # oversubscribed: still one thread
    (16, 2.4, 16, 14),  # two cores busy
    (16, 2.6, 16, 13),  # rounded, not truncated: nearly three cores busy
    (3, 1.7, 3, 1),     # rounded up to two busy cores of three
    (16, 0.0, 8, 8),    # never more than torch's default
])
def test_threads_leave_the_busy_cores_alone(monkeypatch, cores, load, default, expected):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    t = timing.choose_threads(None, default=default, cores=cores, load=load)
    assert t.count == expected
    assert t.reason == f"{cores} cores, load average {load:.1f} from other processes"


def test_threads_requested_or_from_the_environment_win(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert timing.choose_threads(None, default=3, cores=2, load=5.0) == \
        timing.Threads(3, "OMP_NUM_THREADS")
    assert timing.choose_threads(5, default=3, cores=2, load=5.0) == timing.Threads(5, "--threads")


@pytest.mark.parametrize("steps,untimed", [(3, 2), (4, 3), (5, 4), (6, 5), (9, 5), (20, 5)])
def test_bench_leaves_the_warm_up_untimed_and_times_at_least_one_step(steps, untimed):
    """Step 0 (first allocations, compilation), step 1 (profiled) and up to three warm-up
    steps are not timed; at least one step is."""
    assert runner.untimed_steps(steps) == untimed


def test_bench_runner_times_its_configurations_in_rotated_rounds(monkeypatch):
    """Each configuration's untimed steps run back to back (warm-up, memory), then the timed
    steps alternate: round r starts with configuration r mod 2. A fake clock advanced by each
    step tells which step each reported time came from."""
    clock, order = [0.0], []
    monkeypatch.setattr(runner, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    real_build = runner.build

    def build(name, *args, **kwargs):
        setup = real_build(name, *args, **kwargs)
        real_step = setup.train_step

        def step(*step_args, **step_kwargs):
            order.append(name)
            clock[0] += float(len(order))  # the n-th step of the run takes n seconds
            return real_step(*step_args, **step_kwargs)

        setup.train_step = step
        return setup

    monkeypatch.setattr(runner, "build", build)
    tiny = SIZES["tiny"]
    cfg = GPTConfig(tiny.layers, tiny.width, tiny.heads, seq=16)
    rows = runner.run(["torch-amp", "torch-fp32"], cfg, stdlib_corpus(), steps=8, batch=2,
                      device=torch.device("cpu"), progress=False)
    untimed = runner.untimed_steps(8)
    assert untimed == 5
    a, b = "torch-amp", "torch-fp32"
    assert order == [a] * 5 + [b] * 5 + [a, b, b, a, a, b]
    amp, fp32 = rows
    assert amp.step_times == [11.0, 14.0, 15.0] and fp32.step_times == [12.0, 13.0, 16.0]
    assert amp.step_seconds == 14.0 and len(amp.losses) == 8


@pytest.mark.parametrize("names,steps,needle", [
    ("torch-amp", 5, "names must be a sequence of configuration names, got the string"),
    (["torch-amp"], 2, "steps=2 must be >= 3"),
    (["torch-amp", "memkern-full", "torch-amp"], 5, "names repeats torch-amp"),
])
def test_bench_runner_refuses_what_it_cannot_time(names, steps, needle):
    with pytest.raises((TypeError, ValueError), match=needle):
        runner.run(names, SIZES["tiny"], stdlib_corpus(), steps=steps, batch=1,
                   device=torch.device("cpu"), progress=False)
