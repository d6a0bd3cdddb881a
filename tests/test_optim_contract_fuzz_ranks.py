"""``ShardedOptimizer``'s contract fuzzed on 2 gloo ranks, ZeRO stages 1 and 2.

The sequences and the float64 model are those of ``test_optim_contract_fuzz.py`` (read its
docstring), run by both ranks at once: rank 0's ``hypothesis`` draws each example (a
configuration, a sequence of calls, a seed) and sends it to rank 1, and each rank runs it
against its own copy of the model, which sums both ranks' micro-batches (each rank's
coefficients its own, on a grid that keeps the two ranks' sums exact in 16 bits) and
normalises by both ranks' counts; an inf or NaN is injected on one rank, drawn, and both must
skip the window. ``offload="cpu"`` is drawn as well (the host step of each rank's shard).
Every ``step`` is followed by ``zero_grad`` (:func:`zeroed_after_steps`).

A failing rank prints the example (``run(cfg, ops, seed, rank, 2)`` replays it on 2 ranks) and
its traceback, and ends the launch; there is no shrinking across ranks. CI runs
``EXAMPLES`` examples in one launch; ``MEMKERN_FUZZ_PROFILE=long`` runs ``LONG_EXAMPLES``.
"""
from __future__ import annotations

import os
import sys
import traceback
import warnings

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch_ranks import fresh_seed, launch, serve  # noqa: E402
from test_optim_contract_fuzz import Config, backwards, configs, operations, run  # noqa: E402

WORLD = 2
EXAMPLES, LONG_EXAMPLES = 30, 400
EXAMPLES_VARIABLE = "MEMKERN_FUZZ_RANKS_EXAMPLES"

# test_optim_contract_fuzz's calls, a backward with the rank its inf/NaN goes to.
ranked_operations = st.one_of(
    st.tuples(backwards, st.integers(0, WORLD - 1)).map(lambda b: (*b[0], b[1])),
    operations.filter(lambda op: op[0] != "backward"))


def zeroed_after_steps(ops: list[tuple]) -> list[tuple]:
    """``zero_grad()`` after every ``step``, as a training loop does. (Across ranks a window's
    reduction leaves each rank's own slice of the buffer reduced and the rest its local sum; a
    window started on that without ``zero_grad()`` is warned of and not modelled.)"""
    return [done for op in ops for done in ([op, ("zero_grad",)] if op[0] == "step" else [op])]


KEPT = [
    # Found by the long run: float16 gradients of 3 · 2**14 on each rank overflow when the
    # ranks' sum is taken in float16, as the reduction does (the model summed in float64).
    (Config("fp16", "sgd", "8bit", 1, "dynamic", 14, 3, 2, None, False, 1),
     [("backward", 0, None, 0, 0.0, None, 0), ("step", True)], 0),
]
"""Failures found by the fuzzing, fixed and kept: run first in every launch."""


def run_or_exit(cfg, ops, seed, rank: int) -> None:
    """Runs one example on this rank; a failure prints it and ends this process (the other
    rank may be waiting in a collective: the launch reports both)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            run(cfg, ops, seed, rank, WORLD)
    except BaseException:
        print(f"rank {rank} failed: run({cfg!r}, {ops!r}, {seed}, {rank}, {WORLD})", flush=True)
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)


def scenario_fuzz(rank, world, seed, out):
    """Rank 0 draws and sends each example, rank 1 follows; returns the examples run."""
    examples = 0
    if rank == 0:
        @hypothesis_seed(seed)
        @settings(max_examples=int(os.environ[EXAMPLES_VARIABLE]), deadline=None,
                  database=None, suppress_health_check=list(HealthCheck))
        @given(cfg=configs,
               ops=st.lists(ranked_operations, min_size=8, max_size=30).map(zeroed_after_steps),
               example_seed=st.integers(0, 2**31 - 1))
        def drive(cfg, ops, example_seed):
            nonlocal examples
            dist.broadcast_object_list([(cfg, ops, example_seed)], src=0)
            run_or_exit(cfg, ops, example_seed, rank)
            examples += 1

        for example in KEPT:
            dist.broadcast_object_list([example], src=0)
            run_or_exit(*example, rank)
            examples += 1
        drive()
        dist.broadcast_object_list([None], src=0)
    else:
        while True:
            example = [None]
            dist.broadcast_object_list(example, src=0)
            if example[0] is None:
                break
            run_or_exit(*example[0], rank)
            examples += 1
    return examples


@pytest.mark.slow
def test_the_contract_holds_on_two_ranks(tmp_path, monkeypatch):
    long = os.environ.get("MEMKERN_FUZZ_PROFILE") == "long"
    examples = LONG_EXAMPLES if long else EXAMPLES
    monkeypatch.setenv(EXAMPLES_VARIABLE, str(examples))
    result = launch(os.path.abspath(__file__), WORLD, ["fuzz"], str(tmp_path), fresh_seed(),
                    timeout=7200 if long else 300)
    print(f"{result['fuzz']} examples per rank")
    assert result["fuzz"] == [len(KEPT) + examples] * WORLD


if __name__ == "__main__":
    serve(globals())
