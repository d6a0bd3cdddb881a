"""memkern without its compiled extension: one notice at import, every op still runs (the
reference is registered for the CPU dispatch key in place of the C++ kernels) and computes
the right values (checked against hand-computed float64 ones), memkern.nn's Linear, Conv1D
and Dropout are torch's own layers; and with
``MEMKERN_REQUIRE_EXT=1`` (what CI sets) a missing extension is an import error instead. With
the extension: every constant it shares with the Python modules is checked by one at import."""
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

SCRIPT = r"""
import math
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
m, v, step = torch.zeros(n), torch.zeros(n), torch.full((1,), 4.0)
params = torch.full((n,), float("nan"), dtype=torch.bfloat16)
lr, beta1, beta2, eps, wd = 1e-3, 0.9, 0.999, 1e-8, 0.1
# By hand, in float64: from zero moments at t = 5, m = (1 - b1) g, v = (1 - b2) g**2.
g, t = grads.double(), 5
want_m, want_v = (1 - beta1) * g, (1 - beta2) * g * g
denom = want_v.sqrt() / math.sqrt(1 - beta2**t) + eps
want = master.double() * (1 - lr * wd) - lr / (1 - beta1**t) * want_m / denom
torch.ops.memkern.adamw_step_(master, m, v, grads, params, step, None, None,
                              lr, beta1, beta2, eps, wd)
assert step.item() == 5.0
for name, got, ref in (("master", master, want), ("exp_avg", m, want_m), ("exp_avg_sq", v, want_v)):
    err = ((got.double() - ref).abs() / (ref.abs() + 1e-3 * ref.abs().mean())).max().item()
    assert err < 1e-6, (name, err)
assert torch.equal(params, master.to(torch.bfloat16))
exact = math.sqrt(math.fsum(x * x for x in g.tolist()))
assert abs(mk.ops.l2_norm(grads).item() - exact) <= 1e-6 * exact
# Linear, Conv1D and Dropout are torch's own layers: torch's nodes, torch's values bit for bit,
# even with .grad present (where the extension's Linear adds into it)
F = torch.nn.functional
x = torch.randn(5, 13, requires_grad=True)
linear, conv1d = mk.nn.Linear(13, 7), mk.nn.Conv1D(7, 13)
linear.weight.grad = torch.zeros_like(linear.weight)
for y, want in ((linear(x), F.linear(x, linear.weight, linear.bias)),
                (conv1d(x), F.linear(x, conv1d.weight.t(), conv1d.bias))):
    assert y.grad_fn.name() == want.grad_fn.name() and torch.equal(y, want), y.grad_fn.name()
torch.manual_seed(7)
y = mk.nn.Dropout(0.3)(x)
torch.manual_seed(7)
assert y.grad_fn.name() == "MulBackward0" and torch.equal(y, F.dropout(x, 0.3)), y.grad_fn.name()
print("ok")
"""


def run(script, **env):
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=dict(os.environ, MEMKERN_BACKEND="", **env), timeout=300)


def test_without_the_extension_memkern_warns_once_and_runs_on_the_reference():
    proc = run(SCRIPT, MEMKERN_DISABLE_EXT="1", MEMKERN_REQUIRE_EXT="0")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_a_required_extension_that_is_missing_fails_the_import():
    """What CI sees when the C++ build was skipped: not a green run on the reference alone."""
    proc = run("import memkern", MEMKERN_DISABLE_EXT="1", MEMKERN_REQUIRE_EXT="1")
    assert proc.returncode != 0
    assert "ImportError: memkern: MEMKERN_REQUIRE_EXT=1 but the compiled extension is not " \
           "available: disabled by MEMKERN_DISABLE_EXT=1" in proc.stderr, proc.stderr[-3000:]


def test_required_cuda_kernels_match_what_was_built():
    import memkern

    proc = run("import memkern", MEMKERN_REQUIRE_EXT="cuda")
    if memkern.compiled.has_cuda:
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        assert proc.returncode != 0
        assert "MEMKERN_REQUIRE_EXT=cuda" in proc.stderr, proc.stderr[-3000:]


def test_every_constant_the_extension_exports_is_checked_by_a_python_module():
    """Each upper-case attribute of memkern._C (csrc/constants.cpp) is a constant some Python
    module shares with the C++ code: it is named in a check_same_in_cpp call of memkern's
    sources, so that module refuses an extension whose value differs."""
    from memkern._extension import compiled
    if not compiled.has_cpu:
        pytest.skip("the compiled extension is not built")
    from memkern import _C

    exported = {name for name in dir(_C) if name.isupper()}
    root = pathlib.Path(__file__).resolve().parents[1] / "memkern"
    checked = set()
    for path in root.rglob("*.py"):
        for call in re.findall(r"check_same_in_cpp\(__name__, \{(.*?)\}\)", path.read_text(),
                               re.S):
            checked |= set(re.findall(r'"([A-Z0-9_]+)":', call))
    assert exported and exported == checked, (sorted(exported - checked),
                                              sorted(checked - exported))


def test_a_constant_or_rule_that_differs_from_the_extension_fails_the_import(monkeypatch):
    """The checks themselves: a planted difference in a constant or in a rule is an
    ImportError naming it."""
    from memkern import _extension
    if not _extension.compiled.has_cpu:
        pytest.skip("the compiled extension is not built")
    from memkern import _C

    align = _C.LCE_ROW_ALIGN
    _extension.check_same_in_cpp("m", {"LCE_ROW_ALIGN": align})
    with pytest.raises(ImportError, match=rf"memkern._C.LCE_ROW_ALIGN is {align} "
                                          rf"but m uses {align + 1}"):
        _extension.check_same_in_cpp("m", {"LCE_ROW_ALIGN": align + 1})
    half = (torch.bfloat16, torch.float16)
    cases = [(torch.bfloat16, True), (torch.bfloat16, False)]
    _extension.check_same_rule_in_cpp("m", lambda d, cuda: cuda and d in half,
                                      "native_layer_norm_saves_statistics", cases)
    with pytest.raises(ImportError, match=r"native_layer_norm_saves_statistics\(torch.bfloat16, "
                                          r"False\) is False but m decides True"):
        _extension.check_same_rule_in_cpp("m", lambda d, cuda: d in half,
                                          "native_layer_norm_saves_statistics", cases)
    assert _C.native_layer_norm_saves_statistics(torch.bfloat16, True)
    assert not _C.native_layer_norm_saves_statistics(torch.bfloat16, False)
