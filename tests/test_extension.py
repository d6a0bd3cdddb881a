"""memkern without its compiled extension: one notice at import, and every op still runs
(the reference is registered for the CPU dispatch key in place of the C++ kernels)."""
import os
import subprocess
import sys

SCRIPT = r"""
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import memkern as mk
    import memkern.nn  # noqa: F401  (a second import path must not warn again)
import torch
notices = [w for w in caught if "compiled extension is not available" in str(w.message)]
assert len(notices) == 1, [str(w.message) for w in caught]
assert not mk.compiled.has_cpu and mk.backends()["cpu"] is False
n = 1031
master, grads = torch.randn(n), torch.randn(n).to(torch.bfloat16)
m, v, step = torch.zeros(n), torch.zeros(n), torch.zeros(1)
params = torch.full((n,), float("nan"), dtype=torch.bfloat16)
torch.ops.memkern.adamw_step_(master, m, v, grads, params, step, None, None,
                              1e-3, 0.9, 0.999, 1e-8, 0.0)
assert step.item() == 1.0 and torch.equal(params, master.to(torch.bfloat16))
assert abs(mk.ops.l2_norm(grads).item() - grads.double().norm().item()) < 1e-4 * n ** 0.5
print("ok")
"""


def test_without_the_extension_memkern_warns_once_and_runs_on_the_reference():
    env = dict(os.environ, MEMKERN_DISABLE_EXT="1", MEMKERN_BACKEND="")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
