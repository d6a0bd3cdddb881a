"""``memkern fit``: the cheapest memkern configuration that fits a model's training step into a
memory budget, planned on fake tensors (no device needed).

    memkern fit --hf llama --set hidden_size=2048 --set num_hidden_layers=16 \\
        --batch 4 --seq 2048 --memory-budget 11GiB

The model (a transformers model for `--task`, a causal LM by default, built from its config on
the meta device: no weights are made) is patched with :func:`memkern.patch` and trained with
:class:`memkern.optim.ShardedOptimizer` (AdamW, bf16 parameters, float32 master weights). Its
configurations, cheapest first:

1. 32-bit optimizer state, each block's recomputation chosen by :func:`memkern.fit` (the least
   that fits: none when the step fits as it is);
2. 8-bit optimizer state (``state_precision="8bit"``), recomputation chosen likewise: chosen
   over 1. when it recomputes fewer FLOPs (the 8-bit step costs no time on a GPU, 0.54-0.68x
   the 32-bit one's: docs/benchmarks.md, and changes the optimizer's rounding, docs/8bit-state.md);
3. the optimizer offloaded to host memory (``offload="cpu"``): only when neither fits (a step
   waits on the host: 1.92x torch AMP's time in the README's GPU run). The planner does not
   model offloading, so its device peak is an estimate: the 32-bit plan less the master
   weights and the Adam moments, which offload keeps in host memory (12 bytes per parameter).
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import torch

from memkern.profile.fit import FitReport, MemoryBudgetError, parse_bytes
from memkern.profile.targets import TARGETS
from memkern.profile.workloads import TASKS

GIB = 1 << 30
OFFLOADED_BYTES_PER_PARAM = 12
"""What ``ShardedOptimizer(offload="cpu")`` keeps in host memory instead of on the device per
parameter of a 16-bit model: the float32 master weight and Adam's two float32 moments."""


@dataclasses.dataclass
class Candidate:
    """One optimizer set-up tried, and what :func:`memkern.fit` made of it."""

    name: str
    optimizer: str
    """The ShardedOptimizer arguments beyond ``params, "adamw", lr=``, as Python."""
    report: FitReport | None = None
    error: MemoryBudgetError | None = None
    offloaded: int = 0
    """Bytes the device is spared by offloading (0: no offload)."""

    @property
    def peak(self) -> int:
        """The planned device peak (with offload: estimated)."""
        return self.report.planned_peak - self.offloaded

    @property
    def fits(self) -> bool:
        return self.report is not None


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
                        help="the device memory the step must fit in, e.g. 11GiB or 2500MiB")
    parser.add_argument("--device", choices=sorted(TARGETS), default="cuda",
                        help="the device to plan for: cuda (Hopper: H100/H200), cuda-sm80 "
                        "(Ampere: A100) or cpu (default: cuda); nothing runs on it")
    add_lora_argument(parser)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                        help="parameter dtype (default: bfloat16; the optimizer keeps float32 "
                        "master weights of 16-bit ones)")


def size(n: float) -> str:
    """Bytes as GiB from 1 GiB up, else MiB: ``10.52 GiB``, ``734.1 MiB``."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / (1 << 20):.1f} MiB"


def _budget(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("memory budget "))


def _model(args: argparse.Namespace) -> tuple[torch.nn.Module, dict]:
    """The patched model of ``args.task`` on the meta device (no weights made) and an example
    batch of that task's inputs and labels (:func:`memkern.profile.workloads.task_batch`)."""
    import memkern
    from memkern.plan_command import DTYPES
    from memkern.profile.workloads import hf_config, model_class, task_batch, with_lora

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
    return model, task_batch(cfg, args.task, args.batch, args.seq)


def choose(fit: Callable[..., FitReport], budget: int, num_params: int) -> list[Candidate]:
    """The candidates tried, cheapest first (see the module docstring); the chosen one is the
    first that fits, or none does. ``fit(budget, **optimizer_kwargs)`` runs
    :func:`memkern.fit` with a ShardedOptimizer of those arguments."""
    def attempt(c: Candidate, kwargs: dict, extra: int = 0) -> Candidate:
        try:
            c.report = fit(budget + extra, **kwargs)
        except MemoryBudgetError as exc:
            c.error = exc
        return c

    full = attempt(Candidate("32-bit optimizer state", ""), {})
    if full.fits and full.report.extra_flops == 0:
        return [full]
    eight = attempt(Candidate("8-bit optimizer state", ', state_precision="8bit"'),
                    {"state_precision": "8bit"})
    if full.fits or eight.fits:
        ranked = sorted((c for c in (full, eight) if c.fits), key=lambda c: c.report.extra_flops)
        return [ranked[0], *(c for c in (full, eight) if c is not ranked[0])]
    offloaded = OFFLOADED_BYTES_PER_PARAM * num_params
    offload = Candidate("optimizer offloaded to host memory", ', offload="cpu"',
                        offloaded=offloaded)
    return [attempt(offload, {}, offloaded), full, eight]


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


def run(args: argparse.Namespace) -> int:
    import memkern

    model, batch = _model(args)
    num_params = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    budget = args.memory_budget

    def fit(limit: int, **kwargs) -> FitReport:
        return memkern.fit(model, batch, limit, device=args.device, apply=False,
                           optimizer=lambda params: memkern.optim.ShardedOptimizer(
                               params, "adamw", lr=1e-4, loss_scale="dynamic", **kwargs))

    adapters = f", {trained / 1e6:.1f}M trained: LoRA" if trained < num_params else ""
    print(f"memkern fit: {type(model).__name__} ({num_params / 1e6:.1f}M parameters{adapters}, "
          f"{args.dtype}), batch {args.batch} x {args.seq}, budget {size(budget)} on "
          f"{TARGETS[args.device].describe()}; planned on fake tensors")
    tried = choose(fit, budget, trained)
    best = tried[0]
    if not best.fits:
        closest = min(tried, key=lambda c: c.error.smallest_budget - c.offloaded)
        smallest = closest.error.smallest_budget - closest.offloaded
        print(f"nothing fits {size(budget)}: the closest, {closest.name} with every "
              f"block recomputed whole, needs {size(smallest)}: "
              f"{size(smallest - budget)} ({smallest / budget - 1:.0%}) more than the "
              "budget; lower --batch or --seq, or shard the optimizer across processes (ZeRO)")
        return 1
    r = best.report
    estimated = " (estimated: offload is not planned)" if best.offloaded else ""
    print(f"fits with: memkern.patch(model), {best.name}")
    print(f"  planned peak {size(best.peak)}{estimated} of {size(budget)} "
          f"(without recomputation {size(r.baseline_peak - best.offloaded)})")
    if r.extra_flops:
        how = "measured" if r.measured_throughput else "assumed"
        print(f"  recomputes {r.extra_flops / 1e9:.1f} GFLOP per step, about "
              f"{r.extra_seconds * 1e3:.2f} ms at {r.throughput / 1e12:.0f} TFLOP/s ({how}): "
              f"{_blocks(r)}")
    else:
        print("  recomputes nothing beyond memkern's layers' defaults")
    print(f"  optimizer: memkern.optim.ShardedOptimizer(model.parameters(), \"adamw\", "
          f"lr=...{best.optimizer})")
    planned_budget = size(budget + best.offloaded).replace(" ", "")
    print(f"  apply: memkern.fit(model, batch, \"{planned_budget}\", optimizer=<that "
          f"optimizer>, device=\"{args.device}\")" + (" (the budget raised by what offload keeps "
                                                      "off the device)" if best.offloaded else ""))
    for c in tried[1:]:
        if c.fits:
            print(f"  also fits: {c.name}, recomputing {c.report.extra_flops / 1e9:.1f} GFLOP "
                  "per step")
        else:
            print(f"  {c.name}: needs {size(c.error.smallest_budget - c.offloaded)}")
    return 0
