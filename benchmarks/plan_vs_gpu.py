"""The planner against measured peaks: the GPU records, and (``--cpu``) this machine's own.

GPU: what ``memkern.profile.plan_training_step`` plans for a Hopper GPU, next to the peaks the
H200 runs of 2026-11-26 recorded (torch 2.11, transformers 5.17; the planner runs here, on
whatever torch and transformers are installed):

* ``memkern bench --device cuda --size gpt2-small --batch 8`` (seq 1024): its peak is
  ``torch.cuda.max_memory_allocated()`` over the configuration's whole run above the level
  before it was built, so the planned figure is the run peak (set-up, warm-up step, step);
* the same run's profile script (memkern-full alone, median of 5 steps): the step's peak;
* Hugging Face Llama 160M (hidden 1024, 8 layers, 16/8 heads, MLP 2816, vocab 32000), bf16
  parameters, torch fused AdamW, batch 4 x 2048: the step's peak.

CPU (``--cpu``): the same configurations at CPU sizes, measured here by ``memkern bench``'s
runner and by ``benchmarks/bench_hf.py``'s method (parameters and optimizer state plus the
step's peak allocation above its start, from the profiler's allocation trace).

    python benchmarks/plan_vs_gpu.py [--cpu] [--save PATH]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from memkern.bench.workload import bench_workload  # noqa: E402
from memkern.profile import allocation_stats  # noqa: E402
from memkern.profile.plan import plan_training_step  # noqa: E402
from memkern.profile.workloads import hf_config, hf_workload  # noqa: E402

MIB = 1 << 20
LLAMA_160M = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=8, intermediate_size=2816, vocab_size=32000,
                  max_position_embeddings=2048, bos_token_id=0, eos_token_id=0,
                  attn_implementation="sdpa")
HF_VARIANTS = {"plain": None, "memkern.patch": {}, "memkern.patch(recompute='full')":
               {"recompute": "full"}}

GPU_RECORDS = [  # (model, configuration, recorded MiB, what was recorded)
    ("GPT-2 small b8", "torch-amp", 9095.8, "memkern bench"),
    ("GPT-2 small b8", "memkern-full", 3141.0, "memkern bench"),
    ("GPT-2 small b8", "memkern-full", 3624.0, "profile script"),
    ("GPT-2 small b8", "memkern-full-ckpt", 2440.5, "memkern bench"),
    ("GPT-2 small b8", "memkern-full-8bit", 2942.4, "memkern bench"),
    ("Llama 160M b4x2048", "plain", 6882.0, "HF script"),
    ("Llama 160M b4x2048", "memkern.patch", 3112.0, "HF script"),
    ("Llama 160M b4x2048", "memkern.patch(recompute='full')", 3112.0, "HF script"),
    # the second H200 run (benchmarks/results/h200-2026-11-26): memkern bench --steps 12, which
    # collects the previous configuration's garbage first (the first run's memkern-full row
    # above did not), and bench_hf.py's step peak
    ("GPT-2 small b8", "torch-amp", 9096.0, "memkern bench 2"),
    ("GPT-2 small b8", "memkern-full", 3623.4, "memkern bench 2"),
    ("GPT-2 small b8", "memkern-full-8bit", 2943.5, "memkern bench 2"),
    ("Llama 160M b4x2048", "plain", 6801.1, "bench_hf.py 2"),
    ("Llama 160M b4x2048", "memkern.patch", 2496.6, "bench_hf.py 2"),
    ("Llama 160M b4x2048", "memkern.patch(recompute='full')", 1880.1, "bench_hf.py 2"),
]


def gpu_rows() -> list[dict]:
    cfg = hf_config("llama", LLAMA_160M)
    plans = {}
    rows = []
    for model, config, recorded, source in GPU_RECORDS:
        if (model, config) not in plans:
            if model.startswith("GPT"):
                build = bench_workload(config, "gpt2-small", batch=8)
            else:
                build = hf_workload(cfg, batch=4, seq=2048, patch=HF_VARIANTS[config])
            plans[(model, config)] = plan_training_step(build, device="cuda")
        plan = plans[(model, config)]
        if source.startswith("memkern bench"):
            planned = plan.run_peak
        elif source.startswith("bench_hf.py"):
            # what bench_hf.py measures: parameters + optimizer state + the step's peak above
            # its start
            planned = (plan.held["parameters"] + plan.held["optimizer state"]
                       + plan.step_peak_above_start)
        else:
            planned = plan.peak_bytes
        rows.append(dict(model=model, config=config, source=source, recorded_mib=recorded,
                         planned_mib=planned / MIB, ratio=planned / MIB / recorded,
                         peak_phase=plan.peak.phase, peak_at=f"{plan.peak.op} ({plan.peak.where})",
                         planning_seconds=plan.seconds))
    return rows


def cpu_rows() -> list[dict]:
    from memkern.bench.data import stdlib_corpus
    from memkern.bench.model import SIZES, GPTConfig
    from memkern.bench.runner import run

    rows = []
    for size, batch, seq in (("small", 8, 128), ("medium", 4, 256)):
        base = SIZES[size]
        cfg = GPTConfig(base.layers, base.width, base.heads, seq=seq, vocab=base.vocab)
        for config in ("torch-fp32", "torch-amp", "memkern-modules", "memkern-full",
                       "memkern-full-ckpt", "memkern-full-8bit"):
            plan = plan_training_step(bench_workload(config, size, batch=batch, seq=seq),
                                      device="cpu")
            planned = sum(plan.held.values()) + plan.step_peak_above_start
            row, = run([config], cfg, stdlib_corpus(), steps=3, batch=batch,
                      device=torch.device("cpu"), progress=False)
            rows.append(dict(model=f"GPT {size} b{batch}x{seq}", config=config,
                             measured_mib=row.peak_bytes / MIB, planned_mib=planned / MIB,
                             ratio=planned / row.peak_bytes))
    cfg = hf_config("llama", dict(LLAMA_160M, hidden_size=256, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=704, max_position_embeddings=512))
    for name, patch in HF_VARIANTS.items():
        plan = plan_training_step(hf_workload(cfg, batch=2, seq=512, dtype=torch.float32,
                                              patch=patch, optimizer="adamw"), device="cpu")
        planned = (plan.held["parameters"] + plan.held["optimizer state"]
                   + plan.step_peak_above_start)
        rows.append(dict(model="Llama w256 b2x512 fp32", config=name,
                         measured_mib=_hf_cpu_measured(cfg, patch) / MIB,
                         planned_mib=planned / MIB, ratio=planned / _hf_cpu_measured.last))
    return rows


def _hf_cpu_measured(cfg, patch) -> int:
    """bench_hf.py's CPU peak: parameters + optimizer state + the step's peak above its start."""
    import transformers

    import memkern

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).train()
    if patch is not None:
        memkern.patch(model, **patch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    ids = torch.randint(1, cfg.vocab_size, (2, 512))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    held = sum(p.untyped_storage().nbytes() for p in model.parameters()) + sum(
        v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values()
        if v.dim())
    _hf_cpu_measured.last = held + allocation_stats(step).peak
    return _hf_cpu_measured.last


def _print(rows: list[dict], measured_key: str) -> None:
    print(f"{'model':<24} {'configuration':<32} {'source':<15} {measured_key[:-4]:>9} "
          f"{'planned':>9} {'ratio':>7}")
    for r in rows:
        print(f"{r['model']:<24} {r['config']:<32} {r.get('source', 'this CPU'):<15} "
              f"{r[measured_key]:>9.1f} {r['planned_mib']:>9.1f} {r['ratio']:>7.3f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="also measure CPU steps here")
    ap.add_argument("--save", metavar="PATH", default=None)
    args = ap.parse_args(argv)
    results = {"gpu": gpu_rows()}
    print("planned for a Hopper GPU vs the H200 record of 2026-11-26 (MiB)")
    _print(results["gpu"], "recorded_mib")
    if args.cpu:
        results["cpu"] = cpu_rows()
        print("\nplanned for the CPU vs measured on this CPU (MiB)")
        _print(results["cpu"], "measured_mib")
    out = args.save or os.path.join(os.path.dirname(__file__), "results", "plan-vs-measured.json")
    common.save(out, results)


if __name__ == "__main__":
    main()
