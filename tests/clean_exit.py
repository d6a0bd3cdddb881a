"""How a finished multi-process test rank ends (tests/launch_ranks.py, the kill-and-resume
training scripts, the Trainer ranks): :func:`end_finished_rank`, after
``destroy_process_group()``.

A rank ends as a user's script does, through the interpreter's finalization, once
:func:`check_group_freed` found that ``destroy_process_group()`` freed the process group. A
group that outlives it keeps gloo's worker threads running into the interpreter's
finalization, where one that drops a finished collective's tensors a moment late ends the
process with SIGABRT (docs/reliability.md, "A finished run does not die at exit"): a rare
death at exit, which the check turns into a failure every time.

Where something outside memkern keeps the group, a rank ends without the interpreter's
finalization (:func:`exit_without_finalizing`) instead:

- DTensors were redistributed (FSDP2, tensor parallelism): torch's DTensor redistribution
  caches hold every device mesh they saw, and so its groups (:data:`DTENSOR_CACHES`, named by
  the test file);
- DeepSpeed was imported (transformers' ``Trainer`` imports it after ``init_process_group()``
  where it is installed): ``deepspeed.comm.torch`` binds the default group into default
  arguments.
"""
import os
import sys

DTENSOR_CACHES = ("torch's DTensor redistribution caches (torch.distributed.tensor._redistribute"
                  "'s _planner_cache and _gen_transform_infos's functools.cache hold each device "
                  "mesh they saw, and so its process groups)")


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
    something holds the process group."""
    left = gloo_threads()
    if left:
        raise RuntimeError(
            f"{len(left)} gloo thread(s) still run after destroy_process_group() ({left}): "
            "something keeps the process group alive, so they run into the interpreter's "
            "finalization, where they can end the process with SIGABRT (docs/reliability.md)")


def exit_without_finalizing() -> None:
    """Ends a finished process whose group something else keeps alive, without the
    interpreter's finalization (no gloo thread can then die in it). Everything is saved and
    flushed by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def end_finished_rank(group_kept_by: str | None = None) -> None:
    """Ends a finished rank after ``destroy_process_group()`` (see the module docstring).
    ``group_kept_by``: what keeps the group in this rank's run (e.g. :data:`DTENSOR_CACHES`),
    None when nothing should."""
    if group_kept_by is not None or "deepspeed" in sys.modules:
        exit_without_finalizing()
    check_group_freed()
