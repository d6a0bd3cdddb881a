"""How a finished multi-process test worker ends (tests/launch_ranks.py, the kill-and-resume
training script, the Trainer ranks): through the interpreter's finalization, as a user's
script does, once :func:`check_group_freed` found that ``destroy_process_group()`` freed the
process group. A group that outlives it keeps gloo's worker threads running into the
interpreter's finalization, where one that drops a finished collective's tensors a moment late
ends the process with SIGABRT (docs/reliability.md, "A finished run does not die at exit"):
a rare death at exit, which this check turns into a failure every time. Where torch itself
keeps the group (DTensor's redistribution caches hold every device mesh they saw), a worker
ends with :func:`exit_without_finalizing` instead."""
import os
import sys


def exit_without_finalizing() -> None:
    """Ends a finished process whose process group torch keeps alive past
    ``destroy_process_group()`` without the interpreter's finalization (no gloo thread can
    then die in it). Everything is saved and flushed by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads (Linux: read from /proc; elsewhere none)."""
    if not sys.platform.startswith("linux"):
        return []
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as fh:
                names.append(fh.read().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return [name for name in names if name.startswith(("pt_gloo", "gloo"))]


def check_group_freed() -> None:
    """Raises RuntimeError when gloo's threads still run after ``destroy_process_group()``:
    something holds the process group (and it is not the test's to hold)."""
    left = gloo_threads()
    if left:
        raise RuntimeError(
            f"{len(left)} gloo thread(s) still run after destroy_process_group() ({left}): "
            "something keeps the process group alive, so they run into the interpreter's "
            "finalization, where they can end the process with SIGABRT (docs/reliability.md)")
