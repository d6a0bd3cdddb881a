"""``ShardedOptimizer(gradients="host")``: each bucket's gradients stream to host memory as
backward makes them, the window sums there, and the step runs on the host
(memkern.optim.streamed_grads).

Oracles: the same optimizer with the gradients in the device buffer and the step on the host
after the verdict (``offload="cpu"``, its overlap switched off: the serial step, which
test_optim_offload and test_optim_distributed tie to the plain optimizer and torch), bit for
bit — parameters, optimizer state (32-bit and 8-bit), gradient norms, loss scale and skipped
steps — over windows of 1 to 8 micro-batches with and without ``num_items``, windows closed by
``step(force=True)``, a loss-scale overflow in the bucket that is final last, a window clipped
by a hair (clip coefficient a few ulps below 1, so the early steps must be redone), AdamW and
SGD, float32 and bfloat16 parameters; and independently float64 ``torch.optim.AdamW``/``SGD``
with ``torch.nn.utils.clip_grad_norm_``. Checkpoints (state_dict and save_sharded, mid-window
and between the window's last backward and its step) resume bit for bit. The device keeps no
gradient buffer: planned on fake tensors, the gradients held at the step are the buckets in
flight only. Across 2 and 3 gloo ranks: bit for bit equal to zero_stage=2 with offload, an inf
on one rank skips the window on every rank, checkpoints resume bit for bit and move to another
world size.
"""
from __future__ import annotations

import gc
import math
import os

import pytest
import torch

import launch_ranks
import memkern as mk
from compare import assert_same_bits, params_rel_err
from memkern import _fake

BUCKET_MB = 1e-3
"""1 KiB buckets: every parameter a bucket (unit) of its own, so buckets are final one by one
during backward and every path runs over >= 3 buckets."""


def make_model(seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Sequential:
    """Layers of odd sizes; the first large enough for 8-bit state (>= 4096 elements)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(67, 65), torch.nn.Tanh(), torch.nn.Linear(65, 33),
                                torch.nn.Tanh(), torch.nn.Linear(33, 5))
    return model.to(dtype)


HYPER = {"adamw": dict(lr=3e-3, eps=1e-3, weight_decay=0.05),
         "sgd": dict(lr=0.05, momentum=0.9, weight_decay=1e-3)}


def make_optimizer(model, mode: str, *, algorithm: str, accumulation: int,
                   max_grad_norm: float | None = None, **options):
    """``mode``: "streamed" (gradients="host") or "serial" (the device buffer, the step on the
    host after the verdict)."""
    placement = dict(gradients="host") if mode == "streamed" else dict(offload="cpu")
    options.setdefault("bucket_size_mb", BUCKET_MB)
    opt = mk.optim.ShardedOptimizer(model.parameters(), algorithm,
                                    accumulation_steps=accumulation, max_grad_norm=max_grad_norm,
                                    loss_scale=mk.LossScaler(init_scale=2.0**12,
                                                             growth_interval=2),
                                    **HYPER[algorithm], **placement, **options)
    if mode == "serial" and opt.world_size == 1:
        opt._overlap = None
    return opt


def batch(seed: int, window: int, micro: int, dtype: torch.dtype, rank: int = 0):
    g = torch.Generator().manual_seed(seed * 1000 + window * 50 + micro * 5 + rank)
    n = 5 + (window + micro + rank) % 7  # micro-batches of their own lengths
    return (torch.randn(n, 67, generator=g).to(dtype),
            (3 * torch.randn(n, 5, generator=g)).to(dtype))


def poison(model):
    """An inf in the first layer's weight gradient of the next backward pass only: that
    bucket is final last, after the others were stepped."""
    weight = model[0].weight

    def hook(grad):
        handle.remove()
        grad = grad.clone()
        grad.view(-1)[-3] = math.inf  # on the last rank's slice across ranks
        return grad

    handle = weight.register_hook(hook)


def micro_batch(opt, model, seed, window, micro, dtype, items, rank=0):
    x, y = batch(seed, window, micro, dtype, rank)
    loss = torch.nn.functional.mse_loss(model(x).float(), y.float(),
                                        reduction="sum" if items else "mean")
    opt.backward(loss, num_items=y.numel() if items else None)


def train(opt, model, seed, dtype, schedule, *, first=0, poisoned=(), rank=0, spy=None) -> list:
    """``schedule``: per window, ``(micro-batches, num_items?)``, from window ``first`` on; a
    window shorter than the accumulation is closed with ``step(force=True)``. ``poisoned``:
    ``(window, rank)`` pairs whose last micro-batch gets an inf. Returns each window's
    gradient norm."""
    norms = []
    for window, (length, items) in list(enumerate(schedule))[first:]:
        for micro in range(length):
            if micro == length - 1 and (window, rank) in poisoned:
                poison(model)
            micro_batch(opt, model, seed, window, micro, dtype, items, rank)
        if spy is not None and length == opt.accumulation_steps:
            spy(opt)
        assert opt.step(force=length < opt.accumulation_steps) is not False
        opt.zero_grad()
        norms.append(opt.grad_norm)
    return norms


def outcome(opt, model) -> dict:
    state = {k: {kk: vv.clone() if isinstance(vv, torch.Tensor) else vv for kk, vv in v.items()}
             for k, v in opt.state_dict()["state"].items()}
    return {"params": [p.detach().clone() for p in model.parameters()], "state": state,
            "loss_scale": opt.loss_scale, "skipped": opt.skipped_steps}


def spied(seen: list):
    """Records, per full window, whether buckets were stepped before the verdict."""
    def spy(opt):
        opt._overlap._wait_jobs()
        seen.append(bool(opt._overlap._speculated))
    return spy


# ------------------------------------------------------------------- one process, oracles
CASES = {  # name -> (algorithm, state precision, dtype, accumulation, schedule, poisoned window,
    #                 gradient dtype); a case named "buckets-of-several" puts several parameters
    #                 in a bucket (a staging buffer each), the others one (its gradient itself)
    "adamw-fp32-A3": ("adamw", "32bit", torch.float32, 3,
                      [(3, False), (3, True), (3, False), (2, True), (3, False), (3, True)], 2,
                      None),
    "adamw-8bit-bf16-A8": ("adamw", "8bit", torch.bfloat16, 8,
                           [(8, True), (1, False), (8, False), (5, True), (8, True)], 3, None),
    "adamw-bf16-fp32grads-A3": ("adamw", "32bit", torch.bfloat16, 3,
                                [(3, True), (3, False), (2, True), (3, False)], 1,
                                torch.float32),
    "sgd-fp32-A1-buckets-of-several": ("sgd", "32bit", torch.float32, 1,
                                       [(1, i % 2 == 1) for i in range(6)], 2, None),
    "sgd-8bit-bf16-A2": ("sgd", "8bit", torch.bfloat16, 2,
                         [(2, True), (2, False), (1, True), (2, False), (2, True)], 1, None),
}


def hair_limit(norms: list[float], schedule, accumulation: int) -> tuple[int, float]:
    """A window and a max_grad_norm that clips it by a hair (coefficient 1 - ~2e-6), the
    windows before it not at all: of the full windows (whose early steps are taken before the
    verdict), the one with the largest norm of the unclipped run, when no earlier window's is
    larger."""
    full = [w for w, n in enumerate(norms) if math.isfinite(n) and schedule[w][0] == accumulation
            and max(x for x in norms[:w + 1] if math.isfinite(x)) == n]
    hair = max(full, key=lambda w: norms[w])
    return hair, (norms[hair] + 1e-6) * (1 - 2e-6)


@pytest.mark.parametrize("case", sorted(CASES))
def test_streamed_gradients_equal_the_serial_host_step_bit_for_bit(case):
    algorithm, precision, dtype, accumulation, schedule, poisoned, grad_dtype = CASES[case]
    seed = int(torch.randint(2**20, ()))
    print(f"seed {seed}")
    options = dict(algorithm=algorithm, accumulation=accumulation, state_precision=precision,
                   grad_dtype=grad_dtype,
                   bucket_size_mb=0.01 if "buckets-of-several" in case else BUCKET_MB)
    # the unclipped serial run: its norms set a limit that clips one window by a hair
    model = make_model(seed, dtype)
    norms = train(make_optimizer(model, "serial", **options), model, seed, dtype, schedule,
                  poisoned={(poisoned, 0)})
    hair, limit = hair_limit(norms, schedule, accumulation)
    results, speculated = {}, []
    for mode in ("streamed", "serial"):
        model = make_model(seed, dtype)
        opt = make_optimizer(model, mode, max_grad_norm=limit, **options)
        got = train(opt, model, seed, dtype, schedule, poisoned={(poisoned, 0)},
                    spy=spied(speculated) if mode == "streamed" else None)
        results[mode] = dict(outcome(opt, model), norms=got)
        if mode == "streamed":
            assert opt.grad_buffer.buckets[0].grads is None  # no gradient buffer
            assert all(p.grad is None for p in model.parameters())
    assert_same_bits(results["streamed"], results["serial"], case)
    norms = results["serial"]["norms"]
    assert results["serial"]["skipped"] == 1 and not math.isfinite(norms[poisoned])
    assert limit < norms[hair] < limit * (1 + 1e-5), "the hair window was not clipped by a hair"
    assert any(speculated), "no bucket was stepped before a window's verdict"


def test_streamed_gradients_follow_float64_torch_with_clipping():
    """Independent oracle: float64 copies of the model stepped by torch.optim.AdamW and SGD on
    the same micro-batches, the window's gradient the mean of the micro-batch gradients (or
    the token mean with num_items), clipped by torch.nn.utils.clip_grad_norm_; a window with an
    inf is skipped (no step, scale halved)."""
    schedule = [(3, False), (3, True), (3, False), (3, True), (3, False)]
    poisoned, limit = 2, 0.5
    for algorithm in ("adamw", "sgd"):
        seed = int(torch.randint(2**20, ()))
        model = make_model(seed)
        ref = make_model(seed).double()
        opt = make_optimizer(model, "streamed", algorithm=algorithm, accumulation=3,
                             max_grad_norm=limit)
        norms = train(opt, model, seed, torch.float32, schedule, poisoned={(poisoned, 0)})
        hyper = HYPER[algorithm]
        ref_opt = (torch.optim.AdamW(ref.parameters(), **hyper) if algorithm == "adamw" else
                   torch.optim.SGD(ref.parameters(), **hyper))
        ref_norms = []
        for window, (length, items) in enumerate(schedule):
            total = 0
            for micro in range(length):
                x, y = batch(seed, window, micro, torch.float32)
                loss = torch.nn.functional.mse_loss(ref(x.double()), y.double(), reduction="sum"
                                                    if items else "mean")
                loss.backward()
                total += y.numel() if items else 1
            for p in ref.parameters():
                p.grad /= total
            if window == poisoned:
                ref_norms.append(math.inf)
            else:
                ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), limit).item())
                ref_opt.step()
            ref_opt.zero_grad()
        assert max(n for n in ref_norms if math.isfinite(n)) > limit, "clipping never bit"
        assert opt.skipped_steps == 1 and not math.isfinite(norms[poisoned])
        for got, want in zip(norms, ref_norms):
            assert got == want or abs(got - want) <= 1e-5 * want, (algorithm, norms, ref_norms)
        assert params_rel_err(model, ref) <= 1e-5, algorithm


@pytest.mark.parametrize("where", ["mid-window", "after the last backward"])
@pytest.mark.parametrize("how", ["state_dict", "save_sharded"])
def test_checkpoint_resumes_bit_for_bit(tmp_path, where, how):
    """Saved with a window open (after its first micro-batch, or after its last backward, when
    early steps were taken and must be undone first), loaded into a fresh streamed optimizer
    and into a plain one with the device buffer (format 2 is the same for every mode; without
    clipping the norm's summation order does not matter): both continue bit for bit as the
    uninterrupted run."""
    seed, dtype = int(torch.randint(2**20, ())), torch.bfloat16
    schedule = [(3, True)] * 4
    options = dict(algorithm="adamw", accumulation=3, state_precision="8bit")
    model = make_model(seed, dtype)
    opt = make_optimizer(model, "streamed", **options)
    train(opt, model, seed, dtype, schedule)
    uninterrupted = outcome(opt, model)

    model = make_model(seed, dtype)
    opt = make_optimizer(model, "streamed", **options)
    train(opt, model, seed, dtype, schedule[:2])
    done = 1 if where == "mid-window" else 3
    for micro in range(done):
        micro_batch(opt, model, seed, 2, micro, dtype, True)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    path = os.path.join(tmp_path, "ckpt")
    if how == "state_dict":
        torch.save(opt.state_dict(), path)
    else:
        opt.save_sharded(path)
    for mode in ("streamed", "device"):
        model = make_model(seed + 1, dtype)
        model.load_state_dict(weights)
        opt = (make_optimizer(model, "streamed", **options) if mode == "streamed" else
               mk.optim.ShardedOptimizer(model.parameters(), "adamw", accumulation_steps=3,
                                         state_precision="8bit", loss_scale=mk.LossScaler(
                                             init_scale=2.0**12, growth_interval=2),
                                         **HYPER["adamw"]))
        if how == "state_dict":
            opt.load_state_dict(torch.load(path, weights_only=False))
        else:
            opt.load_sharded(path)
        for micro in range(done, 3):
            micro_batch(opt, model, seed, 2, micro, dtype, True)
        assert opt.step()
        opt.zero_grad()
        train(opt, model, seed, dtype, schedule, first=3)
        assert_same_bits(outcome(opt, model), uninterrupted, f"{how} {where} into {mode}")


def test_the_device_holds_no_gradient_buffer_when_planned():
    """Planned on fake tensors (memkern.profile.plan, which tells the host tensors apart through
    memkern._host): with gradients="host" the gradients the device holds at the
    step are the buckets in flight, a fraction of the device buffer's bytes; the parameters
    are the same; the optimizer's construction does not hold the weights twice."""
    from memkern.profile.plan import TrainingSetup, plan_training_step

    def build(gradients):
        def setup():
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
            opt = mk.optim.ShardedOptimizer(model.parameters(), lr=1e-3, gradients=gradients,
                                            offload="cpu", bucket_size_mb=0.3)
            x = torch.randn(4, 256)

            def step():
                opt.backward(model(x).square().mean())
                opt.step()
                opt.zero_grad()
            return TrainingSetup(model, opt, step, gradients)
        return setup

    # planned for a GPU: on a CPU target host memory is the device's (memkern.profile.plan)
    plans = {g: plan_training_step(build(g), device="cuda") for g in ("device", "host")}
    grad_bytes = 8 * 256 * 257 * 4
    assert plans["device"].held["gradients"] >= grad_bytes
    assert plans["host"].held["parameters"] == plans["device"].held["parameters"]
    # the buckets in flight (0.3 MiB each, two copies at a time) instead of the whole buffer
    assert plans["host"].peak.allocated < plans["device"].peak.allocated - grad_bytes / 2
    # and the set-up never held the weights twice (flattened through host memory): the run's
    # highest moment is the step's, where the device-buffer run's is the set-up's
    assert plans["host"].run_peak <= plans["host"].peak.allocated
    assert plans["device"].run_peak >= 2 * plans["device"].held["parameters"]


@pytest.mark.parametrize("precision", ["32bit", "8bit"])
def test_bytes_per_parameter(monkeypatch, precision):
    """Measured from the storages after two windows (bf16 AdamW, one process, 1 KiB buckets):
    the device holds the weights only (2 B/param: no gradient buffer); host memory the
    window's sums (2), the float32 masters (4), the moments (8, or 2 + 4/256 in 8 bits), the
    copies of the weights the early steps write (2) and the copies of the state those steps
    keep (as much as master + moments + step counters), plus two pinned staging slots. Every
    count is the parameters' own elements rounded up to 256-element slots (the flat layout's
    alignment). docs/memory.md quotes these figures (``pytest -s -k bytes_per_parameter``).

    The host threads' jobs run on the caller's thread, so every segment steps early (with its
    state copy): with real threads, how many do is a race with step(), decided by the load."""
    monkeypatch.setattr(_fake, "thread_pool",
                        lambda like, workers, **kwargs: _fake._OnTheCallersThread())
    model = make_model(0, torch.bfloat16)
    opt = make_optimizer(model, "streamed", algorithm="adamw", accumulation=2,
                         state_precision=precision)
    train(opt, model, 0, torch.bfloat16, [(2, True), (2, False)])
    n = sum(p.numel() for p in model.parameters())
    slots = sum(-(-p.numel() // 256) * 256 for p in model.parameters())  # aligned elements

    def nbytes(tensors) -> int:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in tensors}
        return sum(storages.values())

    device = nbytes(model.parameters())
    segments = opt.segments
    state = [t for seg in segments for t in seg.stored_tensors().values()]
    host = {"window sums": nbytes(seg.grads for seg in segments),
            "weight copies": nbytes(seg.weights for seg in segments),
            "masters and moments": nbytes(state),
            "copies for the early steps": nbytes(t for backup in opt._overlap._backups
                                                 if backup is not None for t in backup.values())}
    print(f"\n{precision}, bytes per element of the flat layout ({n} parameters padded to "
          f"{slots} by the 256-element alignment): "
          f"device {device / slots:.3f}; host:" + "".join(f" {k} {v / slots:.3f};"
                                                       for k, v in host.items()))
    assert device == 2 * slots
    assert host["window sums"] == host["weight copies"] == 2 * slots
    steps = 4 * len(segments)  # one float32 step counter per segment
    if precision == "32bit":
        assert host["masters and moments"] == 12 * slots
    else:  # the first weight's moments in 8 bits (1 + 1 + 8/256 over its slot), the others'
        big = -(-model[0].weight.numel() // 256) * 256  # in float32
        assert host["masters and moments"] == 12 * slots - 8 * big + 2 * big + 8 * big // 256
    assert host["copies for the early steps"] == host["masters and moments"] + steps


@pytest.mark.cuda
def test_from_a_gpu_equals_the_serial_host_step_and_holds_no_gradient_buffer():
    """From a GPU (pinned slots, the download and upload streams, events): bit for bit the
    serial host step of the same model on the GPU, over accumulation windows with an overflow
    and clipping. And the device's peak over a window of eight bf16 512 x 512 layers (0.25 MiB
    buckets) is the device-buffer run's less at least half the gradients' bytes: the buckets
    in flight instead of the buffer."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    schedule = [(2, True), (2, False), (2, True), (1, False), (2, True)]
    results = {}
    for mode in ("streamed", "serial"):
        model = make_model(3, torch.bfloat16).cuda()
        opt = make_optimizer(model, mode, algorithm="adamw", accumulation=2, max_grad_norm=1.0)
        for window, (length, items) in enumerate(schedule):
            for micro in range(length):
                if window == 2 and micro == length - 1:
                    poison(model)
                x, y = (t.cuda() for t in batch(4, window, micro, torch.bfloat16))
                loss = torch.nn.functional.mse_loss(model(x).float(), y.float(),
                                                    reduction="sum" if items else "mean")
                opt.backward(loss, num_items=y.numel() if items else None)
            opt.step(force=length < 2)
            opt.zero_grad()
        results[mode] = outcome(opt, model)
        results[mode]["params"] = [p.cpu() for p in results[mode]["params"]]
    assert_same_bits(results["streamed"], results["serial"], "from a GPU")
    assert results["streamed"]["skipped"] == 1

    peaks = {}
    for gradients in ("host", "device"):
        gc.collect()
        before = torch.cuda.memory_allocated()
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
        model = model.to(torch.bfloat16).cuda()
        opt = mk.optim.ShardedOptimizer(model.parameters(), lr=1e-3, offload="cpu",
                                        gradients=gradients, bucket_size_mb=0.25,
                                        accumulation_steps=2)
        x = torch.randn(16, 512, dtype=torch.bfloat16, device="cuda")
        for _ in range(2):  # the state made, the pinned memory taken
            for _ in range(2):
                opt.backward(model(x).float().square().mean())
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(2):
            opt.backward(model(x).float().square().mean())
        opt.step()
        torch.cuda.synchronize()
        peaks[gradients] = torch.cuda.max_memory_allocated() - before  # weights included
        del model, opt
    grad_bytes = 8 * 512 * 513 * 2
    assert peaks["host"] <= peaks["device"] - grad_bytes / 2, peaks


def test_bad_arguments_are_named():
    model = make_model(0)
    with pytest.raises(ValueError, match="gradients must be one of"):
        mk.optim.ShardedOptimizer(model.parameters(), lr=1e-3, gradients="cpu")


# --------------------------------------------------------------------------- across ranks
WORLD_SCHEDULE = [(2, True), (2, False), (1, True), (2, False), (2, True)]
WORLD_OPTIONS = dict(algorithm="adamw", accumulation=2, max_grad_norm=0.8, zero_stage=2)


def scenario_ranks(rank, world, seed, shared):
    """Streamed against zero_stage=2 with the host step, bit for bit, with an inf on the last
    rank only in window 2 (a window closed by force); a state dict and a sharded checkpoint
    saved mid-window (W=2's for W=3 to load), each resumed in a fresh optimizer."""
    poisoned = {(2, world - 1)}
    results = {}
    for mode in ("streamed", "serial"):
        model = make_model(seed)
        opt = make_optimizer(model, mode, **WORLD_OPTIONS)
        norms = train(opt, model, seed, torch.float32, WORLD_SCHEDULE, poisoned=poisoned,
                      rank=rank)
        results[mode] = dict(outcome(opt, model), norms=norms)
    # resumed mid-window at the same world size
    model = make_model(seed)
    opt = make_optimizer(model, "streamed", **WORLD_OPTIONS)
    train(opt, model, seed, torch.float32, WORLD_SCHEDULE[:3], poisoned=poisoned, rank=rank)
    micro_batch(opt, model, seed, 3, 0, torch.float32, False, rank)  # window 3 opens
    full = opt.state_dict()
    path = os.path.join(shared, f"streamed-W{world}")
    opt.save_sharded(path)
    if world == 2:
        torch.save(full, os.path.join(shared, "streamed-W2.pt"))
    weights = [p.detach().clone() for p in model.parameters()]
    for how in ("state_dict", "save_sharded"):
        model = make_model(seed + 1)
        with torch.no_grad():
            for p, w in zip(model.parameters(), weights):
                p.copy_(w)
        opt = make_optimizer(model, "streamed", **WORLD_OPTIONS)
        if how == "state_dict":
            opt.load_state_dict(full)
        else:
            opt.load_sharded(path)
        micro_batch(opt, model, seed, 3, 1, torch.float32, False, rank)
        assert opt.step()
        opt.zero_grad()
        train(opt, model, seed, torch.float32, WORLD_SCHEDULE, first=4, rank=rank)
        results[how] = outcome(opt, model)
    if world == 3:  # W=2's checkpoints at W=3: the state as saved
        for how in ("state_dict", "save_sharded"):
            saved = torch.load(os.path.join(shared, "streamed-W2.pt"), weights_only=False)
            opt = make_optimizer(make_model(seed + 2), "streamed", **WORLD_OPTIONS)
            if how == "state_dict":
                opt.load_state_dict(saved)
            else:
                opt.load_sharded(os.path.join(shared, "streamed-W2"))
            results[f"W2 {how}"] = (opt.state_dict(), saved)
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    shared = str(tmp_path_factory.mktemp("streamed"))
    seed = launch_ranks.fresh_seed()
    return {world: launch_ranks.launch(__file__, world, ["ranks"], shared, seed)["ranks"]
            for world in (2, 3)}


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_equal_zero2_with_the_host_step_and_skip_together(ranks, world):
    uninterrupted = None
    for rank, result in enumerate(ranks[world]):
        streamed, serial = result["streamed"], result["serial"]
        assert_same_bits(streamed, serial, f"rank {rank}: streamed vs zero_stage=2 offload")
        assert streamed["skipped"] == 1 and not math.isfinite(streamed["norms"][2])
        streamed = {k: v for k, v in streamed.items() if k != "norms"}
        if uninterrupted is None:
            uninterrupted = streamed
        # every rank holds the same parameters and the same (gathered) state
        assert_same_bits(streamed["params"], uninterrupted["params"], f"rank {rank} params")
        assert_same_bits(streamed["state"], uninterrupted["state"], f"rank {rank} state")
        for how in ("state_dict", "save_sharded"):
            assert_same_bits(result[how], streamed, f"rank {rank}: resumed from {how}")


def test_a_two_rank_checkpoint_loads_at_three_ranks(ranks):
    for rank, result in enumerate(ranks[3]):
        for how in ("state_dict", "save_sharded"):
            loaded, saved = result[f"W2 {how}"]
            assert_same_bits(loaded["state"], saved["state"], f"rank {rank} {how}: state")
            window = loaded["memkern"]["window"]
            assert window["micro_batches"] == 1
            assert_same_bits(window["grads"], saved["memkern"]["window"]["grads"],
                             f"rank {rank} {how}: the open window's gradient")


def test_zero_stage_1_across_ranks_is_refused(monkeypatch):
    """zero_stage=1 reduces at the window's end, which needs the gradient on the device."""
    import memkern.optim.sharded as sharded

    monkeypatch.setattr(sharded, "_group_and_rank", lambda group: (None, 0, 2))
    with pytest.raises(ValueError, match="pass zero_stage=2"):
        mk.optim.ShardedOptimizer(make_model(0).parameters(), lr=1e-3, gradients="host")


if __name__ == "__main__":
    launch_ranks.serve(globals())
