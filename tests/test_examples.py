"""The examples and the README's usage snippet run as written, in fresh processes."""
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args: list[str], cwd: str, **env_vars: str) -> subprocess.CompletedProcess:
    # One intra-op thread: the shared CI machine's two cores are busy with other tests.
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               **env_vars)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=600)


def test_readme_usage_snippet_runs_as_written(tmp_path):
    readme = open(os.path.join(REPO, "README.md")).read()
    snippet = re.search(r"## Using it\n\n```python\n(.*?)```", readme, re.S).group(1)
    script = tmp_path / "snippet.py"
    script.write_text(snippet + "assert opt.skipped_steps == 0 and opt.grad_norm > 0\n"
                      "print('done', scheduler.last_epoch)\n")
    proc = _run([str(script)], str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["done", "25"]  # 100 micro-batches, windows of 4


def test_quickstart_learns(tmp_path):
    proc = _run([os.path.join(REPO, "examples", "quickstart.py")], str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 5 and losses[-1] < 0.5 * losses[0], proc.stdout


@pytest.mark.slow
def test_hf_trainer_example_trains_and_resumes(tmp_path):
    """With no --out, the checkpoints go to the temporary directory, not the working one."""
    pytest.importorskip("transformers")
    example = os.path.join(REPO, "examples", "hf_trainer.py")
    work, temp = tmp_path / "work", tmp_path / "temp"
    work.mkdir()
    temp.mkdir()
    out = temp / "memkern-examples" / "hf_trainer"
    first = _run([example, "--steps", "4"], str(work), TMPDIR=str(temp))
    assert first.returncode == 0, first.stderr[-3000:]
    assert "trained 4 steps" in first.stdout and f"checkpoints in {out}" in first.stdout
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4"]
    assert os.listdir(work) == []
    resumed = _run([example, "--steps", "6", "--out", str(out), "--resume"], str(work))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "trained 6 steps" in resumed.stdout


def test_train_gpt_zero_without_torchrun_runs_on_one_process(tmp_path):
    env_free = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", "train_gpt_zero.py"), "--size", "tiny",
         "--steps", "2", "--batch", "2"], capture_output=True, text=True, cwd=str(tmp_path),
        env=dict(env_free, PYTHONPATH=REPO, OMP_NUM_THREADS="1"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("train_gpt_zero.py: not under torchrun, training on one process")
    assert "Traceback" not in proc.stderr and lines[-1].startswith("step    1  loss ")
