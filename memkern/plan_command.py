"""``memkern plan``: a training step's device memory, planned on fake tensors (no device needed).

    memkern plan --size gpt2-small --batch 8 --configs torch-amp,memkern-full
    memkern plan --hf llama --set hidden_size=1024 --set num_hidden_layers=8 \\
        --set intermediate_size=2816 --batch 4 --seq 2048 --variant plain --variant patch \\
        --variant patch:recompute=full
    memkern plan --hf xlm-roberta --task sequence-classification --dtype float32 \\
        --autocast float16 --batch 8 --seq 256
    memkern plan --hf llama --lora r=16 --batch 2 --seq 2048   # PEFT's LoRA on every linear layer

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

from memkern.bench.configs import DEFAULT_CONFIGS
from memkern.bench.workload import bench_workload
from memkern.nn.checkpoint import POLICIES
from memkern.output import table
from memkern.profile.plan import CATEGORIES, StepPlan, plan_training_step
from memkern.profile.plan_report import MIB, SHORT, format_plan, legend, plan_chart
from memkern.profile.targets import TARGETS
from memkern.profile.workloads import (
    DEFAULT_OPTIMIZER,
    OPTIMIZERS,
    PATCH_OPTIONS,
    SHARDINGS,
    TASKS,
    default_seq,
    hf_config,
    hf_workload,
    lora_options,
    uses_kv_cache,
)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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
                        help="plan a transformers model instead: a model type (llama, gpt2, "
                        "bert, xlm-roberta, vit, ...) or a config.json (or its directory)")
    parser.add_argument("--task", choices=sorted(TASKS), default="causal-lm",
                        help="with --hf: what the model is trained for (default: causal-lm)")
    parser.add_argument("--autocast", choices=("float16", "bfloat16"),
                        help="with --hf: run the forward under torch.autocast with this dtype "
                        "(AMP; use --dtype float32 for float32 parameters)")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                        help="with --hf: a config setting (repeatable), e.g. hidden_size=1024")
    parser.add_argument("--variant", type=_variant, action="append",
                        help="with --hf: plain, patch, or patch:key=value,... (memkern.patch's "
                        "options, e.g. patch:recompute=full); repeatable (default: plain and "
                        "patch)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                        help="with --hf: parameter dtype (default: bfloat16)")
    add_lora_argument(parser)
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default=DEFAULT_OPTIMIZER,
                        help="with --hf: memkern's ShardedOptimizer (default, as memkern fit: "
                        "AdamW, float32 master weights, clipping at 1.0, dynamic loss scale), "
                        "torch AdamW fused or foreach on the parameters as they are, or "
                        "memkern's FusedAdamW (32-bit or 8-bit state)")
    add_mode_arguments(parser)
    parser.add_argument("--world-size", type=positive_int, default=1,
                        help="with --hf and --sharding: plan one rank of this many (default: 1)")
    parser.add_argument("--sharding", choices=SHARDINGS,
                        help="with --hf: zero1 / zero2 (ShardedOptimizer's stages: use "
                        "--optimizer sharded) or fsdp2 (fully_shard per decoder layer and on "
                        "the model), over --world-size ranks; each rank trains --batch sequences")
    parser.add_argument("--plot", metavar="PATH", type=chart_file,
                        help="write a bar chart of each peak by category (PNG, or another "
                        "format by the file's suffix)")
    parser.add_argument("--json", metavar="PATH", type=output_file,
                        help="also write the plans as JSON")


def _lora(text: str) -> dict:
    try:
        return lora_options(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_lora_argument(parser: argparse.ArgumentParser) -> None:
    """``--lora`` (``memkern plan`` and ``memkern fit``)."""
    parser.add_argument("--lora", metavar="OPTIONS", type=_lora, nargs="?", const=lora_options(""),
                        help="with --hf: train PEFT's LoRA adapters instead of the whole model "
                        "(peft.get_peft_model before memkern.patch), e.g. r=16,alpha=32,"
                        "dropout=0.05,targets=q_proj+v_proj (default: r=16, alpha=32, no "
                        "dropout, every linear layer but the output layer)")
def add_mode_arguments(parser: argparse.ArgumentParser) -> None:
    """The memory-saving modes of ``ShardedOptimizer`` and :func:`memkern.checkpoint`, as
    ``memkern plan`` takes them (with --hf)."""
    parser.add_argument("--state-precision", choices=("32bit", "8bit"),
                        help="with --hf and --optimizer sharded: the optimizer state's precision "
                        "(default: 32bit)")
    parser.add_argument("--offload", choices=("cpu",),
                        help="with --hf and --optimizer sharded: the float32 master weights and "
                        "the optimizer state in host memory, stepped there (ShardedOptimizer's "
                        "offload='cpu'); the plan shows the host memory too")
    parser.add_argument("--gradients", choices=("host",),
                        help="with --hf and --optimizer sharded: stream each bucket's gradients "
                        "to host memory as backward makes them (no gradient buffer on the "
                        "device; the optimizer on the host: ShardedOptimizer's gradients='host')")
    parser.add_argument("--checkpoint", choices=POLICIES,
                        help="with --hf: memkern.checkpoint each decoder layer (each block of "
                        "the model's largest list of repeated blocks) with this policy")


def optimizer_options(args: argparse.Namespace) -> dict:
    """The ShardedOptimizer keyword arguments the mode flags ask for."""
    options = {}
    if args.state_precision:
        options["state_precision"] = args.state_precision
    if args.offload:
        options["offload"] = args.offload
    if args.gradients:
        options["gradients"] = args.gradients
    if options and args.optimizer != "sharded":
        raise ValueError(f"{', '.join('--' + k.replace('_', '-') for k in options)} "
                         "go with --optimizer sharded (memkern's ShardedOptimizer)")
    return options


def _plans(args: argparse.Namespace) -> list[tuple[str, StepPlan]]:
    if args.hf:
        cfg = hf_config(args.hf, args.set)
        seq = args.seq or default_seq(cfg, args.task)
        variants = args.variant or [_variant("plain"), _variant("patch")]
        if (args.world_size > 1) != (args.sharding is not None):
            raise ValueError("--world-size above 1 and --sharding go together")
        autocast = DTYPES[args.autocast] if args.autocast else None
        options = optimizer_options(args)
        return [(name, plan_training_step(
            hf_workload(cfg, batch=args.batch, seq=seq, dtype=DTYPES[args.dtype], patch=patch,
                        optimizer=args.optimizer, task=args.task, autocast=autocast,
                        sharding=args.sharding, optimizer_options=options,
                        checkpoint=args.checkpoint, kv_cache=False, lora=args.lora),
            device=args.device, world_size=args.world_size))
                for name, patch in variants]
    if (args.set or args.variant or args.sharding or args.world_size > 1
            or args.task != "causal-lm" or args.autocast or args.state_precision
            or args.offload or args.gradients or args.checkpoint or args.lora is not None):
        raise ValueError("--set, --variant, --sharding, --world-size, --task, --autocast, "
                         "--state-precision, --offload, --gradients, --checkpoint and --lora "
                         "go with --hf")
    names = args.configs or [c for c in DEFAULT_CONFIGS if "compiled" not in c]
    return [(name, plan_training_step(bench_workload(name, args.size, batch=args.batch,
                                                     seq=args.seq), device=args.device))
            for name in names]


def _summary(plans: list[tuple[str, StepPlan]]) -> str:
    """Two tables: each plan's peak and second-highest moment (and its host memory, when a plan
    offloads), then its peak by category."""
    host = any(p.host_peak for _, p in plans)
    peaks = table(["plan", "peak", "phase", "2nd highest", "its phase",
                   *(["host"] if host else [])],
                  [[name, f"{p.peak_bytes / MIB:.1f}", p.peak.phase,
                    *([f"{p.second.allocated / MIB:.1f}", p.second.phase] if p.second
                      else ["", ""]), *([f"{p.host_peak / MIB:.1f}"] if host else [])]
                   for name, p in plans])
    parts = table(["plan", *(SHORT[c] for c in CATEGORIES)],
                  [[name, *(f"{p.peak.by_category[c] / MIB:.1f}" for c in CATEGORIES)]
                   for name, p in plans])
    what = "; host: the host memory offloading holds" if host else ""
    return (f"peaks, MiB (2nd highest: the highest moment of another phase{what})\n{peaks}\n\n"
            f"each peak by category, MiB (allocator blocks)\n{parts}\n{legend()}")


def what_is_trained(args: argparse.Namespace) -> str:
    """The optimizer and the variants, as code and in words (``memkern plan --hf``)."""
    spec = OPTIMIZERS[args.optimizer].with_options(**optimizer_options(args))
    masters = ("the float32 parameters are the master weights" if args.dtype == "float32"
               else f"float32 master weights of the {args.dtype} parameters"
               if args.optimizer == "sharded" or args.optimizer.startswith("memkern")
               else f"no master weights: it updates the {args.dtype} parameters themselves")
    lines = [f"optimizer: {spec.code()} ({masters}; the default of memkern plan and memkern "
             "fit is ShardedOptimizer: --optimizer to change)"]
    if uses_kv_cache(hf_config(args.hf, args.set)):
        lines.append("no key/value cache in training (use_cache=False), as memkern fit plans it")
    names = {name for name, _ in (args.variant or [("plain", None), ("patch", {})])}
    if "plain" in names:
        lines.append(f"plain: the transformers model as it is, {args.dtype} parameters (torch "
                     "AMP, the README's baseline, is --dtype float32 --autocast bfloat16)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    plans = _plans(args)
    ranks = (f"; one rank of {args.world_size}, {args.sharding}" if args.world_size > 1
             else "")
    print(f"memkern plan: {TARGETS[args.device].describe()}; planned on fake tensors "
          f"(torch {torch.__version__}){ranks}")
    if args.hf:
        print(what_is_trained(args))
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
