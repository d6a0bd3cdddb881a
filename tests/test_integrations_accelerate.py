"""memkern under ``accelerate launch`` (one process, CPU): ``accelerator.prepare`` with a
ShardedOptimizer and ``accelerator.accumulate`` train like plain torch (checked inside the
script against torch.optim.SGD + clip_grad_norm_ on the same batches, windows of 3, 3 and a
short 2 at the loader's end); ``accelerator.backward(loss)`` is refused with one error naming
``opt.backward(loss)``."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_memkern_optimizer_under_accelerate_launch():
    seed = str(int.from_bytes(os.urandom(2), "little"))
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1",
         "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
         os.path.join(REPO, "tests", "scripts", "accelerate_train.py"), seed],
        capture_output=True, text=True, timeout=600, cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[-1].startswith("OK ")
    refused = [ln for ln in lines if ln.startswith("refused: ")]
    assert len(refused) == 1 and "Call opt.backward(loss)" in refused[0]
