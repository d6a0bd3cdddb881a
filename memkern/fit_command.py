"""``memkern fit``: the cheapest memkern configuration that fits a model's training step into a
memory budget, planned on fake tensors (no device needed), device and host memory both.

    memkern fit --hf llama --set hidden_size=2048 --set num_hidden_layers=16 \\
        --batch 4 --seq 2048 --memory-budget 11GiB

The model (a transformers model for `--task`, a causal LM by default, built from its config on
the meta device: no weights are made) is patched with :func:`memkern.patch` and trained with
``memkern plan``'s default optimizer (:data:`memkern.profile.workloads.OPTIMIZERS`'s "sharded":
``ShardedOptimizer``'s AdamW with float32 master weights of the 16-bit parameters, clipping at
1.0, dynamic loss scaling). Its configurations (:data:`CANDIDATES`) add options to that
optimizer; for each, :func:`memkern.fit` chooses each block's recomputation (the least that
fits), and the planner plans it whole, the host memory of offloading included:

1. the optimizer state in 32 bits, or 2. in 8 bits (``state_precision="8bit"``), on the GPU;
3. the optimizer on the host (``offload="cpu"``: masters and state in host memory, stepped
   there during backward), with 32-bit or 8-bit state;
4. the gradients streamed to the host as backward makes them (``gradients="host"``: no
   gradient buffer on the device, the optimizer on the host), with 32-bit or 8-bit state.

A LoRA model (``--lora``) counts gradients, masters and state for its adapters only.

What each costs in time is estimated from its plan: recomputed FLOPs at the GPU's throughput,
the host step at the host's measured rate, copies at the PCIe rate, less what hides behind the
GPU's work (:mod:`memkern.profile.costs`). The cheapest configuration that fits is chosen;
one whose device memory cannot fit (the bytes per parameter it keeps on the device, a lower
bound) or whose least cost is above the best found so far is not planned.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import torch

from memkern.profile.costs import PCIE_BYTES_PER_S, Rates, StepCost, host_step_rate, step_cost
from memkern.profile.fit import (
    DEFAULT_MARGIN,
    FitReport,
    MemoryBudgetError,
    parse_bytes,
    throughput_of,
)
from memkern.profile.targets import TARGETS
from memkern.profile.workloads import DEFAULT_OPTIMIZER, OPTIMIZERS, TASKS

GIB = 1 << 30


@dataclasses.dataclass
class Candidate:
    """One optimizer set-up tried, and what :func:`memkern.fit` made of it."""

    name: str
    options: dict
    """The keyword arguments it adds to the default optimizer."""
    device_bytes: Callable[[torch.nn.Module], int]
    """A lower bound of what it keeps on the device between steps, without planning."""
    report: FitReport | None = None
    cost: StepCost | None = None
    why_not: str = ""
    """Why it was not chosen: what it needs, or why it was not planned."""

    @property
    def fits(self) -> bool:
        return self.report is not None and not self.why_not

    @property
    def offload(self) -> bool:
        return self.options.get("offload") == "cpu" or self.streamed

    @property
    def streamed(self) -> bool:
        return self.options.get("gradients") == "host"

    @property
    def state_precision(self) -> str:
        return self.options.get("state_precision", "32bit")


def _weights(model: torch.nn.Module, trained_only: bool = False) -> int:
    """The bytes of the model's parameters (``trained_only``: of those that require grad, which
    alone have gradients, masters and optimizer state: a LoRA model's adapters)."""
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if p.requires_grad or not trained_only)


def _masters(model: torch.nn.Module) -> int:
    return sum(4 * p.numel() for p in model.parameters()
               if p.requires_grad and p.dtype != torch.float32)


def _trained(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _with_grads(model: torch.nn.Module) -> int:
    return _weights(model) + _weights(model, trained_only=True)


CANDIDATES = (
    ("32-bit optimizer state", {},
     lambda m: _with_grads(m) + _masters(m) + 8 * _trained(m)),
    ("8-bit optimizer state", {"state_precision": "8bit"},
     lambda m: _with_grads(m) + _masters(m)),
    ("the optimizer on the host", {"offload": "cpu"}, _with_grads),
    ("the optimizer on the host, 8-bit state", {"offload": "cpu", "state_precision": "8bit"},
     _with_grads),
    ("gradients streamed to the host", {"gradients": "host"}, _weights),
    ("gradients streamed to the host, 8-bit state",
     {"gradients": "host", "state_precision": "8bit"}, _weights),
)
"""``(name, options, device bytes)``, in the order tried. The device bytes are what each keeps
there whatever the recomputation: the weights and the gradient buffer (of the parameters'
dtype), and on the GPU the float32 masters of 16-bit parameters and 32-bit moments."""


def add_arguments(parser: argparse.ArgumentParser, positive_int) -> None:
    """The ``memkern fit`` flags (``memkern.cli`` passes its whole-number parser, so every
    command reads them the same way)."""
    from memkern.plan_command import DTYPES, add_lora_argument

    parser.add_argument("--hf", metavar="MODEL", required=True,
                        help="a transformers model: a model type (llama, qwen2, gpt2, bert, "
                        "xlm-roberta, vit, ...) or a config.json (or its directory); nothing "
                        "is downloaded")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                        help="a config setting (repeatable), e.g. hidden_size=1024")
    parser.add_argument("--task", choices=sorted(TASKS), default="causal-lm",
                        help="what the model is trained for, which picks its transformers head "
                        "and its labels (default: causal-lm)")
    parser.add_argument("--batch", type=positive_int, required=True, help="sequences per step")
    parser.add_argument("--seq", type=positive_int, required=True,
                        help="sequence length (ignored for image-classification)")
    parser.add_argument("--memory-budget", metavar="BYTES", required=True, type=_budget,
                        help="the device memory the step must fit in, e.g. 11GiB or 2500MiB "
                        "(GB and MB are powers of ten)")
    parser.add_argument("--host-memory-budget", metavar="BYTES", type=_budget,
                        help="the host memory offloading may take (default: not limited; the "
                        "host memory each configuration needs is printed)")
    parser.add_argument("--device", choices=sorted(TARGETS), default="cuda",
                        help="the device to plan for: cuda (Hopper: H100/H200), cuda-sm80 "
                        "(Ampere: A100) or cpu (default: cuda); nothing runs on it")
    add_lora_argument(parser)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                        help="parameter dtype (default: bfloat16; the optimizer keeps float32 "
                        "master weights of 16-bit ones)")
    parser.add_argument("--pcie-gbps", type=float, default=PCIE_BYTES_PER_S / 1e9,
                        help="host <-> GPU copy rate each way, GB/s, that offloading's copies "
                        f"are costed at (default: {PCIE_BYTES_PER_S / 1e9:g}, PCIe 4.0 x16)")
    parser.add_argument("--host-step-rate", type=float, metavar="PARAMS_PER_S",
                        help="parameters per second of the host's AdamW step, 32-bit and 8-bit "
                        "state alike (default: each measured on this machine with its "
                        "threads)")


def size(n: float) -> str:
    """Bytes as GiB from 1 GiB up, else MiB: ``10.52 GiB``, ``734.1 MiB``."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / (1 << 20):.1f} MiB"


def _budget(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("memory budget ")) from None


def _budget_code(n: int) -> str:
    """A budget as ``memkern.fit`` reads it: ``"3GiB"`` when whole, else bytes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n % scale == 0:
            return f'"{n // scale}{unit}"'
    return str(n)


def _model(args: argparse.Namespace) -> tuple[torch.nn.Module, dict]:
    """The patched model of ``args.task`` on the meta device (no weights made) and an example
    batch of that task's inputs and labels (:func:`memkern.profile.workloads.task_batch`)."""
    import memkern
    from memkern.plan_command import DTYPES
    from memkern.profile.workloads import (
        NO_KV_CACHE,
        hf_config,
        model_class,
        task_batch,
        uses_kv_cache,
        with_lora,
    )

    cfg = hf_config(args.hf, args.set)
    limit = getattr(cfg, "max_position_embeddings", None)
    if args.task != "image-classification" and limit is not None and args.seq > limit:
        raise ValueError(f"--seq {args.seq} is longer than the model's max_position_embeddings "
                         f"({limit}); set a larger one with --set max_position_embeddings=N")
    with torch.device("meta"):
        model = model_class(cfg, args.task)(cfg).to(DTYPES[args.dtype]).train()
        if args.lora is not None:
            model = with_lora(model, args.lora)
    model = memkern.patch(model)
    batch = task_batch(cfg, args.task, args.batch, args.seq)
    return model, {**batch, **NO_KV_CACHE} if uses_kv_cache(cfg) else batch


def choose(fit: Callable[..., FitReport], budget: int, model: torch.nn.Module,
           rates: Callable[[], Rates], host_budget: int | None = None,
           margin: float = DEFAULT_MARGIN) -> list[Candidate]:
    """Every candidate of :data:`CANDIDATES`, the chosen one first (the cheapest that fits;
    none fits: the first does not). ``fit(budget, **options)`` runs :func:`memkern.fit` with
    the default optimizer and those options; ``rates()`` the rates to cost them at."""
    weight_bytes = _weights(model, trained_only=True)  # what the host steps and copies
    num_params = _trained(model)
    allowed = budget * (1 - margin)
    tried: list[Candidate] = []
    best: Candidate | None = None
    for name, options, device_bytes in CANDIDATES:
        c = Candidate(name, options, device_bytes)
        tried.append(c)
        if best is not None and best.cost.exposed == 0:
            c.why_not = "not planned: the chosen configuration adds nothing to the step"
            continue
        floor = device_bytes(model)
        if floor > allowed:
            c.why_not = (f"keeps at least {size(floor)} on the device between steps, more "
                         f"than the budget less its {margin:.0%} margin")
            continue
        least = weight_bytes / rates().pcie_bytes_per_s if c.offload else 0.0
        if best is not None and least >= best.cost.exposed:
            c.why_not = (f"not planned: costs at least {least * 1e3:.0f} ms per step (the "
                         "weights' copy up), more than the chosen one")
            continue
        try:
            c.report = fit(budget, **options)
        except MemoryBudgetError as exc:
            c.why_not = (f"needs {size(exc.smallest_budget)} on the device (every block "
                         f"recomputed whole, and the {margin:.0%} margin)")
            continue
        plan = c.report.plan
        if host_budget is not None and plan.host_peak > host_budget:
            c.why_not = (f"needs {size(plan.host_peak)} of host memory, more than "
                         f"--host-memory-budget {size(host_budget)}")
            continue
        c.cost = step_cost(step_flops=plan.flops or 0, extra_flops=c.report.extra_flops,
                           num_params=num_params, offload=c.offload,
                           state_precision=c.state_precision, weight_bytes=weight_bytes,
                           offloaded_activations=plan.host_by_category.get("activations", 0),
                           rates=rates())
        if best is None or c.cost.exposed < best.cost.exposed:
            best = c
    for c in tried:
        if c.fits and c is not best:
            c.why_not = f"fits, but costs {c.cost.describe()}"
    chosen = [best] if best is not None else []
    return chosen + [c for c in tried if c is not best]


def _blocks(report: FitReport) -> str:
    """``model.layers.0-5: full, model.layers.6-15: keep``: runs of blocks at one level."""
    runs: list[list] = []
    for name, level in report.choices.items():
        if runs and runs[-1][2] == level:
            runs[-1][1] = name
        else:
            runs.append([name, name, level])
    parts = []
    for first, last, level in runs:
        tail = last.rsplit(".", 1)[-1]
        parts.append(f"{first}{'-' + tail if last != first else ''}: {level}")
    return ", ".join(parts)


def _rates(args: argparse.Namespace, throughput: Callable[[], float]) -> Callable[[], Rates]:
    """The rates, made when first asked for; the host step's measured on this machine (a
    second each) only when a configuration steps on the host, once per state precision."""
    host: dict[str, float] = {}

    def host_rate(precision: str) -> float:
        if precision not in host:
            host[precision] = args.host_step_rate or host_step_rate(precision)
        return host[precision]

    made: list[Rates] = []

    def rates() -> Rates:
        if not made:
            made.append(Rates(throughput(), host_rate, args.pcie_gbps * 1e9))
        return made[0]

    return rates


def run(args: argparse.Namespace) -> int:
    import memkern

    model, batch = _model(args)
    num_params = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    budget = args.memory_budget
    spec = OPTIMIZERS[DEFAULT_OPTIMIZER]
    adapters = f", {trained / 1e6:.1f}M trained: LoRA" if trained < num_params else ""
    print(f"memkern fit: {type(model).__name__} ({num_params / 1e6:.1f}M parameters{adapters}, "
          f"{args.dtype}), batch {args.batch} x {args.seq}, budget {size(budget)} on "
          f"{TARGETS[args.device].describe()}; planned on fake tensors")
    print(f"optimizer: {spec.code()} and the options below (memkern plan's default too)")
    weights = _weights(model)
    if weights > budget:
        print(f"nothing fits {size(budget)}: the model's {args.dtype} weights alone take "
              f"{size(weights)}, and every configuration keeps them on the device; lower the "
              "model's size, or shard it across GPUs (FSDP2: docs/distributed.md)")
        return 1
    def fit(limit: int, **options) -> FitReport:
        return memkern.fit(model, batch, limit, device=args.device, apply=False,
                           optimizer=spec.with_options(**options))

    rates = _rates(args, lambda: throughput_of(args.device)[0])
    tried = choose(fit, budget, model, rates, args.host_memory_budget)
    best = tried[0]
    if not best.fits:
        print(f"nothing fits {size(budget)}:")
        for c in tried:
            print(f"  {c.name}: {c.why_not}")
        if all(c.why_not.startswith("keeps at least") for c in tried):
            print("  what lives on the device between steps does not fit: shard it across "
                  "GPUs (docs/distributed.md)")
        else:
            print("  lower --batch or --seq, or shard the optimizer across processes (ZeRO)")
        return 1
    r, plan = best.report, best.report.plan
    if best.cost.exposed:
        used = rates()
        how = "measured" if r.measured_throughput else "assumed"
        line = f"rates: GPU {used.flops_per_s / 1e12:.0f} TFLOP/s ({how})"
        if best.offload:
            where = ("given" if args.host_step_rate
                     else f"measured here, {torch.get_num_threads()} threads")
            line += (f"; host step {used.host_params_per_s(best.state_precision) / 1e6:.0f} M "
                     f"parameters/s ({where}); PCIe {used.pcie_bytes_per_s / 1e9:g} GB/s each "
                     "way")
        print(line)
    print(f"fits with: memkern.patch(model), {best.name}")
    host = (f"; host memory {size(plan.host_peak)} ({size(plan.host_pinned)} pinned)"
            if plan.host_peak else "")
    print(f"  planned peak {size(r.planned_peak)} of {size(budget)} (without recomputation "
          f"{size(r.baseline_peak)}){host}")
    print(f"  costs {best.cost.describe()}" if best.cost.exposed else
          "  costs nothing: recomputes nothing beyond memkern's layers' defaults")
    if r.extra_flops:
        print(f"  recomputes {r.extra_flops / 1e9:.1f} GFLOP per step: {_blocks(r)}")
    print("  apply (model: your transformers model; batch: one batch of its inputs and labels):")
    made = spec.with_options(**best.options).code("params")
    if "use_cache" in batch:
        print("    model.config.use_cache = False  # no key/value cache in training (recomputed "
              "layers would append to it)")
    print("    model = memkern.patch(model)")
    print(f"    make_optimizer = lambda params: {made}")
    print(f"    memkern.fit(model, batch, {_budget_code(budget)}, optimizer=make_optimizer, "
          f"device=\"{args.device}\")")
    print("    optimizer = make_optimizer(model.parameters())")
    for c in tried[1:]:
        print(f"  {c.name}: {c.why_not}")
    return 0
