"""How a finished multi-process test worker ends (tests/test_optim_distributed.py, the
kill-and-resume training script)."""
import os
import sys


def exit_without_finalizing() -> None:
    """Ends a finished worker without the interpreter's finalization. The default process group
    outlives destroy_process_group (references taken while torch lazily imports its
    distributed modules outlive the optimizer), so gloo's worker threads still run; one that
    releases a finished collective late frees its tensors, which needs the GIL, and Python
    3.11-3.13 end a thread that asks for the GIL during finalization with pthread_exit: its
    unwinding through a noexcept destructor (~AsyncAllgatherWork) calls std::terminate
    ("terminate called without an active exception", SIGABRT: a finished run reported as
    failed, 1 in ~12 runs of a plain torch reproducer under load). Everything is saved and
    flushed by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
