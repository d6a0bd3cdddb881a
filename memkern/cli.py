"""memkern: train bigger models, or bigger batches, on the memory you have.

memkern swaps PyTorch layers for ones that save less for backward, keeps gradients in one
flat 16-bit buffer and folds loss scaling, clipping and the optimizer update into one fused
step, sharded across processes if you like. Quick start:

    model = memkern.patch(model)
    opt = memkern.optim.ShardedOptimizer(model.parameters(), "adamw", lr=3e-4)
    opt.backward(loss); opt.step(); opt.zero_grad()

Commands:
    memkern bench    train a small GPT under plain torch, torch AMP and memkern
                     configurations and print their memory and speed side by side
    memkern report   predicted per-rank memory of each configuration and world size
    memkern plan     a training step's device memory planned on fake tensors: the peak and
                     what it is made of, for a GPU or the CPU, without one
    memkern fit      the cheapest memkern configuration (recomputation per block, 8-bit
                     optimizer state, offload) that fits a model's step into a memory budget

Under torchrun (WORLD_SIZE > 1) every rank trains and rank 0 prints.
Documentation: docs/ in the repository (start with docs/index.md).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import sys
import textwrap
from collections.abc import Sequence

import torch

from memkern.bench.configs import (
    BASELINE,
    CONFIGS,
    DEFAULT_CONFIGS,
    DESCRIPTIONS,
    MAX_GRAD_NORM,
    MIN_STEPS,
)
from memkern.bench.model import SIZES, GPTConfig


class _OneLineErrors(argparse.ArgumentParser):
    """Bad flags end with one line on stderr and exit status 2, not a usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _at_least(minimum: int, why: str = ""):
    """A whole-number flag >= ``minimum`` (argparse names the flag in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}{why}, got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    """A finite number > 0 (argparse names the flag in its error)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


SPREAD_LIMIT = 0.2
"""A configuration whose per-round time ratios spread wider than this ((3rd - 1st quartile) /
median) gets a note under the bench table: its time ratio is not to be trusted."""


def _available_devices() -> list[str]:
    return ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def _device(text: str) -> torch.device:
    """``--device``: cpu, cuda or cuda:N that exists on this machine."""
    available = ", ".join(_available_devices())
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device name; available here: "
                                         f"{available}") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: memkern bench runs on cpu or cuda; "
                                         f"available here: {available}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            built = "" if torch.version.cuda else f", torch {torch.__version__} has no CUDA"
            raise argparse.ArgumentTypeError(f"{text!r}: no CUDA GPU here{built}; available "
                                             f"here: {available}")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: there is no GPU {device.index}; "
                                             f"available here: {available}")
    return device


def _output_file(text: str) -> str:
    """A file the command will write, checked when the flags are read, before any work: its
    folder exists and a file can be created (or appended to) there. Every flag that names an
    output file (``--json``, ``--plot``, ...) has this type, so a wrong path costs one line
    naming the flag instead of a finished run and a traceback."""
    folder = os.path.dirname(text) or "."
    if not os.path.isdir(folder):
        what = "is a file, not a folder" if os.path.exists(folder) else "does not exist"
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {folder!r} {what}; create "
                                         "the folder or give another path")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file name in it")
    existed = os.path.exists(text)
    try:
        open(text, "a").close()  # creates nothing it does not remove, truncates nothing
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {exc.strerror}") from None
    if not existed:
        os.remove(text)
    return text


def _chart_file(text: str) -> str:
    """``--plot``: an output file (see :func:`_output_file`) named with a suffix matplotlib
    writes (.png, .svg, .pdf, ...), with matplotlib installed."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise argparse.ArgumentTypeError("needs matplotlib: pip install matplotlib") from None
    formats = FigureCanvasBase.get_supported_filetypes()
    if os.path.splitext(text)[1].lstrip(".").lower() not in formats:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the file name must end in one of "
            f"{', '.join('.' + f for f in sorted(formats))}")
    return _output_file(text)


def _config_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown configuration(s) {', '.join(unknown) or repr(text)}; choose from "
            f"{', '.join(CONFIGS)}")
    return names


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated whole numbers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"world sizes must be >= 1, got {text!r}")
    return values


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineErrors(prog="memkern", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineErrors)

    def model_flags(p: argparse.ArgumentParser, batch: int) -> None:
        p.add_argument("--size", choices=sorted(SIZES), default="small",
                       help="model size (default: small)")
        p.add_argument("--seq", type=_at_least(1), help="sequence length (default: "
                       "the size's, capped at 128 on CPU)")
        p.add_argument("--batch", type=_at_least(1), default=batch,
                       help=f"sequences per step (default: {batch})")
        p.add_argument("--device", type=_device,
                       default="cuda" if torch.cuda.is_available() else "cpu",
                       help="cpu, cuda or cuda:N (default: cuda when available; here: "
                       f"{', '.join(_available_devices())})")
        p.add_argument("--json", metavar="PATH", type=_output_file,
                       help="also write the results as JSON")

    bench = sub.add_parser(
        "bench", help="train the default GPT under each configuration",
        description="Train a small GPT (on the Python standard library's own sources) under "
        "plain torch, torch AMP and memkern configurations, the same steps on the same "
        "batches, and print each one's peak memory, saved activations, optimizer-side bytes "
        "per parameter and step time side by side, with ratios against torch AMP.",
        epilog=_configurations_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    model_flags(bench, batch=8)
    bench.add_argument("--steps", type=_at_least(MIN_STEPS, " (one warm-up, one profiled, "
                                                 "one timed)"), default=20,
                       help=f"optimizer steps per configuration, >= {MIN_STEPS} (default: 20); "
                       "the first, the profiled one and a few warm-up steps are not timed")
    bench.add_argument("--configs", type=_config_list, default=list(DEFAULT_CONFIGS),
                       help=f"comma-separated subset of: {', '.join(CONFIGS)} (default: all "
                       "but memkern-full-offload and memkern-fit)")
    bench.add_argument("--memory-budget", metavar="BYTES",
                       help="memkern-fit's device memory budget, e.g. 3GiB or 2500MiB")
    bench.add_argument("--max-grad-norm", type=_positive_float, default=MAX_GRAD_NORM,
                       help="every configuration clips the gradients' norm to this "
                       f"(default: {MAX_GRAD_NORM}); a large value (e.g. 1e9) measures the "
                       "steps where clipping does not bite, as later in training")
    bench.add_argument("--plot", metavar="PATH", type=_chart_file,
                       help="write a bar chart of memory by component per configuration "
                       "(PNG, or another format by the file's suffix)")
    bench.add_argument("--seed", type=int, default=0, help="seed of the model's initial "
                       "weights and of the batches, the same for every configuration "
                       "(default: 0)")
    bench.add_argument("--compile", action="store_true",
                       help="run the memkern configurations' forward under torch.compile")
    bench.add_argument("--threads", type=_at_least(1),
                       help="torch's intra-op threads (default: OMP_NUM_THREADS if set, else "
                       "the cores other processes leave free, measured as the run starts, at "
                       "least 1; the header says how many and why)")
    bench.add_argument("--quiet", action="store_true", help="no progress bars")

    report = sub.add_parser(
        "report", help="predicted per-rank memory per configuration and world size",
        description="Predict each training configuration's memory per rank at several world "
        "sizes: model state from the per-parameter formulas of docs/memory.md, activations "
        "measured in one forward pass of each configuration's model on --device (no "
        "training step).")
    model_flags(report, batch=8)
    report.add_argument("--world-sizes", type=_int_list, default=[1, 2, 4, 8],
                        help="comma-separated world sizes (default: 1,2,4,8)")
    from memkern import plan_command

    plan = sub.add_parser(
        "plan", help="plan a training step's device memory on fake tensors",
        description="Run one whole training step (forward, backward, optimizer step) of a "
        "memkern bench configuration or a transformers causal LM on fake tensors, computing "
        "nothing, and print its peak device memory and what the peak is made of, with the CUDA "
        "caching allocator's rounding: a plan for a GPU made without one.")
    plan_command.add_arguments(plan, sorted(SIZES), _config_list, _at_least(1), _output_file,
                               _chart_file)
    from memkern import fit_command

    fit = sub.add_parser(
        "fit", help="the cheapest memkern configuration that fits a memory budget",
        description="Plan a transformers causal LM's training step on fake tensors (computing "
        "nothing, no weights made) under memkern's configurations, cheapest first: 32-bit "
        "optimizer state, 8-bit state, the optimizer offloaded to host memory, each with the "
        "least per-block recomputation memkern.fit finds, and print the cheapest one whose "
        "planned peak fits --memory-budget: what it recomputes and how to apply it; or by how "
        "much the closest one misses.")
    fit_command.add_arguments(fit, _at_least(1))
    return parser


def _configurations_help() -> str:
    """``memkern bench --help``'s list of the configurations, what each one is."""
    name_width = max(map(len, CONFIGS)) + 2
    lines = ["configurations:"]
    for name, what in DESCRIPTIONS.items():
        wrapped = textwrap.wrap(what, width=96 - name_width)
        lines.append(f"  {name:<{name_width}}{wrapped[0]}")
        lines += [" " * (name_width + 2) + more for more in wrapped[1:]]
    return "\n".join(lines)


def _model_config(args: argparse.Namespace, device: torch.device) -> GPTConfig:
    cfg = SIZES[args.size]
    seq = args.seq or (min(cfg.seq, 128) if device.type == "cpu" else cfg.seq)
    if seq > cfg.seq:
        raise ValueError(f"--seq {seq} is longer than the {args.size} model's {cfg.seq}")
    return GPTConfig(cfg.layers, cfg.width, cfg.heads, seq=seq, vocab=cfg.vocab)


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f}"


def _legend(*parts: str, indent: str = "") -> str:
    """Legend lines under a table, wrapped to the output's width (lines after the first
    indented by ``indent``)."""
    from memkern.output import width

    return textwrap.fill("; ".join(parts), width=min(width(), 100), break_on_hyphens=False,
                         subsequent_indent=indent)


def _print_bench_header(cfg: GPTConfig, args, device: torch.device, threads) -> None:
    """What is about to run, printed before the training starts: the model, the batch, the
    steps and rounds, the thread count and why."""
    from memkern.bench.model import GPT
    from memkern.bench.runner import untimed_steps

    with torch.device("meta"):
        num_params = sum(p.numel() for p in GPT(cfg).parameters())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ranks = (f", {world} ranks (memkern configurations sharded across them, torch ones "
             "replicated; figures are rank 0's)") if world > 1 else ""
    rounds = args.steps - untimed_steps(args.steps)
    print(_legend(
        f"memkern bench: GPT {args.size} ({num_params / 1e6:.2f}M params, {cfg.layers} "
        f"layers, width {cfg.width}), batch {args.batch} x seq {cfg.seq} per rank, {args.steps} "
        f"steps ({rounds} timed round{'s' * (rounds > 1)}) on {device}{ranks} (torch "
        f"{torch.__version__}), {threads.count} thread{'s' * (threads.count > 1)} "
        f"({threads.reason})"), flush=True)


MIN_ROUNDS_FOR_SPREAD = 4
"""Timed rounds below which a time ratio has no spread to show (quartiles of fewer values say
nothing) and the table is marked as a few measurements only."""


def _print_bench(rows, cfg: GPTConfig, args, device: torch.device) -> None:
    from memkern.bench.runner import untimed_steps
    from memkern.bench.timing import ratio
    from memkern.output import table

    base = next((r for r in rows if r.config == BASELINE), None)
    vs = f" vs {BASELINE}" if base is not None else ""
    memory = [[r.config, _mib(r.peak_bytes), _mib(r.held_bytes),
               _mib(r.saved_activation_bytes), f"{r.optimizer_side_bytes_per_param:.2f}"]
              + ([f"{r.peak_bytes / base.peak_bytes:.2f}x"] if base else []) for r in rows]
    print("\nmemory, MiB\n" + table(["configuration", "peak", "held", "saved for backward",
                                     "optimizer bytes/param"] + (["peak" + vs] if base else []),
                                    memory))
    print(_legend(
        "peak: persistent state + the step's peak allocation "
        + ("(CUDA allocator)" if device.type == "cuda" else "(profiler allocation trace)"),
        "held: " + ("device memory allocated between steps" if device.type == "cuda"
                    else "what stays allocated between steps (parameters, master weights, "
                    "optimizer state, and the gradients where they stay: memkern's flat "
                    "gradient buffer does; the torch rows free their gradients at zero_grad "
                    "and allocate them again in each backward, which peak counts)"),
        "saved for backward: what one micro-batch's forward saves",
        "optimizer bytes/param: gradients + the fp32 weights the optimizer updates (master "
        "copies, or fp32 parameters updated in place) + optimizer state, per parameter"))
    ratios = {r.config: ratio(r.step_times, base.step_times) for r in rows} if base else {}
    rounds = len(rows[0].step_times)
    few = rounds < MIN_ROUNDS_FOR_SPREAD
    speed = [[r.config, f"{r.step_seconds * 1e3:.1f}", f"{r.tokens_per_second:.0f}",
              f"{r.final_loss:.4f}"]
             + ([f"{ratios[r.config].median:.2f}x",
                 "-" if few else f"{ratios[r.config].spread:.0%}"] if base else [])
             for r in rows]
    title = _legend(f"time, ms per step: {rounds} round{'s' * (rounds > 1)} of one timed step of "
                    "each configuration, the order rotated")
    print(f"\n{title}\n" + table(["configuration", "step", "tokens/s", "final loss"]
                                 + (["time" + vs, "spread"] if base else []), speed))
    print(_legend("step: the median timed step",
                  *(["time vs " + BASELINE + ": the median over the rounds of the step's time "
                     "/ " + BASELINE + "'s in the same round", "spread: (3rd - 1st quartile) / "
                     "median of those per-round ratios"] if base else [])))
    if device.type == "cuda":
        from memkern.bench.host_device import table as host_device_table

        print("\nper step on the GPU: host = issuing the step (wall time until the call "
              "returns), GPU = its kernels' summed time (profiler); the larger one bounds it")
        print("\n".join(host_device_table([(r.config, r.host_device) for r in rows])))
    print("\nconfigurations:")
    for r in rows:
        name = r.config.removesuffix("+compile")
        compiled = ", its forward under torch.compile" if name != r.config else ""
        print(_legend(f"  {r.config}: {DESCRIPTIONS[name]}{compiled}", indent="      "))
    spread = [f"{name} {r.spread:.0%}" for name, r in ratios.items() if r.spread > SPREAD_LIMIT]
    if base and few:
        enough = next(n for n in itertools.count(MIN_STEPS)
                      if n - untimed_steps(n) >= MIN_ROUNDS_FOR_SPREAD)
        print(_legend(f"note: only {rounds} timed round{'s' * (rounds > 1)}: each time ratio "
                      "is one or a few measurements, with no spread to tell how far it can be "
                      f"trusted; run with --steps {enough} or more"))
    elif spread:
        print(_legend(f"note: time ratios spread over {SPREAD_LIMIT:.0%} in {', '.join(spread)}"
                      f"{_load()}: those ratios are uncertain; run again with more --steps "
                      "(rounds), or on a quieter machine"))


def _load() -> str:
    """The machine's load, for the spread note (a busy machine is the usual cause)."""
    try:
        one_minute = os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return ""
    return f" (load average {one_minute:.1f} on {os.cpu_count()} CPUs, this run included)"


def _bench(args: argparse.Namespace) -> int:
    from memkern.bench.data import stdlib_corpus
    from memkern.bench.runner import run
    from memkern.bench.timing import choose_threads, ratio

    threads = choose_threads(args.threads, default=torch.get_num_threads())
    torch.set_num_threads(threads.count)
    device = args.device
    cfg = _model_config(args, device)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if rank0:
        _print_bench_header(cfg, args, device, threads)
    rows = run(args.configs, cfg, stdlib_corpus(), steps=args.steps, batch=args.batch,
               device=device, seed=args.seed, progress=rank0 and not args.quiet,
               compile=args.compile, memory_budget=args.memory_budget,
               max_grad_norm=args.max_grad_norm)
    if not rank0:
        return 0
    _print_bench(rows, cfg, args, device)
    if args.json:
        base = next((r for r in rows if r.config == BASELINE), None)

        def vs_baseline(r) -> dict:
            if base is None:
                return {}
            q = ratio(r.step_times, base.step_times)
            return {"time_vs_baseline": {"median": q.median, "first_quartile": q.low,
                                         "third_quartile": q.high}}

        _write_json(args.json, {"command": "bench", "size": args.size, "seq": cfg.seq,
                                "batch": args.batch, "steps": args.steps, "device": str(device),
                                "torch": torch.__version__, "baseline": BASELINE,
                                "threads": threads.count, "threads_reason": threads.reason,
                                "rows": [dict(vars(r), final_loss=r.final_loss,
                                              **vs_baseline(r)) for r in rows]})
    if args.plot:
        from memkern.bench.plot import memory_chart

        memory_chart(rows, args.plot, f"GPT {args.size}, batch {args.batch} x {cfg.seq}, "
                                      f"{device}")
        print(f"wrote {args.plot}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from memkern.bench.data import stdlib_corpus
    from memkern.bench.report import measured_activations, predict

    device = args.device
    cfg = _model_config(args, device)
    num_params, saved = measured_activations(cfg, stdlib_corpus(), args.batch, device)
    rows = predict(num_params, saved, args.world_sizes)
    from memkern.output import table

    print(_legend(f"memkern report: GPT {args.size} ({num_params / 1e6:.2f}M params), batch "
                  f"{args.batch} x seq {cfg.seq}; model state from the per-parameter formulas of "
                  f"docs/memory.md (Adam), activations measured on {device}"))
    print("\nper rank, MiB\n" + table(
        ["configuration", "W", "bytes/param", "model state", "activations", "device", "host"],
        [[r["config"], str(r["world_size"]), f"{r['bytes_per_param']:.2f}",
          _mib(r["model_state_bytes"]), _mib(r["activation_bytes"]), _mib(r["device_bytes"]),
          _mib(r["host_bytes"])] for r in rows]))
    print(_legend("W: processes (ranks)", "bytes/param: model-state bytes per parameter on each "
                  "rank's device", "model state: bytes/param x params", "activations: what one "
                  "micro-batch's forward saves for backward (measured)", "device: model state + "
                  "activations", "host: what offload keeps in host memory"))
    if args.json:
        _write_json(args.json, {"command": "report", "size": args.size, "seq": cfg.seq,
                                "batch": args.batch, "num_params": num_params,
                                "activations": saved, "rows": rows})
    return 0


def _machine() -> dict[str, object]:
    info: dict[str, object] = {"python": platform.python_version(), "torch": torch.__version__,
                               "threads": torch.get_num_threads(),
                               "cpu": platform.processor() or platform.machine()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _write_json(path: str, payload: dict) -> None:
    payload = {"command_line": "memkern " + " ".join(sys.argv[1:]), "machine": _machine(),
               **payload}
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=2)
        fh.write("\n")
    print(f"wrote {path}")


def _is_out_of_memory(exc: BaseException) -> bool:
    text = str(exc)
    return (isinstance(exc, (torch.OutOfMemoryError, MemoryError))
            or "can't allocate memory" in text or "out of memory" in text.lower())


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command in ("plan", "fit"):
        from memkern import fit_command, plan_command

        try:
            return (plan_command if args.command == "plan" else fit_command).run(args)
        except ValueError as exc:
            print(f"memkern {args.command}: error: {exc}", file=sys.stderr)
            return 2
    try:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            import torch.distributed as dist

            dist.init_process_group("nccl" if args.device.type == "cuda" else "gloo")
        return _bench(args) if args.command == "bench" else _report(args)
    except ValueError as exc:
        print(f"memkern {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, MemoryError) as exc:
        if not _is_out_of_memory(exc):
            raise
        print(f"memkern {args.command}: error: batch {args.batch} x seq does not fit in memory "
              f"on {args.device} ({str(exc).splitlines()[0][:120]}); try a smaller --batch or "
              "--seq", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
