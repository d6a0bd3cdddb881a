"""ShardedOptimizer across real processes (gloo on 127.0.0.1), world sizes 1, 2 and 3, against
the single-process run: ZeRO stages 1 and 2, CPU offload, accumulation with both
normalisations, clipping, dynamic loss scaling with an overflow on one rank only, optimizer
state split 1/W, bytes per parameter against docs/memory.md's formulas, no host reads, resharding
checkpoints (full state dict and torch.distributed.checkpoint, saved mid-window at W=2 and
continued at W=3), interrupted saves, and ranks that disagree on the parameters.

Every launch runs this file as a script in W processes (``python tests/test_optim_distributed.py
worker ...``), each running a list of scenarios and saving what they measured; the tests
compare (the harness, with its timeouts and per-rank error reports, is tests/launch_ranks.py).
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import launch_ranks
import memkern as mk
from compare import params_rel_err
from memkern.optim.grad_buffer import ALIGN
from memkern.profile import reachable_bytes

WINDOWS, ACCUMULATION, BATCH = 20, 2, 12  # BATCH rows per micro-batch, split over the ranks
POISONED = (5, 1)  # (window, micro-batch) whose loss is inf on the last rank only
SCALER = dict(init_scale=2.0**10, growth_interval=3)


# ------------------------------------------------------------------------ model and data
class Net(torch.nn.Module):
    """Odd sizes, and a one-element parameter (fewer elements than ranks)."""

    def __init__(self, hidden: int = 33) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(13, hidden)
        self.fc2 = torch.nn.Linear(hidden, 5)
        self.gain = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) * self.gain


def make_model(seed: int, hidden: int = 33) -> Net:
    torch.manual_seed(seed)
    return Net(hidden)


def groups(model: Net) -> list[dict]:
    """Two param groups: weights with weight decay, biases and the gain without."""
    return [{"params": [model.fc1.weight, model.fc2.weight], "weight_decay": 0.05},
            {"params": [model.fc1.bias, model.fc2.bias, model.gain], "weight_decay": 0.0}]


ALGORITHMS = {
    # eps=1e-3: see test_optim_sharded's accumulation test (a component that cancels to ~0
    # over the batch would otherwise move by up to lr, by its last rounding bits).
    "adamw": dict(optimizer="adamw", lr=3e-3, eps=1e-3),
    "sgd": dict(optimizer="sgd", lr=0.05, momentum=0.9),
}
MODES = {  # name -> (algorithm, options)
    "stage1": ("adamw", dict(zero_stage=1)),
    "stage2": ("adamw", dict(zero_stage=2)),
    "offload": ("adamw", dict(zero_stage=1, offload="cpu")),
    "offload-stage2-sgd": ("sgd", dict(zero_stage=2, offload="cpu")),
}


def make_optimizer(model: Net, algorithm: str, **options) -> mk.optim.ShardedOptimizer:
    # bucket_size_mb=1e-3 (1 KiB): several buckets, one parameter bigger than a bucket.
    options = dict(dict(bucket_size_mb=1e-3), **options)
    return mk.optim.ShardedOptimizer(groups(model), accumulation_steps=ACCUMULATION,
                                     max_grad_norm=0.5, loss_scale=mk.LossScaler(**SCALER),
                                     **ALGORITHMS[algorithm], **options)


def batch(seed: int, window: int, micro: int, rank: int, world: int):
    """This rank's rows of the micro-batch (the union over ranks is the whole of it)."""
    g = torch.Generator().manual_seed(seed * 1000 + window * ACCUMULATION + micro)
    x, y = torch.randn(BATCH, 13, generator=g), 3 * torch.randn(BATCH, 5, generator=g)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    return x[rows], y[rows]


def feed(opt, model, seed, rank, world, micro_batches):
    """Runs ``(window, micro)`` micro-batches: odd windows normalise by num_items (summed
    loss), even ones by the mean; the poisoned one is inf on the last rank."""
    for window, micro in micro_batches:
        x, y = batch(seed, window, micro, rank, world)
        items = window % 2 == 1
        loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum" if items else "mean")
        if (window, micro) == POISONED and rank == world - 1:
            loss = loss * float("inf")
        opt.backward(loss, num_items=y.numel() if items else None)
        opt.step()
        opt.zero_grad()


def schedule(start: int = 0, stop: int = WINDOWS):
    return [(w, m) for w in range(start, stop) for m in range(ACCUMULATION)]


def train(opt, model, seed, rank, world):
    """20 windows, then one micro-batch closed with step(force=True)."""
    feed(opt, model, seed, rank, world, schedule())
    x, y = batch(seed, WINDOWS, 0, rank, world)
    opt.backward(torch.nn.functional.mse_loss(model(x), y))
    assert opt.step(force=True)


def outcome(opt, model) -> dict:
    return {"params": [p.detach().clone() for p in model.parameters()],
            "loss_scale": opt.loss_scale, "skipped": opt.skipped_steps,
            "grad_norm": opt.grad_norm}



# ------------------------------------------------------------------------------ scenarios
def scenario_equivalence(rank, world, seed, shared):
    results = {}
    for mode, (algorithm, options) in MODES.items():
        model = make_model(seed)
        opt = make_optimizer(model, algorithm, **options)
        train(opt, model, seed, rank, world)
        state = [t for seg in opt._segments for t in seg.state.values()]
        results[mode] = dict(outcome(opt, model), state_numel=sum(t.numel() for t in state))
    return results


def scenario_hand_computed(rank, world, seed, shared):
    """test_optim_sharded's hand-computed windows across the ranks, stages 1 and 2: an oracle
    that shares no code with the single-process run."""
    from test_optim_sharded import hand_computed_windows

    errors = {}
    for stage in (1, 2):
        torch.manual_seed(seed)
        model = torch.nn.Linear(13, 5)
        opt = mk.optim.ShardedOptimizer(model.parameters(), "sgd", lr=0.05, zero_stage=stage,
                                        accumulation_steps=2, bucket_size_mb=1e-4)
        errors[stage] = hand_computed_windows(opt, model, 0.05, 2, seed, rank, world)
    return errors


def scenario_no_host_read(rank, world, seed, shared):
    """The host-read spy over windows of stage 1 and stage 2 training."""
    from host_reads import HostReadSpy

    reads = {}
    for mode in ("stage1", "stage2"):
        model = make_model(seed)
        opt = make_optimizer(model, "adamw", **MODES[mode][1])
        feed(opt, model, seed, rank, world, schedule(0, 2))  # lazy initialisation first
        with pytest.MonkeyPatch.context() as monkeypatch:
            spy = HostReadSpy(monkeypatch)
            with spy:
                feed(opt, model, seed, rank, world, schedule(2, 8))  # includes the overflow
        reads[mode] = spy.reads
        assert opt.skipped_steps == 1
    return reads


def scenario_overlap(rank, world, seed, shared):
    """Stage 2 with one bucket per layer of a 4-layer MLP: how many gradients had arrived each
    time a bucket was launched, during one backward pass."""
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(64, 64) for _ in range(4)]
    model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.Tanh())])
    opt = mk.optim.ShardedOptimizer(model.parameters(), lr=1e-3, zero_stage=2,
                                    bucket_size_mb=(64 * 64 + ALIGN) * 4 / 2**20)
    shards = opt._shards
    arrived_at_launch = []
    launch = shards._launch_unit
    shards._launch_unit = lambda: (arrived_at_launch.append(sum(map(len, shards._arrived))),
                                   launch())
    opt.backward(model(torch.randn(8, 64)).square().mean())
    return {"units": len(shards.units), "arrived_at_launch": arrived_at_launch}


def scenario_memory(rank, world, seed, shared):
    """Bytes per parameter a rank keeps between steps, for a bfloat16 model trained for two
    windows with Adam: every storage the model and the optimizer keep alive. (Not the CPU
    profiler's allocation trace: it misses frees made on gloo's worker threads, which release
    gloo's copies of the buffers, so it reports them as kept.)"""
    result = {}
    for stage in (1, 2):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(),
                                    torch.nn.Linear(1024, 512)).to(torch.bfloat16)
        opt = mk.optim.ShardedOptimizer(model.parameters(), lr=1e-3, zero_stage=stage,
                                        accumulation_steps=2, max_grad_norm=1.0)
        for _ in range(2 * 2):
            x = torch.randn(8, 512, dtype=torch.bfloat16)
            opt.backward(model(x).float().square().mean())
            opt.step()
            opt.zero_grad()
        result[stage] = reachable_bytes(model, opt) / sum(p.numel() for p in model.parameters())
    return result


HIDDEN_CHECKPOINT = 81
"""The checkpoint scenarios' model: fc1.weight has 13 x 81 = 1053 elements, five ALIGN slots,
so its shard boundaries differ between W=2 (at 768) and W=3 (at 512 and 1024): a piece
loaded at W=3 starts inside a saved piece and spans two of them."""


def owned_pieces(opt) -> dict[int, list[tuple[int, int]]]:
    """Per parameter index, ``(first element, count)`` of the pieces of its state this rank
    holds (as checkpoints read and write them)."""
    return {i: [(start, flat.numel()) for flat, start in opt._state_pieces(p, "exp_avg")]
            for i, p in enumerate(opt._params())}


def piece_starts(rank_results: list[dict], key: str) -> dict[int, set[int]]:
    """Per parameter index, the first elements of the pieces (:func:`owned_pieces`, recorded
    under ``key``) that the ranks of one launch held."""
    starts: dict[int, set[int]] = {}
    for result in rank_results:
        for i, pieces in result[key]["pieces"].items():
            starts.setdefault(i, set()).update(start for start, _ in pieces)
    return starts


def scenario_checkpoint_save(rank, world, seed, shared):
    """Stage 2 at W=2: saves mid-window (window 9, a num_items window, after one of its two
    micro-batches) through state_dict() and save_sharded(), then trains on uninterrupted.
    Then two saves that fail midway."""
    from memkern.optim import checkpoint

    model = make_model(seed, HIDDEN_CHECKPOINT)
    opt = make_optimizer(model, "adamw", zero_stage=2)
    feed(opt, model, seed, rank, world, schedule(0, 9) + [(9, 0)])
    full = opt.state_dict()
    if rank == 0:
        torch.save({"model": model.state_dict(), "opt": full}, os.path.join(shared, "full.pt"))
    opt.save_sharded(os.path.join(shared, "sharded"))
    saved = {"state": full["state"], "window": full["memkern"]["window"],
             "pieces": owned_pieces(opt)}
    feed(opt, model, seed, rank, world, schedule(9, WINDOWS)[1:])
    uninterrupted = outcome(opt, model)

    # A save over the good checkpoint that dies after writing all data, before it is marked
    # complete; and a first save to a new path that dies inside torch.distributed.checkpoint.
    def dies_before_publish(*args):
        raise OSError("killed before publish")

    def dies_while_writing(*args, **kwargs):
        raise OSError("killed while writing")

    failures = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(checkpoint, "_publish", dies_before_publish)
        try:
            opt.save_sharded(os.path.join(shared, "sharded"))
        except OSError as e:  # on every rank, not only on rank 0 where it happened
            failures["before_publish"] = str(e)
    with pytest.MonkeyPatch.context() as monkeypatch:
        import torch.distributed.checkpoint as dcp

        monkeypatch.setattr(dcp.FileSystemWriter, "write_data", dies_while_writing)
        try:
            opt.save_sharded(os.path.join(shared, "fresh"))
        except dcp.api.CheckpointException as e:  # DCP's, on every rank (a BaseException)
            failures["while_writing"] = type(e).__name__
    return {"uninterrupted": uninterrupted, "saved": saved, "failures": failures}


def scenario_checkpoint_load(rank, world, seed, shared):
    """W=3 continues from W=2's mid-window checkpoints: the full state dict into stage 1, the
    sharded one into stage 2 (with a model of other initial weights, loaded first)."""
    checkpoint = torch.load(os.path.join(shared, "full.pt"))
    rest = schedule(9, WINDOWS)[1:]
    results = {}
    for how, stage in (("state_dict", 1), ("sharded", 2)):
        model = make_model(seed + 1, HIDDEN_CHECKPOINT)
        model.load_state_dict(checkpoint["model"])
        opt = make_optimizer(model, "adamw", zero_stage=stage)
        if how == "state_dict":
            opt.load_state_dict(checkpoint["opt"])
        else:
            opt.load_sharded(os.path.join(shared, "sharded"))
            reloaded = opt.state_dict()
            results["reloaded"] = {"state": reloaded["state"],
                                   "window": reloaded["memkern"]["window"],
                                   "pieces": owned_pieces(opt)}
        assert opt.micro_batches == 1
        feed(opt, model, seed, rank, world, rest)
        results[how] = outcome(opt, model)
    try:
        opt.load_sharded(os.path.join(shared, "fresh"))
    except FileNotFoundError as e:
        results["fresh_error"] = str(e)
    results["corrupted"] = load_corrupted(opt, rank, shared)
    return results


def load_corrupted(opt, rank, shared) -> dict:
    """Loads a copy of W=2's sharded checkpoint with one bit flipped in the last stored item
    (which one rank alone checks): every rank must refuse it, and keep its state."""
    from memkern.optim import checkpoint

    bad = os.path.join(shared, "sharded-corrupted")
    if rank == 0:
        shutil.copytree(os.path.join(shared, "sharded"), bad)
        with open(os.path.join(bad, checkpoint.MARKER)) as fh:
            last = max(json.load(fh)["crc32"], key=lambda key: key.split(":")[0])
        file, offset, length = last.rsplit(":", 2)
        with open(os.path.join(bad, file), "r+b") as fh:
            fh.seek(int(offset) + int(length) // 2)
            byte = fh.read(1)[0]
            fh.seek(int(offset) + int(length) // 2)
            fh.write(bytes([byte ^ 4]))
    dist.barrier()
    before = opt.state_dict()
    try:
        opt.load_sharded(bad)
        error = None
    except ValueError as e:
        error = str(e)
    after = opt.state_dict()
    unchanged = all(torch.equal(before["state"][i][k], after["state"][i][k])
                    for i in before["state"] for k in before["state"][i])
    return {"error": error, "unchanged": unchanged and before["memkern"]["window"]["num_items"]
            == after["memkern"]["window"]["num_items"]}


HIDDEN_8BIT = 400
"""fc1.weight has 13 x 400 = 5200 elements: 8-bit state; the other parameters stay float32."""
MODES_8BIT = ("stage1", "stage2", "offload")


def make_adamw8bit(model: Net, **options) -> mk.optim.ShardedOptimizer:
    return make_optimizer(model, "adamw", state_precision="8bit", **options)


def make_sgd8bit(model: Net, **options) -> mk.optim.ShardedOptimizer:
    """SGD with an 8-bit momentum buffer. Clipping is on but never bites (the gradients' norm
    is below 100): its coefficient is exactly 1, which keeps feed_exact's runs exact."""
    options = dict(dict(bucket_size_mb=1e-3), **options)
    return mk.optim.ShardedOptimizer(groups(model), "sgd", lr=0.05, momentum=0.9, dampening=0.1,
                                     state_precision="8bit", accumulation_steps=ACCUMULATION,
                                     max_grad_norm=1e4, loss_scale=mk.LossScaler(**SCALER),
                                     **options)


def feed_exact(opt, model, seed, rank, world, micro_batches):
    """Like :func:`feed`, with losses ``(p * G).sum()`` whose gradient ``G`` lies on a coarse
    grid (integers below 2**10 times a power of two) and is split over the ranks element by
    element (rank r takes the elements ``i % W == r``), with num_items summing to 64 per
    window over the ranks: every world size and stage sums, unscales and normalises to the
    same float32 gradient bit for bit, so the 8-bit runs must agree exactly (no code rounding
    the other way because the ranks' gradients were summed in another order)."""
    for window, micro in micro_batches:
        g = torch.Generator().manual_seed(seed * 1000 + window * ACCUMULATION + micro)
        loss = 0.0
        for p in model.parameters():
            grid = torch.randint(-2**10, 2**10, p.shape, generator=g).float()
            grid = grid * 2.0 ** -int(torch.randint(10, 22, (), generator=g))
            mine = torch.arange(p.numel()).reshape(p.shape) % world == rank
            loss = loss + (p * torch.where(mine, grid, 0.0)).sum()
        if (window, micro) == POISONED and rank == world - 1:
            loss = loss * float("inf")
        opt.backward(loss, num_items=(rank + 1) * 32 // world - rank * 32 // world)
        opt.step()
        opt.zero_grad()


def train_exact(opt, model, seed, rank, world):
    """20 windows of feed_exact, then one micro-batch closed with step(force=True)."""
    feed_exact(opt, model, seed, rank, world, schedule() + [(WINDOWS, 0)])
    assert opt.step(force=True)


EIGHT_BIT = {  # algorithm -> (optimizer, train, feed)
    "adamw": (make_adamw8bit, train, feed),
    "sgd": (make_sgd8bit, train_exact, feed_exact),
}


def scenario_equivalence_8bit(rank, world, seed, shared):
    results = {}
    for algorithm, (make, train_on, _) in EIGHT_BIT.items():
        for mode in MODES_8BIT:
            model = make_model(seed, HIDDEN_8BIT)
            opt = make(model, **MODES[mode][1])
            train_on(opt, model, seed, rank, world)
            results[algorithm, mode] = dict(outcome(opt, model), state=opt.state_dict()["state"],
                                            quantized=sum(seg.quantized for seg in opt._segments))
    return results


def scenario_checkpoint_save_8bit(rank, world, seed, shared):
    """8-bit state at W=2, stage 2: saved mid-window as a full state dict and sharded."""
    results = {}
    for algorithm, (make, _, feed_on) in EIGHT_BIT.items():
        model = make_model(seed, HIDDEN_8BIT)
        opt = make(model, zero_stage=2)
        feed_on(opt, model, seed, rank, world, schedule(0, 9) + [(9, 0)])
        full = opt.state_dict()
        if rank == 0:
            torch.save({"model": model.state_dict(), "opt": full},
                       os.path.join(shared, f"full-8bit-{algorithm}.pt"))
        opt.save_sharded(os.path.join(shared, f"sharded-8bit-{algorithm}"))
        feed_on(opt, model, seed, rank, world, schedule(9, WINDOWS)[1:])
        results[algorithm] = {"uninterrupted": outcome(opt, model), "saved": full["state"]}
    return results


def scenario_checkpoint_load_8bit(rank, world, seed, shared):
    """W=3 continues from W=2's 8-bit checkpoints: the full state dict into stage 1, the
    sharded one into stage 2."""
    results = {}
    for algorithm, (make, _, feed_on) in EIGHT_BIT.items():
        checkpoint = torch.load(os.path.join(shared, f"full-8bit-{algorithm}.pt"))
        for how, stage in (("state_dict", 1), ("sharded", 2)):
            model = make_model(seed + 1, HIDDEN_8BIT)
            model.load_state_dict(checkpoint["model"])
            opt = make(model, zero_stage=stage)
            if how == "state_dict":
                opt.load_state_dict(checkpoint["opt"])
            else:
                opt.load_sharded(os.path.join(shared, f"sharded-8bit-{algorithm}"))
            results[algorithm, f"reloaded-{how}"] = opt.state_dict()["state"]
            feed_on(opt, model, seed, rank, world, schedule(9, WINDOWS)[1:])
            results[algorithm, how] = outcome(opt, model)
    return results


def scenario_mismatch(rank, world, seed, shared):
    """Rank 1 builds another model: a wider hidden layer, one parameter fewer, a frozen one."""
    errors = {}
    for case in ("shape", "count", "frozen"):
        model = make_model(seed, hidden=34 if (rank == 1 and case == "shape") else 33)
        params = list(model.parameters())
        if rank == 1 and case == "count":
            params = params[:-1]
        if rank == 1 and case == "frozen":
            params[2].requires_grad_(False)
        try:
            mk.optim.ShardedOptimizer(params, lr=1e-3)
        except ValueError as e:
            errors[case] = str(e)
    return errors


def scenario_gradless(rank, world, seed, shared):
    """In the second window the last rank's second micro-batch has a loss that reaches no
    parameter of the optimizer; stages 1 and 2, each on a process group whose collectives time
    out after 20 s (a rank left waiting for the others fails instead of hanging). What each
    rank raised, whether its parameters moved, what it raised training the third window after
    zero_grad(), and whether that gave the parameters of a run without the second window."""
    results = {}
    for stage in (1, 2):
        group = dist.new_group(timeout=timedelta(seconds=20))
        result, params = {"error": None, "after": None}, {}
        for run in ("dropped", "without"):
            model = make_model(seed)
            opt = make_optimizer(model, "adamw", zero_stage=stage, process_group=group)
            feed(opt, model, seed, rank, world, schedule(0, 1))
            if run == "dropped":
                before = [p.detach().clone() for p in model.parameters()]
                try:
                    for micro in range(ACCUMULATION):
                        x, y = batch(seed, 1, micro, rank, world)
                        loss = torch.nn.functional.mse_loss(model(x), y)
                        if micro == 1 and rank == world - 1:
                            loss = loss.detach().requires_grad_()
                        opt.backward(loss)
                        opt.step()
                except RuntimeError as e:
                    result["error"] = str(e)
                result["unchanged"] = all(torch.equal(p, q)
                                          for p, q in zip(model.parameters(), before))
                opt.zero_grad()
            try:
                feed(opt, model, seed, rank, world, schedule(2, 3))
            except RuntimeError as e:
                result["after"] = str(e)
            params[run] = [p.detach().clone() for p in model.parameters()]
        result["as_without"] = all(torch.equal(p, q)
                                   for p, q in zip(params["dropped"], params["without"]))
        # saved after the pass that reached no parameter, resumed by a fresh optimizer: its
        # window's step is refused too, on every rank
        model = make_model(seed)
        opt = make_optimizer(model, "adamw", zero_stage=stage, process_group=group)
        for micro in range(2):
            x, y = batch(seed, 1, micro, rank, world)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.backward(loss.detach().requires_grad_() if micro == 1 and rank == world - 1
                         else loss)
        state = opt.state_dict()
        model = make_model(seed)
        opt = make_optimizer(model, "adamw", zero_stage=stage, process_group=group)
        opt.load_state_dict(state)
        try:
            for micro in range(2, ACCUMULATION):
                x, y = batch(seed, 1, micro, rank, world)
                opt.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
        except RuntimeError as e:
            result["resumed_error"] = str(e)
        results[stage] = result
        dist.destroy_process_group(group)
    return results


# --------------------------------------------------------------------------------- launch
def launch(world: int, scenarios: list[str], out: str, seed: int) -> dict[str, list]:
    """Runs the scenarios in ``world`` processes; returns each scenario's per-rank results."""
    return launch_ranks.launch(__file__, world, scenarios, out, seed)


@pytest.fixture(scope="module")
def seed():
    value = int(torch.randint(2**20, ()))
    print(f"distributed tests seed: {value}")
    return value


@pytest.fixture(scope="module")
def reference(seed):
    """The single-process run of every mode's algorithm."""
    runs = {}
    for algorithm in ALGORITHMS:
        model = make_model(seed)
        opt = make_optimizer(model, algorithm)
        train(opt, model, seed, 0, 1)
        runs[algorithm] = dict(outcome(opt, model),
                               state_numel=sum(t.numel() for s in opt._segments
                                               for t in s.state.values()))
    for algorithm, (make, train_on, _) in EIGHT_BIT.items():
        model = make_model(seed, HIDDEN_8BIT)
        opt = make(model)
        train_on(opt, model, seed, 0, 1)
        runs[f"{algorithm}-8bit"] = dict(outcome(opt, model), state=opt.state_dict()["state"])
    return runs


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return str(tmp_path_factory.mktemp("distributed"))


LAUNCHES = {  # world size -> its scenarios, launched in this order (W=3 loads W=2's saves)
    1: ["equivalence", "equivalence_8bit"],
    2: ["equivalence", "hand_computed", "no_host_read", "memory", "overlap", "checkpoint_save",
        "equivalence_8bit", "checkpoint_save_8bit", "gradless"],
    3: ["equivalence", "hand_computed", "memory", "checkpoint_load", "equivalence_8bit",
        "checkpoint_load_8bit"],
}


@pytest.fixture(scope="module")
def runs(seed, shared):
    """One launch per world size; W=2 saves the checkpoints W=3 loads."""
    return {world: launch(world, scenarios, shared, seed)
            for world, scenarios in LAUNCHES.items()}


# ---------------------------------------------------------------------------------- tests
# W=1 without offload runs the very code of the single-process reference: only offload, which
# takes the sharded path at W=1 too, is compared there.
EQUIVALENCE = [(world, mode) for world in (1, 2, 3) for mode in sorted(MODES)
               if world > 1 or MODES[mode][1].get("offload")]


@pytest.mark.parametrize("world, mode", EQUIVALENCE, ids=[f"{m}-W{w}" for w, m in EQUIVALENCE])
def test_parameters_equal_the_single_process_run(runs, reference, seed, world, mode):
    """20 windows of 2 micro-batches (mean and num_items windows), clipping, dynamic loss
    scaling with an inf on the last rank only in window 5, and a forced last window. The
    single-process run is itself checked against torch (test_reference_equals_torch)."""
    ref = reference[MODES[mode][0]]
    for rank, result in enumerate(runs[world]["equivalence"]):
        got = result[mode]
        assert params_rel_err(got["params"], ref["params"]) <= 1e-6, (rank, mode)
        assert got["skipped"] == ref["skipped"] == 1  # every rank skipped the poisoned window
        assert got["loss_scale"] == ref["loss_scale"]
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-6)
    assert params_rel_err(ref["params"], [p.detach() for p in make_model(seed).parameters()]) > 1e-2


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_reference_equals_torch(reference, seed, algorithm):
    """The single-process run that the W-rank runs are compared with, against torch's own
    loop over the same schedule: GradScaler, clip_grad_norm_ and torch.optim.AdamW / SGD, the
    window's loss divided by its micro-batch count (mean windows) or its gradients by its
    total num_items (num_items windows)."""
    model = make_model(seed)
    settings = dict(ALGORITHMS[algorithm])
    settings.pop("optimizer")
    if algorithm == "adamw":
        opt = torch.optim.AdamW(groups(model), **settings)
    else:
        opt = torch.optim.SGD(groups(model), **settings)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    windows = [[(w, m) for m in range(ACCUMULATION)] for w in range(WINDOWS)] + [[(WINDOWS, 0)]]
    for window in windows:
        items = 0
        for w, m in window:
            x, y = batch(seed, w, m, 0, 1)
            with_items = w % 2 == 1 and w < WINDOWS
            loss = torch.nn.functional.mse_loss(model(x), y,
                                                reduction="sum" if with_items else "mean")
            if (w, m) == POISONED:
                loss = loss * float("inf")
            items += y.numel()
            scaler.scale(loss if with_items else loss / len(window)).backward()
        if with_items:
            for p in model.parameters():
                p.grad /= items
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    ref = reference[algorithm]
    assert params_rel_err(ref["params"], list(model.parameters())) <= 1e-6
    assert ref["loss_scale"] == scaler.get_scale()
    assert ref["grad_norm"] == pytest.approx(norm.item(), rel=1e-5)


@pytest.mark.parametrize("world", [2, 3])
def test_hand_computed_gradient_across_ranks(runs, world):
    """Each window's gradient norm and parameters against float64 by hand, normalised over
    every rank's micro-batches (plain windows) or items (num_items windows)."""
    for rank, errors in enumerate(runs[world]["hand_computed"]):
        for stage, per_window in errors.items():
            for window, (norm_err, param_err) in enumerate(per_window):
                assert norm_err <= 1e-5 and param_err <= 1e-6, (rank, stage, window)


@pytest.mark.parametrize("world", [2, 3])
def test_optimizer_state_is_split_evenly(runs, reference, world):
    """Each rank holds 1/W of the optimizer state, give or take the padding of each bucket
    to a multiple of W x ALIGN elements (3 buckets here). (Where offload keeps the state can
    only be told on a GPU machine: test_offload_from_a_gpu_equals_the_gpu_run.)"""
    for mode, (algorithm, _) in MODES.items():
        total = reference[algorithm]["state_numel"]
        keys = 2 if algorithm == "adamw" else 1
        counts = [r[mode]["state_numel"] for r in runs[world]["equivalence"]]
        assert len(set(counts)) == 1, (mode, counts)
        assert abs(counts[0] - total / world) <= 3 * ALIGN * keys, (mode, counts[0], total)
        print(f"W={world} {mode}: {counts[0]} state elements per rank, {total} in one process")


def test_no_host_reads_in_the_step_loop(runs):
    for reads in runs[2]["no_host_read"]:
        assert reads == {"stage1": [], "stage2": []}


def test_stage_2_reduces_buckets_while_backward_runs(runs):
    """Gradients of the last layer arrive first: its bucket is reduce-scattered while the
    earlier layers' gradients are still being computed."""
    for result in runs[2]["overlap"]:
        assert result["units"] == 4
        # Each bucket (a layer's weight and bias) leaves as soon as its 2 gradients are in.
        assert result["arrived_at_launch"] == [2, 4, 6, 8]


@pytest.mark.parametrize("world", [2, 3])
def test_bytes_per_parameter_match_the_memory_model(runs, world):
    """Adam, bfloat16 parameters and gradients: 4 + 12/W bytes per parameter with stage 1,
    2 + 14/W with stage 2 (docs/memory.md), against what a rank keeps alive."""
    formula = {1: 4 + 12 / world, 2: 2 + 14 / world}
    for rank, result in enumerate(runs[world]["memory"]):
        for stage in (1, 2):
            measured = result[stage]
            print(f"W={world} rank {rank} stage {stage}: {measured:.4f} bytes/param kept "
                  f"(formula {formula[stage]:.4f})")
            # Above the formula by the padding of the 1,050,112 parameters to a multiple of
            # ALIGN x W elements and a few one-element tensors.
            assert formula[stage] <= measured <= formula[stage] * 1.001


def test_checkpoint_saved_at_two_ranks_continues_at_three(runs):
    """Saved mid-window at W=2 (stage 2), loaded at W=3 into stage 1 (full state dict) and
    stage 2 (torch.distributed.checkpoint): the same parameters as the uninterrupted run. A
    parameter straddles shard boundaries that differ between W=2 and W=3, so the sharded load
    reads pieces from inside saved pieces and joins pieces of two of them."""
    saved_starts = piece_starts(runs[2]["checkpoint_save"], "saved")
    loaded_starts = piece_starts(runs[3]["checkpoint_load"], "reloaded")
    assert any(loaded_starts[i] - saved_starts[i] and saved_starts[i] - loaded_starts[i]
               for i in saved_starts), (saved_starts, loaded_starts)
    uninterrupted = runs[2]["checkpoint_save"][0]["uninterrupted"]
    for rank, result in enumerate(runs[3]["checkpoint_load"]):
        for how in ("state_dict", "sharded"):
            err = params_rel_err(result[how]["params"], uninterrupted["params"])
            assert err <= 1e-6, (rank, how)
            assert result[how]["skipped"] == uninterrupted["skipped"] == 1
            assert result[how]["loss_scale"] == uninterrupted["loss_scale"]
    # What load_sharded restored is what was saved, element for element.
    saved = runs[2]["checkpoint_save"][0]["saved"]
    reloaded = runs[3]["checkpoint_load"][0]["reloaded"]
    assert reloaded["window"]["micro_batches"] == saved["window"]["micro_batches"] == 1
    assert reloaded["window"]["num_items"] == saved["window"]["num_items"]
    for index, state in saved["state"].items():
        for key, value in state.items():
            assert torch.equal(reloaded["state"][index][key], value), (index, key)
    for index, grad in saved["window"]["grads"].items():
        assert torch.equal(reloaded["window"]["grads"][index], grad), index


def test_interrupted_save_never_loads_silently_wrong(runs, shared):
    for result in runs[2]["checkpoint_save"]:
        failures = result["failures"]
        assert failures["while_writing"] == "CheckpointException"
        assert failures["before_publish"].endswith(
            "failed on rank 0: OSError: killed before publish")
    # The good checkpoint under the failed overwrite still loaded (the test above) and
    # nothing was published for the new path: loading it is an error that says why.
    assert not os.path.exists(os.path.join(shared, "fresh"))
    for result in runs[3]["checkpoint_load"]:
        assert "not a complete memkern sharded checkpoint" in result["fresh_error"]
    errors = {result["corrupted"]["error"] for result in runs[3]["checkpoint_load"]}
    assert len(errors) == 1 and "is corrupted: bytes" in next(iter(errors)), errors
    assert all(result["corrupted"]["unchanged"] for result in runs[3]["checkpoint_load"])


def test_ranks_that_disagree_on_the_parameters_fail_fast(shared, seed):
    errors = launch(2, ["mismatch"], shared, seed)["mismatch"]
    # A ValueError that names the mismatch, on every rank: not a collective that waits for its
    # 60 s timeout (which would fail with the process group's error instead).
    for rank_errors in errors:
        message = rank_errors["shape"]
        assert "param group 0, parameter 1 is float32 of shape (33, 13) on rank 0 but " \
               "float32 of shape (34, 13) on rank 1" in message
        message = rank_errors["count"]
        assert "param group 0 has 5 parameters on rank 0 but 4 on rank 1" in message
        message = rank_errors["frozen"]
        assert "rank 1 of process_group cannot use its parameters: ValueError: memkern: " \
               "params[2] (shape (33,), torch.float32) does not require grad" in message


def test_a_rank_whose_loss_reaches_no_parameter_fails_every_rank(runs):
    """Every rank raises the same error at the window's step, within the collectives'
    timeout (not the one rank in backward() while the others wait for it), no rank's
    parameters moved, and after zero_grad() the next window trains as if the dropped one had
    never been (bit for bit)."""
    for stage in (1, 2):
        results = [rank_results[stage] for rank_results in runs[2]["gradless"]]
        errors = {result["error"] for result in results}
        assert len(errors) == 1, (stage, errors)
        assert "on some rank a micro-batch's loss reached no parameter" in errors.pop(), stage
        for rank, result in enumerate(results):
            assert result["unchanged"] and result["after"] is None and result["as_without"], \
                (stage, rank, result)
            assert "reached no parameter" in result.get("resumed_error", ""), (stage, rank)


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_sharded_checkpoint_in_one_process(tmp_path, offload):
    """Without torch.distributed: saved mid-window through save_sharded, loaded into a fresh
    optimizer (of another model init), training continues bit for bit; a checkpoint directory
    without its completion marker is refused."""
    model = make_model(0)
    opt = make_optimizer(model, "adamw", offload=offload)
    feed(opt, model, 0, 0, 1, schedule(0, 7) + [(7, 0)])
    opt.save_sharded(tmp_path / "ckpt")
    weights = copy.deepcopy(model.state_dict())
    feed(opt, model, 0, 0, 1, schedule(7, 12)[1:])

    resumed = make_model(1)
    resumed.load_state_dict(weights)
    resumed_opt = make_optimizer(resumed, "adamw", offload=offload)
    resumed_opt.load_sharded(tmp_path / "ckpt")
    assert resumed_opt.micro_batches == 1
    feed(resumed_opt, resumed, 0, 0, 1, schedule(7, 12)[1:])
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    assert resumed_opt.skipped_steps == opt.skipped_steps == 1

    os.remove(tmp_path / "ckpt" / "memkern-complete.json")
    with pytest.raises(FileNotFoundError, match="has no completion marker"):
        resumed_opt.load_sharded(tmp_path / "ckpt")


def test_bad_process_group_is_named(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{launch_ranks.new_store(str(tmp_path))}",
                            rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        with pytest.raises(TypeError, match="process_group must be a torch.distributed."
                                            "ProcessGroup .* got str"):
            mk.optim.ShardedOptimizer(make_model(0).parameters(), lr=1e-3, process_group="world")
    finally:
        dist.destroy_process_group()


GROUP_FREED_AT_DESTROY = """
import sys
from datetime import timedelta
import torch, torch.distributed as dist
import memkern as mk
from clean_exit import check_group_freed
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1,
                        timeout=timedelta(seconds=60))
model, other = torch.nn.Linear(13, 5), torch.nn.Linear(7, 3)
plain = mk.optim.ShardedOptimizer(model.parameters(), "adamw", lr=0.05)
offload = mk.optim.ShardedOptimizer(other.parameters(), "sgd", lr=0.05, zero_stage=2,
                                    offload="cpu")
for m, opt in ((model, plain), (other, offload)):
    opt.backward(m(torch.randn(4, m.in_features)).sum())
    opt.step()
dist.destroy_process_group()
check_group_freed()
try:
    offload._shards.group
except RuntimeError as error:
    print(error)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_destroy_process_group_frees_the_group_while_optimizers_live(tmp_path):
    """A script's optimizers outlive destroy_process_group() (module-level names, reference
    cycles: until the interpreter's end) and hold no reference that keeps the group, and so
    gloo's worker threads, alive: else a worker can end the finished run with SIGABRT at
    exit (docs/reliability.md). Also torch's own references: memkern is imported before
    init_process_group, and the optimizers' construction imports torch._dynamo after it.
    The process then ends through the interpreter's finalization, as a user's script does."""
    run = subprocess.run([sys.executable, "-c", GROUP_FREED_AT_DESTROY,
                          launch_ranks.new_store(str(tmp_path))], cwd=launch_ranks.REPO,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [launch_ranks.REPO, os.path.join(launch_ranks.REPO, "tests")])})
    assert run.returncode == 0, run.stderr[-3000:]
    assert ("memkern.ShardedOptimizer: its process group was destroyed "
            "(torch.distributed.destroy_process_group())") in run.stdout


@pytest.mark.cuda
def test_offload_from_a_gpu_equals_the_gpu_run():
    """offload="cpu" with the model on a GPU (side-stream copies, pinned memory, the CPU
    kernel) against the same training without offload."""
    results = []
    for offload in (None, "cpu"):
        model = make_model(0).cuda()
        opt = make_optimizer(model, "adamw", offload=offload)
        for window, micro in schedule():
            x, y = (t.cuda() for t in batch(0, window, micro, 0, 1))
            opt.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        results.append([p.detach().cpu() for p in model.parameters()])
        if offload:
            assert all(t.device.type == "cpu" and t.dtype == torch.float32
                       for seg in opt._segments for t in seg.state.values())
    assert params_rel_err(results[1], results[0]) <= 1e-6


if __name__ == "__main__":
    launch_ranks.serve(globals())


# --------------------------------------------------------------------------- 8-bit state
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("mode", MODES_8BIT)
def test_8bit_state_equals_the_single_process_run(runs, reference, seed, world, mode):
    """AdamW with state_precision="8bit" under ZeRO-1/2 and offload, with accumulation,
    num_items, clipping and an overflow on one rank: the single-process 8-bit run. The
    quantization blocks do not depend on W; what does is the order the ranks' gradients are
    summed in, which now and then rounds a code the other way (measured: 1e-7 without such a
    flip, 3e-5 with one)."""
    ref = reference["adamw-8bit"]
    for rank, result in enumerate(runs[world]["equivalence_8bit"]):
        got = result["adamw", mode]
        assert got["quantized"] >= 1  # fc1.weight's slice of this rank is 8-bit
        err = params_rel_err(got["params"], ref["params"])
        print(f"W={world} rank {rank} {mode}: {err:.2e} from the single-process 8-bit run")
        assert err <= 1e-4, (rank, mode)
        assert got["skipped"] == ref["skipped"] == 1
        assert got["loss_scale"] == ref["loss_scale"]


def assert_states_equal(actual: dict, expected: dict, what) -> None:
    """Two torch-format per-parameter state dicts, bit for bit (``state_precision`` too)."""
    assert sorted(actual) == sorted(expected), what
    for index, state in expected.items():
        assert sorted(actual[index]) == sorted(state), (what, index)
        for key, value in state.items():
            got = actual[index][key]
            assert got == value if isinstance(value, str) else torch.equal(got, value), (
                what, index, key)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("mode", MODES_8BIT)
def test_8bit_sgd_equals_the_single_process_run_bit_for_bit(runs, reference, world, mode):
    """SGD with an 8-bit momentum buffer under ZeRO-1/2 and offload, with accumulation,
    num_items, dynamic loss scaling with an overflow on the last rank only and a forced last
    window, on feed_exact's gradients (the same float32 gradient at every W): parameters and
    momentum buffers (read back from the codes) equal the single-process run's bit for bit,
    which also shows that the shards cut the buffer on block boundaries."""
    ref = reference["sgd-8bit"]
    for rank, result in enumerate(runs[world]["equivalence_8bit"]):
        got = result["sgd", mode]
        assert got["quantized"] >= 1
        for i, (a, b) in enumerate(zip(got["params"], ref["params"])):
            assert torch.equal(a, b), (rank, mode, i)
        assert_states_equal(got["state"], ref["state"], (rank, mode))
        assert {s["state_precision"] for s in ref["state"].values()} == {"8bit", "32bit"}
        assert got["skipped"] == ref["skipped"] == 1
        assert got["loss_scale"] == ref["loss_scale"]


@pytest.mark.parametrize("algorithm", sorted(EIGHT_BIT))
def test_8bit_checkpoint_saved_at_two_ranks_continues_at_three(runs, algorithm):
    """Saved mid-window at W=2, loaded at W=3 (state dict into stage 1, sharded into stage 2):
    the 8-bit state comes back exactly (requantizing the saved values gives the saved codes),
    and training continues as the uninterrupted run did: bit for bit for SGD on feed_exact's
    gradients, within the rare code flips of another summation order for AdamW."""
    save = runs[2]["checkpoint_save_8bit"][0][algorithm]
    for rank, result in enumerate(runs[3]["checkpoint_load_8bit"]):
        for how in ("state_dict", "sharded"):
            assert_states_equal(result[algorithm, f"reloaded-{how}"], save["saved"], (rank, how))
            got, expected = result[algorithm, how], save["uninterrupted"]
            if algorithm == "sgd":
                assert all(map(torch.equal, got["params"], expected["params"])), (rank, how)
            else:
                err = params_rel_err(got["params"], expected["params"])
                print(f"rank {rank} {how}: {err:.2e} from the uninterrupted run")
                assert err <= 1e-4
            assert got["skipped"] == expected["skipped"] == 1
