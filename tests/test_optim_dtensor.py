"""FusedAdamW and FusedSGD (32-bit and 8-bit state) on DTensor parameters, across real processes
(gloo on the CPU): FSDP2's ``fully_shard`` on a 1-D mesh, and a 2-D (dp, tp) mesh with Shard and
Replicate placements.

Oracles: the same optimizer on the full tensors in one process (bit for bit for the 32-bit step,
whose math is elementwise), and for 8-bit state the same optimizer on a plain copy of each
rank's shard (the quantization blocks start at the shard's start); ``torch.nn.utils.
clip_grad_norm_`` on the full tensors; a checkpoint saved through ``torch.distributed.
checkpoint`` at one world size and loaded at another against the uninterrupted run. Gradients
are drawn per step from a seeded generator (the same full gradient on every rank), so the
optimizer is all that differs between the runs. Launched through tests/launch_ranks.py.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import launch_ranks
import memkern as mk
from clean_exit import DTENSOR_CACHES
from compare import params_rel_err

ALGORITHMS = {"adamw": (mk.optim.FusedAdamW, dict(lr=3e-2, weight_decay=0.1)),
              "sgd": (mk.optim.FusedSGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01))}
CONFIGS = [(algorithm, precision) for algorithm in ALGORITHMS for precision in ("32bit", "8bit")]
STEPS, SAVED_AT = 5, 3


class Net(torch.nn.Module):
    """fc1.weight's shards (66 and 65 rows of 67) hold >= 4096 elements each, so 8-bit state
    applies to the whole parameter and to each shard alike; gain has fewer elements than
    ranks (an empty shard on rank 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(67, 131)
        self.fc2 = torch.nn.Linear(131, 5)
        self.gain = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) * self.gain


def make_net(seed: int, dtype: torch.dtype = torch.float32) -> Net:
    torch.manual_seed(seed)
    return Net().to(dtype)


def sharded_net(seed: int, mesh, dtype: torch.dtype = torch.float32) -> Net:
    """FSDP2 per layer and at the root, with one forward and backward run (FSDP2's lazy
    initialisation reallocates uneven shards: the optimizer, built before, must follow)."""
    net = make_net(seed, dtype)
    fully_shard(net.fc1, mesh=mesh)
    fully_shard(net.fc2, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def make_optimizer(params, algorithm: str, precision: str):
    cls, hyper = ALGORITHMS[algorithm]
    return cls(params, **hyper, state_precision=precision)


def full_grads(params, seed: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return [3 * torch.randn(p.shape, generator=g) for p in params]


def give_grads(params, grads) -> None:
    """Sets each parameter's gradient: a DTensor like the parameter, or into the flat buffer's
    view of a plain one."""
    for p, g in zip(params, grads):
        if isinstance(p, DTensor):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
        else:
            p.grad.copy_(g)


def moments(opt) -> dict[str, torch.Tensor]:
    """The saved state tensors of fc1.weight (parameter 0) but its step."""
    return {k: v for k, v in opt.state_dict()["state"][0].items()
            if isinstance(v, torch.Tensor) and k != "step"}


def first_use(net, opt) -> None:
    net(torch.randn(3, 67, dtype=net.fc1.weight.dtype)).sum().backward()
    opt.zero_grad()


# ------------------------------------------------------------------------------ scenarios
def scenario_step(rank, world, seed, out):
    """STEPS steps of each configuration on the sharded net, on the full net, and (8-bit) on
    plain copies of this rank's shards."""
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for algorithm, precision in CONFIGS:
        full, net = make_net(seed), sharded_net(seed, mesh)
        opt_full = make_optimizer(full.parameters(), algorithm, precision)
        opt = make_optimizer(net.parameters(), algorithm, precision)
        first_use(net, opt)
        params = list(net.parameters())
        # the shards' oracle: plain parameters holding this rank's (non-empty) shards
        mine = [p for p in params if p.to_local().numel()]
        shards = [p.to_local().detach().clone().requires_grad_() for p in mine]
        opt_shards = make_optimizer(shards, algorithm, precision)
        for step in range(STEPS):
            grads = full_grads(params, seed, step)
            give_grads(full.parameters(), grads)
            give_grads(params, grads)
            give_grads(shards, [p.grad.to_local() for p in mine])
            for o in (opt_full, opt, opt_shards):
                o.step()
        w = net.fc1.weight
        results[algorithm, precision] = dict(
            full=[p.detach().clone() for p in full.parameters()],
            gathered=[p.full_tensor() for p in params],
            local=[p.to_local().clone() for p in mine],
            local_oracle=[p.detach().clone() for p in shards],
            state={k: (type(v).__name__, getattr(v, "placements", None) == w.placements)
                   for k, v in moments(opt).items()},
            placements=w.placements,
            state_bytes=sum(t.numel() * t.element_size() for seg in opt.segments
                            for t in seg.stored_tensors().values()),
            local_numel=sum(p.to_local().numel() for p in params))
    return results


def scenario_step_bf16(rank, world, seed, out):
    """bfloat16 sharded parameters (float32 masters kept by the optimizer), 32-bit state; then
    the optimizer's state dict loaded back."""
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for algorithm in ALGORITHMS:
        full, net = make_net(seed, torch.bfloat16), sharded_net(seed, mesh, torch.bfloat16)
        opt_full = make_optimizer(full.parameters(), algorithm, "32bit")
        opt = make_optimizer(net.parameters(), algorithm, "32bit")
        first_use(net, opt)
        params = list(net.parameters())
        for step in range(STEPS):
            grads = [g.bfloat16() for g in full_grads(params, seed, step)]
            give_grads(full.parameters(), grads)
            give_grads(params, grads)
            opt_full.step()
            opt.step()
        # a round trip in grad mode, as accelerate's AcceleratedOptimizer makes at wrapping
        # (it raised: the masters' local shards are views that to_local() made)
        opt.load_state_dict(opt.state_dict())
        master = opt.state_dict()["state"][1]["master_param"]
        results[algorithm] = dict(
            full=[p.detach().clone() for p in full.parameters()],
            gathered=[p.full_tensor() for p in params],
            master=(type(master).__name__, master.full_tensor().clone()),
            full_master=opt_full.state_dict()["state"][1]["master_param"].clone())
    return results


GRIDS = {"(1, W)": lambda world: (1, world), "(W, 1)": lambda world: (world, 1)}
"""2-D meshes of W ranks, each with a dimension of one rank: an inf on one rank must reach the
others over whichever dimension holds them."""


def scenario_found_inf(rank, world, seed, out):
    """An inf in the last rank's shard only: through the found_inf argument, and through
    ShardedGradScaler (unscale_, clipping, step, update), on a 1-D mesh; through the
    found_inf argument on the 2-D meshes of GRIDS."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for how in ("found_inf", "scaler"):
        net = sharded_net(seed, mesh)
        opt = mk.optim.FusedAdamW(net.parameters(), lr=0.1)
        first_use(net, opt)
        params = list(net.parameters())
        before = [p.full_tensor().clone() for p in params]
        scaler = ShardedGradScaler("cpu", init_scale=2.0**8)
        loss = net(torch.randn(4, 67)).square().mean()
        (scaler.scale(loss) if how == "scaler" else loss).backward()
        if rank == world - 1:
            net.fc1.weight.grad.to_local()[-1, -1] = float("nan")
        if how == "found_inf":
            # what each rank's own check of its shard finds
            found_inf = torch.tensor(float(rank == world - 1))
            opt.step(found_inf=found_inf)
            results[how] = dict(found_inf=float(found_inf))
        else:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(opt)
            scaler.update()
            results[how] = dict(scale=float(scaler.get_scale()))
        results[how]["unchanged"] = all(torch.equal(p.full_tensor(), b)
                                        for p, b in zip(params, before))
        results[how]["steps"] = [float(s["step"]) for s in opt.state.values()]
    for shape, dims in GRIDS.items():  # the flag agreed over every dimension of the mesh
        grid = init_device_mesh("cpu", dims(world), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(seed)
        params = [torch.nn.Parameter(distribute_tensor(torch.randn(13, 11), grid,
                                                       (Shard(0), Shard(1)))),
                  torch.nn.Parameter(distribute_tensor(torch.randn(13), grid,
                                                       (Shard(0), Replicate())))]
        opt = mk.optim.FusedAdamW(params, lr=0.1)
        before = [p.full_tensor().clone() for p in params]
        give_grads(params, full_grads(params, seed, 0))
        found_inf = torch.tensor(float(rank == world - 1))
        opt.step(found_inf=found_inf)
        results[shape] = dict(found_inf=float(found_inf),
                              unchanged=all(torch.equal(p.full_tensor(), b)
                                            for p, b in zip(params, before)),
                              steps=[float(s["step"]) for s in opt.state.values()])
    return results


def scenario_clip_2d(rank, world, seed, out):
    """A (1, world) mesh: a weight sharded on both dims, a bias sharded on the size-1 dim and
    replicated over the other, a replicated vector. torch's clip_grad_norm_ on the DTensor
    gradients, then the step, against the same on the full tensors."""
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(seed)
    full = [torch.nn.Parameter(torch.randn(13, 11)), torch.nn.Parameter(torch.randn(13)),
            torch.nn.Parameter(torch.randn(3))]
    placements = [(Shard(0), Shard(1)), (Shard(0), Replicate()), (Replicate(), Replicate())]
    params = [torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, pl))
              for p, pl in zip(full, placements)]
    opt_full, opt = mk.optim.FusedAdamW(full, lr=0.1), mk.optim.FusedAdamW(params, lr=0.1)
    norms = []
    for step in range(3):
        grads = full_grads(full, seed, step)
        exact = float(torch.cat([g.flatten() for g in grads]).double().norm())
        give_grads(full, grads)
        give_grads(params, grads)
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        norm_full = torch.nn.utils.clip_grad_norm_(full, 1.0)
        norms.append((float(norm.full_tensor()), float(norm_full), exact))
        opt.step()
        opt_full.step()
    return dict(norms=norms, gathered=[p.full_tensor() for p in params],
                full=[p.detach().clone() for p in full])


def scenario_errors(rank, world, seed, out):
    """A mix of plain and DTensor parameters, parameters on two meshes, and DTensor
    parameters given to ShardedOptimizer."""
    flat_mesh = init_device_mesh("cpu", (world,))
    grid = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    sharded = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), flat_mesh, [Shard(0)]))
    other = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), grid,
                                                 [Replicate(), Shard(0)]))
    errors = {}
    for case, params in (("mixed", [sharded, torch.nn.Parameter(torch.randn(2))]),
                         ("meshes", [sharded, other])):
        for cls in (mk.optim.FusedAdamW, mk.optim.FusedSGD):
            try:
                cls(params, lr=0.1)
            except ValueError as e:
                errors[case, cls.__name__] = str(e)
    try:
        mk.optim.ShardedOptimizer((p for p in [sharded]), lr=0.1)
    except ValueError as e:
        errors["ShardedOptimizer"] = str(e)
    return errors


def checkpoint_dir(out: str, world: int, algorithm: str, precision: str) -> str:
    return os.path.join(out, f"ckpt-W{world}", f"{algorithm}-{precision}")


def scenario_checkpoint_save(rank, world, seed, out):
    """SAVED_AT steps, a save through torch.distributed.checkpoint, then the rest of the run
    (the uninterrupted run the loads are compared with)."""
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for algorithm, precision in CONFIGS:
        net = sharded_net(seed, mesh)
        opt = make_optimizer(net.parameters(), algorithm, precision)
        first_use(net, opt)
        params = list(net.parameters())
        for step in range(STEPS):
            if step == SAVED_AT:
                model_state, optim_state = get_state_dict(net, opt)
                dcp.save({"model": model_state, "optim": optim_state},
                         checkpoint_id=checkpoint_dir(out, world, algorithm, precision))
                saved = {k: v.full_tensor().clone() for k, v in moments(opt).items()}
            give_grads(params, full_grads(params, seed, step))
            opt.step()
        results[algorithm, precision] = dict(params=[p.full_tensor() for p in params],
                                             saved_state=saved)
    return results


def scenario_checkpoint_load(rank, world, seed, out):
    """Loads what the other world size (2 -> 1, 1 -> 2) saved into a fresh net and optimizer
    (of another initialisation) and runs the remaining steps."""
    mesh = init_device_mesh("cpu", (world,))
    saved_by = 1 if world == 2 else 2
    results = {}
    for algorithm, precision in CONFIGS:
        net = sharded_net(seed + 1, mesh)
        opt = make_optimizer(net.parameters(), algorithm, precision)
        first_use(net, opt)
        model_state, optim_state = get_state_dict(net, opt)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=checkpoint_dir(out, saved_by, algorithm, precision))
        set_state_dict(net, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        loaded = {k: v.full_tensor().clone() for k, v in moments(opt).items()}
        params = list(net.parameters())
        for step in range(SAVED_AT, STEPS):
            give_grads(params, full_grads(params, seed, step))
            opt.step()
        results[algorithm, precision] = dict(params=[p.full_tensor() for p in params],
                                             loaded_state=loaded,
                                             steps=sorted({float(s["step"])
                                                           for s in opt.state.values()}))
    return results


if __name__ == "__main__":
    launch_ranks.serve(globals(), group_kept_by=DTENSOR_CACHES)


# ---------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """W=1 saves, W=2 runs everything and loads W=1's checkpoint and saves its own, which a
    second W=1 launch loads."""
    out = str(tmp_path_factory.mktemp("dtensor"))
    seed = launch_ranks.fresh_seed()
    first = launch_ranks.launch(__file__, 1, ["checkpoint_save"], out, seed)
    two = launch_ranks.launch(__file__, 2, ["step", "step_bf16", "found_inf", "clip_2d", "errors",
                                            "checkpoint_save", "checkpoint_load"], out, seed)
    last = launch_ranks.launch(__file__, 1, ["checkpoint_load"], out, seed)
    return {1: dict(first, **last), 2: two}


@pytest.mark.parametrize("algorithm, precision", CONFIGS)
def test_step_on_local_shards_equals_the_full_tensors(runs, algorithm, precision):
    for rank, result in enumerate(runs[2]["step"]):
        r = result[algorithm, precision]
        assert r["placements"] == (Shard(0),)
        assert r["state"] and all(r["state"].values()) and all(
            kind == "DTensor" for kind, _ in r["state"].values()), r["state"]
        # the shard oracle: the same optimizer on plain copies of this rank's shards
        assert all(map(torch.equal, r["local"], r["local_oracle"])), rank
        if precision == "32bit":
            assert all(map(torch.equal, r["gathered"], r["full"])), rank
            # float32 parameters: the moments (or momentum buffer) of this rank's shards only
            per_element = {"adamw": 8, "sgd": 4}[algorithm]
            assert r["state_bytes"] == per_element * r["local_numel"], rank
        else:  # quantization blocks start at each shard's start, not the full tensor's
            assert params_rel_err(r["gathered"], r["full"]) <= 1e-2


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_bf16_shards_with_float32_masters_equal_the_full_tensors(runs, algorithm):
    for result in runs[2]["step_bf16"]:
        r = result[algorithm]
        assert all(map(torch.equal, r["gathered"], r["full"]))
        kind, master = r["master"]
        assert kind == "DTensor" and master.dtype == torch.float32
        assert torch.equal(master, r["full_master"])


def test_an_inf_on_one_rank_skips_the_step_on_every_rank(runs):
    for rank, result in enumerate(runs[2]["found_inf"]):
        for how in ("found_inf", *GRIDS):
            assert result[how]["found_inf"] == 1.0, (how, rank)
        for how in ("found_inf", "scaler", *GRIDS):
            assert result[how]["unchanged"], (how, rank)
            assert set(result[how]["steps"]) == {0.0}, (how, rank)
        assert result["scaler"]["scale"] == 2.0**7  # backed off on every rank


def test_clip_grad_norm_counts_each_element_once(runs):
    for result in runs[2]["clip_2d"]:
        for sharded, full, exact in result["norms"]:
            assert abs(sharded - exact) <= 1e-6 * exact
            assert abs(full - exact) <= 1e-6 * exact
        assert params_rel_err(result["gathered"], result["full"]) <= 1e-6


def test_mixed_two_meshes_or_sharded_optimizer_is_one_clear_error(runs):
    for errors in runs[2]["errors"]:
        for cls in ("FusedAdamW", "FusedSGD"):
            assert errors["mixed", cls] == (
                f"memkern.{cls}: params mixes DTensors (e.g. params[0]) and plain tensors "
                "(e.g. params[1]); shard every parameter (fully_shard the root module too) or "
                "none, or give each kind its own optimizer")
            assert errors["meshes", cls].startswith(f"memkern.{cls}: params[1] lies on device mesh")
            assert errors["meshes", cls].endswith("make one optimizer per mesh")
        assert errors["ShardedOptimizer"].startswith(
            "memkern.ShardedOptimizer: params[0] is a DTensor (FSDP2's fully_shard or tensor "
            "parallelism), which already shards parameters and reduces gradients; step them "
            "with memkern.optim.FusedAdamW or FusedSGD")


@pytest.mark.parametrize("algorithm, precision", CONFIGS)
@pytest.mark.parametrize("saved, loaded", [(2, 1), (1, 2)])
def test_checkpoint_loads_at_another_world_size(runs, saved, loaded, algorithm, precision):
    uninterrupted = runs[saved]["checkpoint_save"][0][algorithm, precision]
    for result in runs[loaded]["checkpoint_load"]:
        r = result[algorithm, precision]
        assert r["steps"] == [float(STEPS)]
        for key, value in uninterrupted["saved_state"].items():
            if precision == "32bit":
                assert torch.equal(r["loaded_state"][key], value), key
            else:  # requantized in the other world size's blocks
                err = (r["loaded_state"][key] - value).abs().max()
                assert err <= 0.02 * value.abs().max(), key
        if precision == "32bit":
            assert all(map(torch.equal, r["params"], uninterrupted["params"]))
        else:
            assert params_rel_err(r["params"], uninterrupted["params"]) <= 1e-2
