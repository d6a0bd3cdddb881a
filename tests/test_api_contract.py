"""The public API, contract v1 (docs/api.md): every public name importable as written, with the
documented parameters and defaults. A rename or a changed default fails here first."""
import inspect
import os
import subprocess
import sys

import pytest
import torch

import memkern as mk

INF = inspect.Parameter.empty


def params(fn) -> dict:
    return {n: p.default for n, p in inspect.signature(fn).parameters.items()
            if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


CONTRACT = [
    ("mk.nn.Linear", dict(in_features=INF, out_features=INF, bias=True, device=None,
                                dtype=None)),
    ("mk.nn.LayerNorm", dict(normalized_shape=INF, eps=1e-5, elementwise_affine=True,
                                   bias=True, device=None, dtype=None)),
    ("mk.nn.RMSNorm", dict(normalized_shape=INF, eps=None, elementwise_affine=True,
                                 device=None, dtype=None)),
    ("mk.nn.Dropout", dict(p=0.5)),
    ("mk.nn.MLP", dict(in_features=INF, hidden_features=INF, out_features=None,
                             activation="gelu", bias=True, dropout=0.0,
                             recompute="activation")),
    ("mk.nn.SwiGLU", dict(in_features=INF, hidden_features=INF, out_features=None,
                                bias=False, recompute="activation")),
    ("mk.nn.LinearCrossEntropy", dict(in_features=INF, num_classes=INF, bias=False,
                                            ignore_index=-100, reduction="mean",
                                            label_smoothing=0.0)),
    ("mk.nn.functional.linear_cross_entropy",
     dict(input=INF, weight=INF, target=INF, bias=None, ignore_index=-100, reduction="mean",
          label_smoothing=0.0, num_items=None)),
    ("mk.nn.functional.linear_log_probs",
     dict(input=INF, weight=INF, target=INF, bias=None, entropy=False, is_top1=False,
          mean_logits=False, ignore_index=-100, softcap=None)),
    ("mk.checkpoint", dict(module=INF, policy="full")),
    ("mk.patch", dict(model=INF, linear=True, norm=True, mlp=True, dropout=True, attention=True,
                      loss=True, recompute="activation", verbose=False)),
    ("mk.GradBuffer", dict(params=INF, dtype=None)),
    ("mk.LossScaler", dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                                 growth_interval=2000, min_scale=1.0, hysteresis=1,
                                 enabled=True)),
    ("mk.optim.FusedAdamW", dict(params=INF, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                       weight_decay=1e-2)),
    ("mk.optim.FusedSGD", dict(params=INF, lr=INF, momentum=0.0, dampening=0.0,
                                     weight_decay=0.0, nesterov=False)),
    ("mk.optim.ShardedOptimizer",
     dict(params=INF, optimizer="adamw", lr=INF, grad_dtype=None, zero_stage=1,
          process_group=None, accumulation_steps=1, loss_scale=None, max_grad_norm=None,
          offload=None, gradients="device", bucket_size_mb=25)),
    ("MemkernTrainer", dict(model=None, args=None, patch=True, offload=None, zero_stage=None,
                            fsdp2=False)),
    ("MemkernTrainerMixin", dict(model=None, args=None, patch=True, offload=None,
                                 zero_stage=None, fsdp2=False)),
    ("MemkernOptimWrapper", dict(optimizer=INF, accumulative_counts=1, clip_grad=None,
                                 dtype=None, loss_scale="auto", state_precision="32bit",
                                 offload=None, zero_stage=1, grad_dtype=None,
                                 bucket_size_mb=25)),
    ("use_memkern_head", dict(trainer=INF)),
]


def resolve(dotted: str):
    if dotted == "MemkernOptimWrapper":
        pytest.importorskip("mmengine")
        from memkern.integrations import mmengine
        return mmengine.MemkernOptimWrapper
    if dotted == "use_memkern_head":
        pytest.importorskip("trl")
        from memkern.integrations import trl
        return trl.use_memkern_head
    if dotted.startswith("MemkernTrainer"):
        from memkern.integrations import transformers
        return getattr(transformers, dotted)
    obj = mk
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("dotted,expected", CONTRACT, ids=[c[0] for c in CONTRACT])
def test_signature_matches_the_contract(dotted, expected):
    actual = params(resolve(dotted))
    for name, default in expected.items():
        assert name in actual, f"{dotted} lacks parameter {name!r}"
        assert actual[name] == default, f"{dotted}({name}=...) defaults to {actual[name]!r}"


def test_module_level_api():
    assert isinstance(mk.__version__, str) and mk.__version__
    available = mk.backends()
    assert set(available) == {"reference", "cpu", "cuda", "triton"}
    assert available["reference"] is True
    for name in ("backward", "step", "zero_grad", "state_dict", "load_state_dict"):
        assert callable(getattr(mk.optim.ShardedOptimizer, name))
    for name in ("loss_scale", "grad_norm", "skipped_steps"):
        assert isinstance(getattr(mk.optim.ShardedOptimizer, name), property)
    for name in ("scale", "unscale_", "update", "get_scale", "state_dict", "load_state_dict"):
        assert callable(getattr(mk.LossScaler, name))
    import torch
    assert issubclass(mk.optim.FusedAdamW, torch.optim.Optimizer)
    assert issubclass(mk.optim.FusedSGD, torch.optim.Optimizer)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a CUDA GPU")
def test_backends_reports_triton_on_a_cpu_only_under_the_interpreter():
    """What the README and memkern.backend's table say: installed Triton without a GPU is a
    backend only under TRITON_INTERPRET=1 (fresh processes: the tests set it for themselves)."""
    pytest.importorskip("triton")
    script = "import memkern; print(memkern.backends()['triton'])"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    plain = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           env=env, timeout=300)
    interpreted = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                 env=dict(env, TRITON_INTERPRET="1"), timeout=300)
    assert plain.stdout.split() == ["False"], plain.stderr[-2000:]
    assert interpreted.stdout.split() == ["True"], interpreted.stderr[-2000:]
