"""``memkern plan``: a training step's device memory, planned on fake tensors (no device needed).

    memkern plan --size gpt2-small --batch 8 --configs torch-amp,memkern-full
    memkern plan --hf llama --set hidden_size=1024 --set num_hidden_layers=8 \\
        --set intermediate_size=2816 --batch 4 --seq 2048 --variant plain --variant patch \\
        --variant patch:recompute=full

Each configuration or variant is one :func:`memkern.profile.plan_training_step`; the command
prints a row per plan (its peak, where it is, what it is made of, the second-highest moment),
then the full breakdown of each peak; ``--plot`` draws the peaks as stacked bars, ``--json``
writes everything.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from memkern.profile.plan import CATEGORIES, StepPlan, plan_training_step
from memkern.bench.output import table
from memkern.profile.plan_report import MIB, SHORT, format_plan, legend, plan_chart
from memkern.profile.targets import TARGETS
from memkern.profile.workloads import PATCH_OPTIONS, bench_workload, hf_config, hf_workload

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
OPTIMIZERS = ("adamw-fused", "adamw", "memkern-adamw", "sharded")


def _variant(text: str) -> tuple[str, dict | None]:
    """``plain`` | ``patch`` | ``patch:key=value,...`` (the keyword arguments of memkern.patch)."""
    if text == "plain":
        return text, None
    name, _, options = text.partition(":")
    if name != "patch":
        raise argparse.ArgumentTypeError(f"{text!r}: expected plain, patch or "
                                         "patch:key=value,... (e.g. patch:recompute=full)")
    kwargs: dict = {}
    for item in filter(None, options.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"{item!r} in {text!r}: expected key=value")
        if key in PATCH_OPTIONS:
            if value.lower() not in ("true", "false"):
                raise argparse.ArgumentTypeError(f"{key}={value!r}: expected true or false")
            kwargs[key] = value.lower() == "true"
        elif key == "recompute":
            kwargs[key] = value
        else:
            raise argparse.ArgumentTypeError(
                f"{key!r} is not a memkern.patch option; use {', '.join(PATCH_OPTIONS)} or "
                "recompute")
    return text, kwargs


def add_arguments(parser: argparse.ArgumentParser, size_choices, config_names,
                  positive_int, output_file, chart_file) -> None:
    """The ``memkern plan`` flags (``memkern.cli`` passes the bench's sizes, configurations,
    its whole-number parser and its output-path checks, so every command reads them the same
    way)."""
    parser.add_argument("--device", choices=sorted(TARGETS), default="cuda",
                        help="the device to plan for: cuda (Hopper: H100/H200), cuda-sm80 "
                        "(Ampere: A100) or cpu (default: cuda); nothing runs on it")
    parser.add_argument("--size", choices=size_choices, default="gpt2-small",
                        help="memkern bench model size (default: gpt2-small)")
    parser.add_argument("--configs", type=config_names, default=None,
                        help="comma-separated memkern bench configurations (default: every one "
                        "that can be planned: not the compiled ones, nor memkern-fit)")
    parser.add_argument("--batch", type=positive_int, default=8,
                        help="sequences per step (default: 8)")
    parser.add_argument("--seq", type=positive_int,
                        help="sequence length (default: the model's)")
    parser.add_argument("--hf", metavar="MODEL",
                        help="plan a transformers causal LM instead: a model type (llama, "
                        "mistral, qwen2, gpt2, ...) or a config.json (or its directory)")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                        help="with --hf: a config setting (repeatable), e.g. hidden_size=1024")
    parser.add_argument("--variant", type=_variant, action="append",
                        help="with --hf: plain, patch, or patch:key=value,... (memkern.patch's "
                        "options, e.g. patch:recompute=full); repeatable (default: plain and "
                        "patch)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                        help="with --hf: parameter dtype (default: bfloat16)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw-fused",
                        help="with --hf: torch AdamW fused (default) or foreach, memkern's "
                        "FusedAdamW, or ShardedOptimizer")
    parser.add_argument("--plot", metavar="PATH", type=chart_file,
                        help="write a bar chart of each peak by category (PNG, or another "
                        "format by the file's suffix)")
    parser.add_argument("--json", metavar="PATH", type=output_file,
                        help="also write the plans as JSON")


def _plans(args: argparse.Namespace) -> list[tuple[str, StepPlan]]:
    if args.hf:
        cfg = hf_config(args.hf, args.set)
        seq = args.seq or getattr(cfg, "max_position_embeddings", None) or 2048
        variants = args.variant or [_variant("plain"), _variant("patch")]
        return [(name, plan_training_step(
            hf_workload(cfg, batch=args.batch, seq=seq, dtype=DTYPES[args.dtype], patch=patch,
                        optimizer=args.optimizer), device=args.device))
                for name, patch in variants]
    if args.set or args.variant:
        raise ValueError("--set and --variant go with --hf")
    from memkern.bench.configs import DEFAULT_CONFIGS

    names = args.configs or [c for c in DEFAULT_CONFIGS if "compiled" not in c]
    return [(name, plan_training_step(bench_workload(name, args.size, batch=args.batch,
                                                     seq=args.seq), device=args.device))
            for name in names]


def _summary(plans: list[tuple[str, StepPlan]]) -> str:
    """Two tables: each plan's peak and second-highest moment, then its peak by category."""
    peaks = table(["plan", "peak", "phase", "2nd highest", "its phase"],
                  [[name, f"{p.peak_bytes / MIB:.1f}", p.peak.phase,
                    *([f"{p.second.allocated / MIB:.1f}", p.second.phase] if p.second
                      else ["", ""])] for name, p in plans])
    parts = table(["plan", *(SHORT[c] for c in CATEGORIES)],
                  [[name, *(f"{p.peak.by_category[c] / MIB:.1f}" for c in CATEGORIES)]
                   for name, p in plans])
    return (f"peaks, MiB (2nd highest: the highest moment of another phase)\n{peaks}\n\n"
            f"each peak by category, MiB (allocator blocks)\n{parts}\n{legend()}")


def run(args: argparse.Namespace) -> int:
    plans = _plans(args)
    print(f"memkern plan: {TARGETS[args.device].describe()}; planned on fake tensors "
          f"(torch {torch.__version__})")
    print(_summary(plans))
    for name, p in plans:
        print(f"\n=== {name}\n{format_plan(p)}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": args.device, "torch": torch.__version__,
                       "plans": {n: dataclasses.asdict(p) for n, p in plans}}, fh, indent=2)
            fh.write("\n")
        print(f"wrote {args.json}")
    if args.plot:
        title = (f"{args.hf} ({', '.join(args.set)})" if args.hf else f"GPT {args.size}") + \
            f", batch {args.batch}, planned for {args.device}"
        plan_chart([p for _, p in plans], [n for n, _ in plans], args.plot, title)
        print(f"wrote {args.plot}")
    return 0
