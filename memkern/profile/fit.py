"""``memkern.fit``: choose what each transformer block recomputes so that a training step fits
a memory budget, in eager mode, and apply it.

The model's repeated blocks (the layers of its largest ``nn.ModuleList`` of one class) each get
one of these **levels**, from least to most recomputation:

=================  ===============================================================================
keep               the block as it is (memkern's layers save what their ``recompute`` says)
mlp-full           its memkern MLPs recompute their first GEMM(s) too (``recompute="full"``): only
                   present where the block has one (``memkern.patch``, ``mk.nn.MLP``/``SwiGLU``)
selective          ``memkern.checkpoint(block, "selective")``: GEMM and attention outputs kept,
                   the elementwise and normalisation ops between them recomputed
full               ``memkern.checkpoint(block, "full")``: the block's input kept, its whole
                   forward recomputed in backward
full-host          ``memkern.checkpoint(block, "full-host")``: as "full", with the block's input
                   kept in host memory and brought back one block ahead of its backward (the
                   plan counts the host memory; the copies cost time only where they do not
                   hide behind the GPU's work: :mod:`memkern.profile.costs`)
=================  ===============================================================================

The search: the step with every block at "keep" is planned first (:func:`plan_training_step`,
on fake tensors: nothing runs on the device); when it fits, nothing is recomputed and nothing
else is planned. Otherwise each level is planned with every block at it; a level that needs
more memory than a cheaper one is dropped, and so is one the step fails under (reported in
:attr:`FitReport.skipped`). The remaining levels make a path from no recomputation to the
most: "the first *k*
blocks at the next level, the others at this one", *k* = 0 .. number of blocks, level by level
(the first blocks first: their saved tensors live longest). The planned peak falls along the
path and the recomputation grows, so the first configuration whose planned peak is within the
budget (found by bisection) recomputes least — and a larger budget never chooses more.

The cost of a configuration is the floating-point operations it adds to the step (counted by
``torch.utils.flop_counter`` on the fake step: the recomputed GEMMs and attention), and its
time that count at the device's throughput: measured once on the device when one is present,
else a conservative figure for the target (:data:`DEFAULT_THROUGHPUT`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from memkern.nn import input_offload
from memkern.nn.checkpoint import checkpoint, policy_of
from memkern.profile.blocks import repeated_blocks
from memkern.profile.plan import StepPlan, TrainingSetup, plan_training_step

LEVELS = ("keep", "mlp-full", "selective", "full", input_offload.POLICY)
DEFAULT_THROUGHPUT = {"cuda": 400e12, "cuda-sm80": 200e12}
"""FLOP/s assumed for recomputation when no device is at hand to measure: about 40% and 65% of
H100 / A100 dense bf16 peaks, what GEMMs of transformer-layer sizes reach in practice."""
DEFAULT_MARGIN = 0.03
"""The fit keeps the planned peak this fraction under the budget: the planner's error on
measured steps (docs/planning.md) is within it."""
_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


class MemoryBudgetError(ValueError):
    """No configuration fits the budget; ``smallest_budget`` is the smallest that one does."""

    def __init__(self, message: str, smallest_budget: int) -> None:
        super().__init__(message)
        self.smallest_budget = smallest_budget


@dataclasses.dataclass
class FitReport:
    """What :func:`fit` chose, and what it costs."""

    budget: int
    device: str
    choices: dict[str, str]
    """Each block's level, by the block's name."""
    planned_peak: int
    """The chosen configuration's planned peak (bytes)."""
    baseline_peak: int
    """The planned peak with every block at "keep"."""
    extra_flops: int
    """Floating-point operations the chosen recomputation adds to a step."""
    throughput: float
    """FLOP/s the extra time is estimated at."""
    measured_throughput: bool
    plans: int
    """Steps planned to find the configuration."""
    seconds: float
    plan: StepPlan
    """The chosen configuration's plan (its peak taken apart)."""
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    """Levels left out because the step failed under them, with the error."""

    @property
    def extra_seconds(self) -> float:
        """Estimated extra time per step: the recomputed FLOPs at :attr:`throughput`."""
        return self.extra_flops / self.throughput

    def __str__(self) -> str:
        counts = {level: sum(1 for v in self.choices.values() if v == level) for level in LEVELS}
        how = "measured" if self.measured_throughput else "assumed"
        lines = [f"memkern.fit: budget {self.budget / 2**20:.1f} MiB on {self.device}: planned "
                 f"peak {self.planned_peak / 2**20:.1f} MiB (without recomputation "
                 f"{self.baseline_peak / 2**20:.1f} MiB)",
                 "  blocks: " + ", ".join(f"{n} {lvl}" for lvl, n in counts.items() if n),
                 f"  recomputation: {self.extra_flops / 1e9:.1f} GFLOP per step, about "
                 f"{self.extra_seconds * 1e3:.2f} ms at {self.throughput / 1e12:.0f} TFLOP/s "
                 f"({how}); {self.plans} steps planned in {self.seconds:.1f} s"]
        lines += [f"  level {lvl} left out: {why}" for lvl, why in self.skipped.items()]
        lines += [f"  {name}: {level}" for name, level in self.choices.items()]
        return "\n".join(lines)


def parse_bytes(budget: int | float | str) -> int:
    """``20 << 30``, ``"20GiB"``, ``"2500 MiB"``, ``"1.5e9"`` -> bytes."""
    if isinstance(budget, (int, float)):
        value = int(budget)
    else:
        m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(budget))
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"memory budget {budget!r}: expected bytes, or a number with a unit "
                             "(KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. '20GiB'")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"memory budget {budget!r} must be positive")
    return value


def _mlps(block: nn.Module) -> list[nn.Module]:
    """The memkern MLPs of a block whose ``recompute`` can be set."""
    found = []
    for m in block.modules():
        if isinstance(getattr(m, "_memkern_mlp", None), dict) or (
                type(m).__module__ in ("memkern.nn.mlp", "memkern.nn.swiglu")
                and hasattr(m, "recompute")):
            found.append(m)
    return found


def _get_recompute(m: nn.Module) -> str:
    cfg = getattr(m, "_memkern_mlp", None)
    return cfg["recompute"] if isinstance(cfg, dict) else m.recompute


def _set_recompute(m: nn.Module, value: str) -> None:
    cfg = getattr(m, "_memkern_mlp", None)
    if isinstance(cfg, dict):
        cfg["recompute"] = value
    else:
        m.recompute = value


class _Blocks:
    """Applies levels to the blocks, remembering how each block was at the start."""

    def __init__(self, blocks: Sequence[tuple[str, nn.Module]]) -> None:
        self.blocks = list(blocks)
        self.initial = [(policy_of(b), [(m, _get_recompute(m)) for m in _mlps(b)])
                        for _, b in self.blocks]

    def levels(self) -> list[str]:
        has_mlp = any(mlps for _, mlps in self.initial)
        return [lvl for lvl in LEVELS if lvl != "mlp-full" or has_mlp]

    def apply(self, levels: Sequence[str]) -> None:
        for (_, block), (policy, mlps), level in zip(self.blocks, self.initial, levels):
            for m, recompute in mlps:
                _set_recompute(m, "full" if level == "mlp-full" else recompute)
            checkpoint(block, level if level in LEVELS[2:] else policy)

    def restore(self) -> None:
        self.apply(["keep"] * len(self.blocks))


@contextlib.contextmanager
def _stand_in(model: nn.Module) -> Iterator[None]:
    """Inside the planner's build: the model's parameters and buffers replaced by fake CPU
    tensors of their shapes and dtypes (tied parameters stay tied); restored on exit. The
    module tables are swapped (not ``torch.func.functional_call``) because the step's
    optimizer must hold the stand-ins as the model's parameters, ``.grad`` and all."""
    swapped: list[tuple[dict, str, Any]] = []
    fakes: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor, param: bool) -> torch.Tensor:
        if id(t) not in fakes:
            new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
            fakes[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if param else new
        return fakes[id(t)]

    try:
        for module in model.modules():
            for table, param in ((module._parameters, True), (module._buffers, False)):
                for name, t in table.items():
                    if t is not None:
                        swapped.append((table, name, t))
                        table[name] = fake(t, param)
        yield
    finally:
        for table, name, t in reversed(swapped):
            table[name] = t


def _default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    if isinstance(batch, dict):
        return model(**batch).loss
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _measured_throughput(device: str) -> float | None:
    """FLOP/s of a GEMM on the target when it is this machine: a bf16 4096^3 GEMM on the GPU,
    a float32 1024^3 one on the CPU; None when the target GPU is not here."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        return None
    on_gpu = device.startswith("cuda")
    n, dtype = (4096, torch.bfloat16) if on_gpu else (1024, torch.float32)
    a = torch.randn(n, n, device="cuda" if on_gpu else "cpu", dtype=dtype)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    for _ in range(2):
        a @ a
    sync()
    start, reps = time.perf_counter(), 10
    for _ in range(reps):
        a @ a
    sync()
    return 2 * n**3 * reps / (time.perf_counter() - start)


def throughput_of(device: str) -> tuple[float, bool]:
    """FLOP/s to cost recomputation at on ``device``, and whether they were measured: on the
    target when it is this machine (its GPU, or the CPU), else :data:`DEFAULT_THROUGHPUT`."""
    measured = _measured_throughput(device)
    return measured or DEFAULT_THROUGHPUT.get(device, 400e12), measured is not None


def fit(model: nn.Module, example_batch: Any, budget: int | float | str, *,
        loss: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        optimizer: Callable[[Any], Any] | None = None, device: str = "cuda",
        blocks: Sequence[nn.Module] | None = None, throughput: float | None = None,
        margin: float = DEFAULT_MARGIN, apply: bool = True) -> FitReport:
    """Choose, per block, the least recomputation that fits a training step of ``model`` on
    ``example_batch`` into ``budget`` bytes of ``device`` memory, and apply it (see the
    module docstring).

    ``budget``: bytes or a string with a unit ("20GiB"). ``loss(model, batch)``: the step's loss
    (default: ``model(**batch).loss`` for a dict, ``model(*batch)`` for a tuple, else
    ``model(batch)``). ``optimizer(params)``: the optimizer the step uses (default: torch's
    AdamW, fused; foreach on the CPU), given the parameters that require grad; a
    :class:`memkern.optim.ShardedOptimizer` is driven through its
    ``backward``/``step``/``zero_grad``. ``device``: the planning target ("cuda", "cuda-sm80",
    "cpu"). ``blocks``: the modules to choose for (default: :func:`repeated_blocks`).
    ``throughput``: FLOP/s to cost recomputation at (default: measured on the target when it is
    this machine — its GPU, or the CPU — else :data:`DEFAULT_THROUGHPUT`). ``margin``: kept under
    the budget. ``apply=False``: only report. Raises :class:`MemoryBudgetError` naming the smallest
    budget that fits when none of the configurations does.
    """
    limit = parse_bytes(budget)
    if not 0 <= margin < 1:
        raise ValueError(f"memkern.fit: margin={margin} must be in [0, 1)")
    start = time.perf_counter()
    named = ([(n, m) for n, m in model.named_modules() if any(m is b for b in blocks)]
             if blocks is not None else repeated_blocks(model))
    state = _Blocks(named)
    loss = loss or _default_loss
    plans: dict[tuple[str, ...], StepPlan] = {}

    def make_optimizer(params):
        if optimizer is not None:
            return optimizer(params)
        if device == "cpu":
            return torch.optim.AdamW(params, lr=1e-4, foreach=True)
        return torch.optim.AdamW(params, lr=1e-4, fused=True)

    def planned(levels: tuple[str, ...]) -> StepPlan:
        if levels not in plans:
            state.apply(levels)

            def build() -> TrainingSetup:
                stand_in.__enter__()
                opt = make_optimizer([p for p in model.parameters() if p.requires_grad])
                batch = tree_map(lambda t: torch.empty_strided(t.shape, t.stride(),
                                                               dtype=t.dtype)
                                 if isinstance(t, torch.Tensor) else t, example_batch)

                def step() -> None:
                    value = loss(model, batch)
                    if hasattr(opt, "backward"):  # memkern's ShardedOptimizer
                        opt.backward(value)
                        opt.step()
                        opt.zero_grad()
                    else:
                        value.backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)

                return TrainingSetup(model, opt, step, f"{type(model).__name__} {levels}")

            stand_in = _stand_in(model)
            try:
                plans[levels] = plan_training_step(build, device=device, count_flops=True)
            finally:
                stand_in.__exit__(None, None, None)
        return plans[levels]

    n = len(named)
    skipped: dict[str, str] = {}
    allowed = limit * (1 - margin)
    try:
        uniform = {"keep": planned(("keep",) * n)}
        # a step that fits as it is recomputes nothing: no other level is planned
        for lvl in state.levels()[1:] if uniform["keep"].peak_bytes > allowed else ():
            try:
                uniform[lvl] = planned((lvl,) * n)
            except RuntimeError as exc:  # a policy this model's blocks do not run under
                skipped[lvl] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                if getattr(getattr(model, "config", None), "use_cache", False):
                    skipped[lvl] += ("; the model keeps a key/value cache, which recomputed "
                                     "layers append to: set model.config.use_cache = False")
        # a level needing more memory than a cheaper one is never worth its recomputation
        levels = list(uniform)
        path_levels = [levels[0]]
        for lvl in levels[1:]:
            if uniform[lvl].peak_bytes < uniform[path_levels[-1]].peak_bytes:
                path_levels.append(lvl)
        path = [(path_levels[0],) * n] + [(upper,) * k + (lower,) * (n - k)
                                          for lower, upper in zip(path_levels, path_levels[1:])
                                          for k in range(1, n + 1)]
        if planned(path[-1]).peak_bytes > allowed:
            smallest = plans[path[-1]].peak_bytes / (1 - margin)
            raise MemoryBudgetError(
                f"memkern.fit: nothing fits {limit / 2**20:.1f} MiB on {device}: even with every "
                f"block at {path_levels[-1]!r} the step's planned peak is "
                f"{plans[path[-1]].peak_bytes / 2**20:.1f} MiB; the smallest budget that fits "
                f"is {smallest / 2**20:.1f} MiB (with the {margin:.0%} margin), or lower the "
                "batch, or shard the optimizer state (ZeRO) or keep it in 8 bits",
                int(smallest + 1))
        lo, hi = 0, len(path) - 1  # the first fitting configuration along the path
        while lo < hi:
            mid = (lo + hi) // 2
            if planned(path[mid]).peak_bytes <= allowed:
                hi = mid
            else:
                lo = mid + 1
        chosen = path[lo]
    finally:
        state.restore()
    if apply:
        state.apply(chosen)
    rate, measured = throughput_of(device) if throughput is None else (float(throughput), False)
    base = plans[path[0]]
    return FitReport(limit, device, {name: lvl for (name, _), lvl in zip(named, chosen)},
                     plans[chosen].peak_bytes, base.peak_bytes,
                     max(0, (plans[chosen].flops or 0) - (base.flops or 0)), rate,
                     measured, len(plans), time.perf_counter() - start,
                     plans[chosen], skipped)
