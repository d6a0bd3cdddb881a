"""``memkern.integrations.mmengine`` in one process: ``MemkernOptimWrapper`` in MMEngine's
``Runner`` against MMEngine's own ``OptimWrapper`` and ``AmpOptimWrapper``, checkpoints and
``resume=True``, the patch hook, the options memkern adds, and what is refused.

The seed examples of MMEngine's "Save memory on GPU" page run as written with only the wrapper
changed. Elsewhere the model has odd sizes, the data are fresh random numbers, and the run
(2 epochs of 13 iterations) is not a multiple of ``accumulative_counts``: windows cross the
epoch boundary and the run's last window is short, as MMEngine makes them.
"""
from __future__ import annotations

import contextlib
import math
import os
import uuid
from unittest import mock

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from compare import params_rel_err

mmengine = pytest.importorskip("mmengine")
import mmengine.optim.optimizer.amp_optimizer_wrapper as amp_wrapper_module  # noqa: E402
from mmengine.hooks import Hook  # noqa: E402
from mmengine.model import BaseModel  # noqa: E402
from mmengine.optim import AmpOptimWrapper  # noqa: E402
from mmengine.registry import HOOKS, OPTIM_WRAPPERS  # noqa: E402
from mmengine.runner import Runner  # noqa: E402

import memkern  # noqa: E402
from memkern.integrations.mmengine import MemkernOptimWrapper  # noqa: E402

ITERS = 13  # per epoch; two epochs
FP32_TOLERANCE = 1e-6
"""Against torch's optimizers in float32: memkern's fused kernel rounds differently from
torch's per-tensor ops by ~1 ulp per step (measured: at most 2.2e-7 after 7-18 steps)."""


# -------------------------------------------------------------------------- the seed examples
class ToyModel(BaseModel):
    """The seed's model, as written."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(1, 1)

    def forward(self, img, label, mode):
        feat = self.linear(img)
        loss1 = (feat - label).pow(2)
        loss2 = (feat - label).abs()
        return dict(loss1=loss1, loss2=loss2)


def _names() -> str:
    return f"memkern-test-{uuid.uuid4().hex[:12]}"


def _seed_run(tmp_path, wrapper: str, optimizer: dict | None = None,
              **optim_wrapper) -> list[torch.Tensor]:
    torch.manual_seed(0)
    train_dataset = [(torch.ones(1, 1), torch.ones(1, 1))] * 50
    runner = Runner(model=ToyModel(), work_dir=str(tmp_path / _names()),
                    experiment_name=_names(),
                    train_dataloader=DataLoader(train_dataset, batch_size=2),
                    train_cfg=dict(by_epoch=True, max_epochs=1),
                    optim_wrapper=dict(type=wrapper,
                                       optimizer=optimizer or dict(type='SGD', lr=0.01),
                                       **optim_wrapper),
                    cfg=dict(model_wrapper_cfg=dict(type='MMFullyShardedDataParallel',
                                                    cpu_offload=True)),
                    log_level="ERROR")
    runner.train()
    return _weights(runner)


@pytest.mark.parametrize("accumulative_counts", [4, None], ids=["accumulation", "fsdp-page"])
def test_seed_examples_end_at_mmengines_weights(tmp_path, accumulative_counts):
    """The page's two Runner examples (25 iterations: with accumulation the last window holds
    one), the wrapper's type the only change: the same weights, bit for bit. (One process:
    MMEngine applies ``model_wrapper_cfg`` only across processes.)"""
    extra = {} if accumulative_counts is None else {"accumulative_counts": accumulative_counts}
    expected = _seed_run(tmp_path, "OptimWrapper", **extra)
    got = _seed_run(tmp_path, "MemkernOptimWrapper", **extra)
    for g, e in zip(got, expected):
        assert torch.equal(g, e), (got, expected)
    assert not torch.equal(expected[0], torch.zeros(1, 1))


SEED_VARIANTS = {
    # name: (MMEngine's wrapper, the options both get, memkern's own, tolerance)
    "adamw-clip": ("OptimWrapper", {}, {}, 1e-6),
    # 16-bit: memkern's weights start as the float32 initial weights rounded to 16 bits (at most
    # half an ulp: 2**-11 of the value in float16, 2**-8 in bfloat16), AMP's stay float32;
    # test_16bit_weights_as_amp_optim_wrapper starts both from representable weights (1e-6).
    "float16": ("CpuAmpOptimWrapper", {"dtype": "float16"}, {"grad_dtype": "float32"}, 1e-3),
    "bfloat16": ("CpuAmpOptimWrapper", {"dtype": "bfloat16"}, {}, 4e-3),
}


@pytest.mark.parametrize("variant", SEED_VARIANTS)
def test_seed_accumulation_example_with_adamw_clipping_and_16_bits(tmp_path, variant):
    """The page's accumulation example with AdamW and clipping (it bites: max_norm 0.1), in
    float32, float16 with dynamic loss scaling and bfloat16, against MMEngine's wrapper."""
    reference, both, ours, tolerance = SEED_VARIANTS[variant]
    common = dict(optimizer=dict(type="AdamW", lr=0.01), accumulative_counts=4,
                  clip_grad=dict(max_norm=0.1), **both)
    expected = _seed_run(tmp_path, reference, **common)
    got = _seed_run(tmp_path, "MemkernOptimWrapper", **common, **ours)
    assert params_rel_err(got, expected) < tolerance


# -------------------------------------------------------------------------- a real model
class Net(BaseModel):
    """Odd sizes; parameters rounded to ``representable`` (so that 16-bit weights start where
    float32 ones do, and a comparison sees the training, not the first rounding)."""

    def __init__(self, representable: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(7, 11)
        self.fc2 = nn.Linear(11, 3)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(p.to(representable))

    def forward(self, x, y, mode):
        logits = self.fc2(torch.tanh(self.fc1(x)))
        return dict(loss=nn.functional.cross_entropy(logits.float(), y))


def _data(seed: int, poison: int | None = None) -> list:
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(7, generator=g), int(torch.randint(0, 3, (), generator=g)))
            for _ in range(2 * ITERS)]
    if poison is not None:  # an inf input: that micro-batch's gradients are inf/NaN
        data[poison] = (torch.full((7,), float("inf")), data[poison][1])
    return data


@OPTIM_WRAPPERS.register_module()
class CpuAmpOptimWrapper(AmpOptimWrapper):
    """MMEngine's ``AmpOptimWrapper`` (its backward, step, clipping and state dict) on the
    CPU: it refuses to be built without a GPU and its scaler and autocast are CUDA's, so the
    test gives it ``torch.amp.GradScaler('cpu')`` and CPU autocast."""

    def __init__(self, loss_scale: dict | str = "dynamic", **kwargs) -> None:
        with mock.patch.object(amp_wrapper_module, "is_cuda_available", lambda: True):
            super().__init__(**kwargs)
        self.loss_scaler = torch.amp.GradScaler(
            "cpu", **(loss_scale if isinstance(loss_scale, dict) else {}))

    @contextlib.contextmanager
    def optim_context(self, model):
        with torch.autocast("cpu", dtype=self.cast_dtype):
            yield


def _train(tmp_path, wrapper: str, optimizer: dict, *, epochs: int = 2, data_seed: int = 1,
           poison: int | None = None, representable: torch.dtype = torch.float32,
           work_dir=None, resume: bool = False, hooks=None,
           log_level: str = "ERROR", **optim_wrapper) -> Runner:
    torch.manual_seed(0)
    runner = Runner(
        model=Net(representable), work_dir=str(work_dir or tmp_path / _names()),
        experiment_name=_names(),
        train_dataloader=DataLoader(_data(data_seed, poison), batch_size=2),
        train_cfg=dict(by_epoch=True, max_epochs=epochs),
        optim_wrapper=dict(type=wrapper, optimizer=optimizer, **optim_wrapper),
        param_scheduler=dict(type="MultiStepLR", milestones=[1], gamma=0.5, by_epoch=True),
        default_hooks=dict(logger=dict(type="LoggerHook", interval=1),
                           checkpoint=dict(type="CheckpointHook", interval=1)),
        custom_hooks=hooks, resume=resume, log_level=log_level)
    runner.train()
    return runner


def _weights(runner: Runner) -> list[torch.Tensor]:
    """The float32 weights: a memkern run's float32 masters where the model is 16-bit."""
    opt = runner.optim_wrapper.optimizer
    params = list(runner.model.parameters())
    if isinstance(opt, memkern.optim.ShardedOptimizer):
        params = [opt.state[p].get("master_param", p) for p in params]
    return [p.detach().float().clone() for p in params]


def _grad_norms(runner: Runner) -> list[float]:
    return list(runner.message_hub.get_scalar("train/grad_norm").data[0])


CASES = {
    # 26 iterations: windows of 3 leave a last window of 2, windows of 4 one of 2
    "sgd-momentum-clip": (dict(type="SGD", lr=0.1, momentum=0.9, weight_decay=0.01),
                          dict(accumulative_counts=3, clip_grad=dict(max_norm=0.3))),
    "adamw-clip": (dict(type="AdamW", lr=0.01, weight_decay=0.01),
                   dict(accumulative_counts=4, clip_grad=dict(max_norm=0.3))),
}


@pytest.fixture(scope="module")
def memkern_adamw_clip(tmp_path_factory) -> Runner:
    """MemkernOptimWrapper's run of the "adamw-clip" case, which several tests compare with."""
    optimizer, options = CASES["adamw-clip"]
    return _train(tmp_path_factory.mktemp("adamw-clip"), "MemkernOptimWrapper", optimizer,
                  **options)


@pytest.mark.parametrize("case", CASES)
def test_trains_as_mmengines_optim_wrapper(tmp_path, case, memkern_adamw_clip):
    """Windows across the epoch boundary, the run's short last window, clipping (it bites:
    max_norm below every window's norm), a MultiStepLR schedule: the weights, the learning rate
    (``get_lr``), the number of steps and the logged gradient norms of MMEngine's
    ``OptimWrapper``."""
    optimizer, options = CASES[case]
    expected = _train(tmp_path, "OptimWrapper", optimizer, **options)
    expected_norms = _grad_norms(expected) if "clip_grad" in options else None
    got = (memkern_adamw_clip if case == "adamw-clip" else
           _train(tmp_path, "MemkernOptimWrapper", optimizer, **options))
    assert params_rel_err(_weights(got), _weights(expected)) < FP32_TOLERANCE
    assert got.optim_wrapper.get_lr() == expected.optim_wrapper.get_lr() \
        == {"lr": [optimizer["lr"] / 2]}
    windows = -(-2 * ITERS // options.get("accumulative_counts", 1))
    state = got.optim_wrapper.optimizer.state_dict()["state"][0]
    if optimizer["type"] == "AdamW":
        assert state["step"] == expected.optim_wrapper.optimizer.state_dict()["state"][0][
            "step"] == windows
    if expected_norms is not None:
        norms = _grad_norms(got)
        assert len(norms) == windows and min(norms) > 0.3
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(expected_norms),
                                   rtol=FP32_TOLERANCE, atol=0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_weights_as_amp_optim_wrapper(tmp_path, dtype):
    """``dtype='float16'`` (dynamic loss scaling) and ``'bfloat16'``: memkern keeps 16-bit
    weights and float32 masters where ``AmpOptimWrapper`` keeps float32 weights and autocasts
    them; the forward sees the same 16-bit weights. With a float32 gradient buffer (AMP's
    gradients are float32) the masters equal AMP's weights to float32 rounding, through a
    window skipped for an inf input (the same loss scale after it). With memkern's default
    16-bit gradient buffer, the sums of four micro-batches round to 16 bits: bf16 within 1e-3
    (measured 2.4e-4), against the 6.5e-4 that separates AMP itself from float32 training."""
    optimizer = dict(type="AdamW", lr=0.01, weight_decay=0.01)
    representable = getattr(torch, dtype)
    common = dict(accumulative_counts=4, clip_grad=dict(max_norm=1.0), dtype=dtype,
                  representable=representable, poison=9)
    expected = _train(tmp_path, "CpuAmpOptimWrapper", optimizer, **common)
    got = _train(tmp_path, "MemkernOptimWrapper", optimizer, grad_dtype="float32", **common)
    assert next(got.model.parameters()).dtype == representable
    assert params_rel_err(_weights(got), _weights(expected)) < FP32_TOLERANCE
    memkern_opt = got.optim_wrapper.optimizer
    if dtype == "float16":
        # Each skipped window halves the scale (no growth within 2000 windows): the poisoned
        # one, and the first windows whose scaled gradients overflow float16.
        scale = expected.optim_wrapper.loss_scaler.get_scale()
        assert memkern_opt.loss_scale == scale
        assert memkern_opt.skipped_steps == math.log2(2.0**16 / scale) >= 1
    else:
        assert memkern_opt.skipped_steps == 2  # the poisoned window of each epoch
        sixteen = _train(tmp_path, "MemkernOptimWrapper", optimizer, **common)
        assert params_rel_err(_weights(sixteen), _weights(expected)) < 1e-3


class Interrupted(Exception):
    pass


@HOOKS.register_module()
class InterruptAfterFirstEpoch(Hook):
    """Stops the run once epoch 1's checkpoint is written, as a killed job would."""

    priority = "LOWEST"  # after the CheckpointHook

    def after_train_epoch(self, runner) -> None:
        raise Interrupted


def test_resume_continues_the_open_window(tmp_path, monkeypatch, memkern_adamw_clip):
    """Checkpointed after epoch 1 of 2 (13 iterations: a window of 4 is open, one micro-batch
    in), killed, and resumed with ``resume=True``: the optimizer's state holds that
    micro-batch's gradient, so the resumed run ends at the uninterrupted run's weights and
    learning rate, bit for bit, and MMEngine's warning that the window's gradients are lost
    is not given."""
    # MMEngine 0.10.7's checkpoints hold its HistoryBuffer, which torch >= 2.6's torch.load
    # refuses by default (weights_only), memkern or not.
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    optimizer, options = CASES["adamw-clip"]
    straight = memkern_adamw_clip
    work_dir = tmp_path / "resumed"
    with pytest.raises(Interrupted):
        _train(tmp_path, "MemkernOptimWrapper", optimizer, work_dir=work_dir,
               hooks=[dict(type="InterruptAfterFirstEpoch")], **options)
    with mock.patch("mmengine.optim.optimizer.optimizer_wrapper.print_log") as log:
        resumed = _train(tmp_path, "MemkernOptimWrapper", optimizer, work_dir=work_dir,
                         resume=True, **options)
    assert resumed.iter == 2 * ITERS and resumed.optim_wrapper.inner_count == 2 * ITERS
    assert not log.called, log.call_args_list
    for a, b in zip(_weights(resumed), _weights(straight)):
        assert torch.equal(a, b)
    assert resumed.optim_wrapper.get_lr() == straight.optim_wrapper.get_lr()


def test_memkern_options_in_the_same_dict(tmp_path, memkern_adamw_clip):
    """``offload='cpu'`` is the same step on the host: bit for bit the default's weights.
    ``state_precision='8bit'`` keeps 8-bit moments for parameters of 4096 elements or more
    (none here: the same weights too), ``zero_stage=2`` is ZeRO-2 in one process."""
    optimizer, options = CASES["adamw-clip"]
    base = _weights(memkern_adamw_clip)
    for extra in (dict(offload="cpu"), dict(state_precision="8bit", zero_stage=2)):
        runner = _train(tmp_path, "MemkernOptimWrapper", optimizer, **options, **extra)
        opt = runner.optim_wrapper.optimizer
        assert (opt.offload, opt.zero_stage) == (extra.get("offload"), extra.get("zero_stage", 1))
        for a, b in zip(_weights(runner), base):
            assert torch.equal(a, b), extra


def test_patch_hook_patches_and_logs(tmp_path, memkern_adamw_clip):
    """``custom_hooks=[dict(type='MemkernPatchHook')]``: the Runner's model trains through
    memkern's layers, the log says what was swapped, and the weights are those of the
    unpatched model (float32: memkern's layers round like torch's to ~1 ulp)."""
    optimizer, options = CASES["adamw-clip"]
    plain = memkern_adamw_clip
    work_dir = tmp_path / "patched"
    patched = _train(tmp_path, "MemkernOptimWrapper", optimizer, work_dir=work_dir,
                     hooks=[dict(type="MemkernPatchHook")], log_level="INFO", **options)
    assert type(patched.model.fc1).__module__ == "memkern.nn.linear"
    log = "".join(open(os.path.join(root, f)).read() for root, _, files in os.walk(work_dir)
                  for f in files if f.endswith(".log"))
    assert "memkern.patch: swapped 2 module(s)" in log and "fc1:" in log, log[-2000:]
    assert params_rel_err(_weights(patched), _weights(plain)) < FP32_TOLERANCE


def _wrapper(optimizer: torch.optim.Optimizer, **kwargs) -> MemkernOptimWrapper:
    return MemkernOptimWrapper(optimizer, **kwargs)


@pytest.mark.parametrize("build, message", [
    (lambda ps: _wrapper(torch.optim.Adagrad(ps)), "optimizer type Adagrad"),
    (lambda ps: _wrapper(torch.optim.Adam(ps, weight_decay=0.1)), "type='AdamW'"),
    (lambda ps: _wrapper(torch.optim.AdamW(ps, amsgrad=True)), "amsgrad=True"),
    (lambda ps: _wrapper(torch.optim.SGD(ps, lr=0.1),
                         clip_grad=dict(type="value", clip_value=1.0)), "type 'value'"),
    (lambda ps: _wrapper(torch.optim.SGD(ps, lr=0.1),
                         clip_grad=dict(max_norm=1.0, norm_type="inf")), "norm_type='inf'"),
    (lambda ps: _wrapper(torch.optim.SGD(ps, lr=0.1), dtype="float64"), "dtype must be"),
    (lambda ps: _wrapper(torch.optim.SGD(ps, lr=0.1), accumulative_counts=0),
     "accumulative_counts must be"),
])
def test_refuses_what_it_cannot_run(build, message):
    params = list(nn.Linear(3, 2).parameters())
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        build(params)


def test_adam_without_weight_decay_is_adamw(tmp_path):
    """torch's Adam with ``weight_decay=0`` is AdamW with ``weight_decay=0``."""
    expected = _weights(_train(tmp_path, "OptimWrapper", dict(type="Adam", lr=0.01),
                               accumulative_counts=2))
    got = _weights(_train(tmp_path, "MemkernOptimWrapper", dict(type="Adam", lr=0.01),
                          accumulative_counts=2))
    assert params_rel_err(got, expected) < FP32_TOLERANCE




CONFIG_FILE = """
custom_imports = dict(imports=['memkern.integrations.mmengine'], allow_failed_imports=False)
model = dict(type='memkern_test_toy')
work_dir = {work_dir!r}
train_dataloader = dict(dataset=dict(type='memkern_test_ones'), batch_size=2,
                        sampler=dict(type='DefaultSampler', shuffle=False),
                        collate_fn=dict(type='default_collate'))
train_cfg = dict(by_epoch=True, max_epochs=1)
optim_wrapper = dict(type='MemkernOptimWrapper', optimizer=dict(type='SGD', lr=0.01),
                     accumulative_counts=4)
custom_hooks = [dict(type='MemkernPatchHook')]
log_level = 'ERROR'
"""

RUN_CONFIG = """
import sys
import torch
from mmengine.config import Config
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, MODELS
from mmengine.runner import Runner


@MODELS.register_module('memkern_test_toy')
class ToyModel(BaseModel):  # the seed's
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(1, 1)

    def forward(self, img, label, mode):
        return dict(loss=(self.linear(img) - label).pow(2))


DATASETS.register_module('memkern_test_ones',
                         module=lambda: [(torch.ones(1), torch.ones(1))] * 50)
runner = Runner.from_cfg(Config.fromfile(sys.argv[1]))
assert 'memkern.integrations.mmengine' in sys.modules  # imported by the config
runner.train()
print(type(runner.optim_wrapper).__name__, type(runner.optim_wrapper.optimizer).__name__,
      type(runner.model.linear).__module__)
"""


@pytest.mark.slow
def test_a_config_file_imports_the_integration(tmp_path):
    """In a config file, ``custom_imports`` registers the wrapper and the hook: a fresh
    interpreter that never imported memkern trains the seed's model through them."""
    import subprocess
    import sys

    config = tmp_path / "config.py"
    config.write_text(CONFIG_FILE.format(work_dir=str(tmp_path / "work")))
    script = tmp_path / "run.py"
    script.write_text(RUN_CONFIG)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script), str(config)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-3:] == ["MemkernOptimWrapper", "ShardedOptimizer",
                                        "memkern.nn.linear"]
