"""memkern.bench.host_device: the host/GPU split the benchmarks print on a GPU (by hand: work
with no kernel has no GPU time, a launched kernel has some; the host time is part of the wall
time by construction). No time is compared with a number: these are the split's definitions."""
from __future__ import annotations

import pytest
import torch

from memkern.bench import host_device

pytestmark = pytest.mark.cuda


def test_gpu_time_counts_the_kernels_only():
    assert host_device.gpu_seconds(lambda: None, calls=5) == 0.0
    a = torch.randn(512, 512, device="cuda")
    assert host_device.gpu_seconds(lambda: a @ a, calls=3) > 0.0


def test_split_and_its_table():
    a = torch.randn(256, 256, device="cuda")
    t = host_device.measure(lambda: a @ a, reps=3, calls=4)
    assert 0.0 < t.host_seconds <= t.wall_seconds and t.gpu_seconds > 0.0
    assert t.bound == ("host" if t.host_seconds > t.gpu_seconds else "device")
    lines = host_device.table([("matmul", t)], unit="µs")
    assert lines[0].split() == ["configuration", "wall", "µs", "host", "µs", "GPU", "µs", "bound"]
    assert lines[1].split()[0] == "matmul" and lines[1].split()[-1] == t.bound
