"""``memkern.integrations.mmengine`` across 2 gloo processes (``launcher='pytorch'``): ZeRO-1
and ZeRO-2 through ``MemkernOptimWrapper`` with ``MemkernDataParallel``, and under MMEngine's
own ``DistributedDataParallel`` wrapper (the gradients reduced once: by the optimizer, never
by DDP as well); MMEngine's FSDP1 wrapper (``MMFullyShardedDataParallel``) with memkern's
layers, and ``MemkernOptimWrapper`` refused on it in one line.

Oracle: MMEngine's ``Runner`` in one process with MMEngine's own ``OptimWrapper`` and torch's
``AdamW``, on the global batch (the two ranks' micro-batches together), unpatched. Both ranks
launch once and run every scenario (tests/launch_ranks.py).
"""
from __future__ import annotations

import os
import sys
import uuid

import pytest
import torch
import torch.distributed as dist
from torch import nn

import launch_ranks
from compare import params_rel_err

pytest.importorskip("mmengine")
from mmengine.model import BaseModel, MMDistributedDataParallel  # noqa: E402
from mmengine.runner import Runner  # noqa: E402

import memkern  # noqa: E402
import memkern.integrations.mmengine  # noqa: E402,F401  (registers the wrappers)

WORLD = 2
BATCH = 2  # per rank; the one-process run takes WORLD * BATCH
ITERS = 13  # per epoch and rank; 2 epochs in windows of 4 leave a last window of 2
OPTIMIZER = dict(type="AdamW", lr=0.01, weight_decay=0.01)
OPTIONS = dict(accumulative_counts=4, clip_grad=dict(max_norm=0.3))
TOLERANCE = 1e-6
"""float32: the ranks' sums reach the gradient in another order than one process's, and
memkern's fused step rounds differently from torch's AdamW, ~1 ulp per step."""


class Net(BaseModel):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(7, 11)
        self.fc2 = nn.Linear(11, 3)

    def forward(self, x, y, mode):
        return dict(loss=nn.functional.cross_entropy(self.fc2(torch.tanh(self.fc1(x))), y))


def make_model(seed: int, patched: bool = False) -> Net:
    torch.manual_seed(seed)
    model = Net()
    return memkern.patch(model) if patched else model


def dataset(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(7, generator=g), int(torch.randint(0, 3, (), generator=g)))
            for _ in range(WORLD * BATCH * ITERS)]


def run(seed: int, model, work_dir: str, wrapper: str = "MemkernOptimWrapper", *,
        batch: int = BATCH, launcher: str = "pytorch", model_wrapper_cfg=None,
        **optim_wrapper) -> Runner:
    """Two epochs; across ranks each rank reads every other sample (DefaultSampler), so one
    micro-batch step of the ranks together reads the samples one process's batch reads."""
    runner = Runner(
        model=model, work_dir=os.path.join(work_dir, uuid.uuid4().hex[:8]),
        experiment_name=f"memkern-{uuid.uuid4().hex[:12]}", launcher=launcher,
        train_dataloader=dict(dataset=dataset(seed), batch_size=batch,
                              sampler=dict(type="DefaultSampler", shuffle=False),
                              collate_fn=dict(type="default_collate")),
        train_cfg=dict(by_epoch=True, max_epochs=2),
        optim_wrapper=dict(type=wrapper, optimizer=OPTIMIZER, **OPTIONS, **optim_wrapper),
        cfg=dict(model_wrapper_cfg=model_wrapper_cfg), default_hooks=dict(checkpoint=None),
        log_level="ERROR")
    runner.train()
    return runner


def weights(runner: Runner) -> list[torch.Tensor]:
    model = runner.model.module if hasattr(runner.model, "module") else runner.model
    return [p.detach().clone() for p in model.parameters()]


# ----------------------------------------------------------------------------- the ranks
def scenario_zero(rank, world, seed, out):
    """ZeRO-1 and ZeRO-2 with MemkernDataParallel: each rank's weights, and the optimizer
    state each rank holds (elements of its masters' and moments' slices)."""
    result = {}
    for stage in (1, 2):
        runner = run(seed, make_model(seed), out, zero_stage=stage,
                     model_wrapper_cfg=dict(type="MemkernDataParallel"))
        opt = runner.optim_wrapper.optimizer
        assert opt.world_size == world and opt.zero_stage == stage
        result[stage] = weights(runner)
    return result


def counting_allreduce(state: dict, bucket):
    """A DDP communication hook: counts the buckets DDP reduces, and averages them as DDP's
    default hook does."""
    state["buckets"] += 1
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def scenario_ddp(rank, world, seed, out):
    """MMEngine's DDP wrapper (built by hand: MMEngine's own would pass the CPU model a GPU's
    device_ids) around the model, ZeRO-1 underneath: how many buckets DDP reduced."""
    ddp = MMDistributedDataParallel(module=make_model(seed), broadcast_buffers=False)
    count = {"buckets": 0}
    ddp.register_comm_hook(count, counting_allreduce)
    runner = run(seed, ddp, out)
    return {"weights": weights(runner), "ddp_reductions": count["buckets"]}


def scenario_fsdp1(rank, world, seed, out):
    """FSDP1 around a patched model. MMEngine's ``MMFullyShardedDataParallel`` cannot run on
    the CPU, memkern or not (torch's FSDP1 wants a GPU unless given ``device_id='cpu'``, and
    then MMEngine's weight-init broadcast of the model's state dict mismatches across ranks),
    so torch's ``FullyShardedDataParallel`` is used directly, in MMEngine's wrapper's place:
    trained in a plain loop with torch's AdamW (each rank's half of the global batch), and
    given to ``MemkernOptimWrapper``, which refuses it."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    fsdp = FullyShardedDataParallel(make_model(seed, patched=True), device_id=torch.device("cpu"))
    layers = [type(m).__module__ for m in fsdp.module.modules()]
    opt = torch.optim.AdamW(fsdp.parameters(), lr=OPTIMIZER["lr"],
                            weight_decay=OPTIMIZER["weight_decay"])
    data = dataset(seed)
    for step in range(ITERS):
        x, y = torch.utils.data.default_collate(
            data[step * WORLD * BATCH + rank::WORLD][:BATCH])
        fsdp(x, y, "loss")["loss"].backward()
        opt.step()
        opt.zero_grad()
    with FullyShardedDataParallel.summon_full_params(fsdp):
        trained = [p.detach().clone() for p in fsdp.module.parameters()]
    try:
        memkern.integrations.mmengine.MemkernOptimWrapper(torch.optim.AdamW(fsdp.parameters()))
        refusal = None
    except ValueError as error:
        refusal = str(error)
    return {"weights": trained, "layers": layers, "refusal": refusal}


def one_process_loop(seed: int) -> list[torch.Tensor]:
    """The FSDP1 scenario's loop in one process, unpatched, on the global batch."""
    model = make_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=OPTIMIZER["lr"],
                            weight_decay=OPTIMIZER["weight_decay"])
    data = dataset(seed)
    for step in range(ITERS):
        x, y = torch.utils.data.default_collate(
            data[step * WORLD * BATCH:(step + 1) * WORLD * BATCH])
        model(x, y, "loss")["loss"].backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


# ----------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    seed = launch_ranks.fresh_seed()
    out = str(tmp_path_factory.mktemp("mmengine-ranks"))
    results = launch_ranks.launch(__file__, WORLD, ["zero", "ddp", "fsdp1"], out, seed)
    results["seed"] = seed
    torch.manual_seed(seed)
    one = run(seed, make_model(seed), out, "OptimWrapper", batch=WORLD * BATCH, launcher="none")
    return results, weights(one)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_through_the_wrapper_equals_one_process(ranks, stage):
    results, one_process = ranks
    for rank in range(WORLD):
        assert params_rel_err(results["zero"][rank][stage], one_process) < TOLERANCE


@pytest.mark.slow
def test_under_ddp_the_gradients_are_reduced_once(ranks):
    """DDP reduced no bucket (every forward ran in its no_sync()): the optimizer's
    reduction was the only one, and the result is the one-process run's."""
    results, one_process = ranks
    for rank in range(WORLD):
        assert results["ddp"][rank]["ddp_reductions"] == 0
        assert params_rel_err(results["ddp"][rank]["weights"], one_process) < TOLERANCE


@pytest.mark.slow
def test_fsdp1_trains_memkerns_layers_and_refuses_the_memkern_wrapper(ranks):
    """memkern's layers under FSDP1 train as the plain model in one process; the optimizer
    wrapper refuses FSDP1's flattened parameters in one line pointing to FSDP2."""
    results, _ = ranks
    expected = one_process_loop(results["seed"])
    for rank in range(WORLD):
        fsdp = results["fsdp1"][rank]
        assert "memkern.nn.linear" in fsdp["layers"]
        assert params_rel_err(fsdp["weights"], expected) < TOLERANCE
        refusal = fsdp["refusal"]
        assert refusal is not None and "\n" not in refusal
        assert "FSDP1" in refusal and "FSDP2" in refusal and "FusedAdamW" in refusal


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    # MMEngine's objects of these runs (its Runner, the DDP and FSDP1 wrappers) sit in reference
    # cycles that hold the process group until the garbage collector frees them (a
    # gc.collect() after destroy_process_group() does): not memkern's to release
    launch_ranks.serve(globals(), group_kept_by="MMEngine's Runner and wrappers (reference "
                       "cycles, freed by the garbage collector)")
