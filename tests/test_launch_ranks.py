"""The multi-process harness (tests/launch_ranks.py) reports every rank's output when a launch
fails: here one rank raises while the other is stuck, and is killed after the grace period."""
from __future__ import annotations

import time

import pytest
import torch.distributed as dist

import launch_ranks


def scenario_one_rank_fails(rank, world, seed, out):
    # both ranks past the group's set-up first: a rank still connecting when the other exits
    # fails there (under load it did), instead of waiting to be killed
    dist.barrier()
    if rank == world - 1:
        raise ValueError(f"rank {rank} cannot go on")
    print(f"rank {rank} waits", flush=True)
    time.sleep(600)  # not a collective, so nothing ends it but the harness


if __name__ == "__main__":
    launch_ranks.serve(globals())


def test_a_failed_rank_ends_the_launch_with_every_ranks_output(tmp_path):
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failure:
        launch_ranks.launch(__file__, 2, ["one_rank_fails"], str(tmp_path), 0, timeout=200)
    message = str(failure.value)
    assert "world size 2, ['one_rank_fails']: a rank failed" in message
    assert "----- rank 0: killed (still running)\nrank 0 waits" in message
    assert "----- rank 1: exit status 1" in message
    assert "ValueError: rank 1 cannot go on" in message
    assert time.monotonic() - start < 200  # ended by the failure, not the timeout
