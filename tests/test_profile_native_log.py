"""The CPU allocation trace keeps torch's native log lines (the profiler's start/stop lines,
"Memory block of unknown size ...") off stderr, where they would break progress bars and
tables, and still lets the traced function's own output through."""
import sys

import torch

from memkern.profile.allocations import allocation_stats


def test_native_profiler_lines_dropped_python_warnings_kept(capfd):
    before = torch.randn(4099)  # allocated before the trace: its free is "of unknown size"

    def work():
        nonlocal before
        del before
        print("the traced function's own line", file=sys.stderr)
        return torch.ones(1031).sum()

    stats = allocation_stats(work)
    err = capfd.readouterr().err
    assert stats.result == 1031 and stats.peak >= 1031 * 4
    assert "unknown size" not in err and "profiler_st" not in err, err
    assert err == "the traced function's own line\n"
