"""Hugging Face models: plain transformers vs Liger-Kernel vs ``memkern.patch``.

For each family (causal LMs: Llama, GPT-2, Mistral, Qwen2, Gemma 2; encoders: BERT and XLM-R
sequence classification, XLM-R masked LM with a 50k vocabulary (15% of the tokens labelled);
ViT image classification (128 x 128 images, 8 x 8 patches: 257 tokens); diffusers' DiT (32 x 32
latents, 2 x 2 patches: 256 tokens; its loss the mean square of the output)), a model built
from a config (nothing downloaded) trains with ``model(**batch).loss``, backward and an AdamW
step:

* ``plain``: transformers as it is;
* ``liger``: ``apply_liger_kernel_to_<family>(model=model)``, when ``liger_kernel`` imports
  (it needs a GPU) and supports the family; it patches transformers' classes for the whole
  process, so it runs in a subprocess of its own;
* ``memkern``: ``memkern.patch(model)`` (fused loss, RMSNorm/LayerNorm, MLPs with
  ``recompute="activation"``, attention probabilities recomputed); ``memkern-full``:
  ``memkern.patch(model, recompute="full")``; ``memkern-sdpa`` (encoders):
  ``memkern.patch(model, attention=False)``.

Peak of a training step: the bytes the training state holds before the step (parameters,
optimizer state) plus the step's peak allocation above that (CPU: the profiler's allocation
trace; GPU: ``torch.cuda.max_memory_allocated``); next to it, what ``memkern.profile``'s
planner predicts for the same measure (on fake tensors, in seconds, on the CPU). Peak of forward +
backward (the issue's CPU measure): the parameters plus the peak allocation of
``model(...).loss.backward()``. Time: median step after warm-up; plain, memkern and memkern-full
alternate step by step in one process, so their ratios share the machine's load; on a shared CPU the
process CPU time (also reported) is the steadier measure of the work. GPT-2's dropout (0.1) draws
different masks in torch and memkern: its losses differ slightly. Saved for backward (the issue's
measure for the encoders, :func:`memkern.profile.saved_bytes`): the bytes the training forward
leaves for backward, each storage once, parameters excluded.

RoPE (Liger fuses it): the bytes ``apply_rotary_pos_emb`` saves for backward and its share of
the step time, measured on the Llama model, show what fusing it could gain.

    python benchmarks/bench_hf.py [--size cpu|160m] [--device cpu|cuda] [--families llama,gpt2]
                                  [--reps 3] [--save PATH]
    python benchmarks/bench_hf.py --families bert,xlm-roberta,xlm-roberta-mlm,vit,dit

``--size cpu`` (default on a CPU): the issue's shape scaled down, width 256, 2 layers, 4 heads
(2 KV), MLP 704, vocab 32000, batch 2 x 512, float32. ``--size small``: width 256, 2 layers, 4
heads, MLP 1024, batch 4 x 128, float32 (the encoders' saved-bytes measure). ``--size 160m``
(default on a GPU): width 1024, 8 layers, 16 heads (8 KV), MLP 2816, vocab 32000, batch 4 x 2048,
bf16 parameters, fused AdamW. Targets: CPU forward + backward peak <= 0.5x plain's; GPU (160m Llama)
peak <= 0.9x Liger's at <= 1.0x plain's time.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import memkern as mk  # noqa: E402
from memkern.profile import allocation_stats, saved_bytes  # noqa: E402

SIZES = {
    "cpu": dict(width=256, layers=2, heads=4, kv_heads=2, mlp=704, vocab=32000, batch=2, seq=512,
                dtype="float32"),
    "small": dict(width=256, layers=2, heads=4, kv_heads=4, mlp=1024, vocab=32000, batch=4,
                  seq=128, dtype="float32"),
    "160m": dict(width=1024, layers=8, heads=16, kv_heads=8, mlp=2816, vocab=32000, batch=4,
                 seq=2048, dtype="bfloat16"),
}
FAMILIES = ("llama", "gpt2", "mistral", "qwen2", "gemma2")
ENCODERS = {  # family -> (transformers model type, task, vocabulary)
    "bert": ("bert", "sequence-classification", None),
    "xlm-roberta": ("xlm-roberta", "sequence-classification", None),
    "xlm-roberta-mlm": ("xlm-roberta", "masked-lm", 50000),
    "vit": ("vit", "image-classification", None),
}
OTHERS = (*ENCODERS, "dit")
"""Families measured when named in --families (not by default)."""
LIGER_FN = {"llama": "apply_liger_kernel_to_llama", "mistral": "apply_liger_kernel_to_mistral",
            "qwen2": "apply_liger_kernel_to_qwen2", "gemma2": "apply_liger_kernel_to_gemma2"}
TARGET_CPU_PEAK = 0.5
TARGET_GPU_PEAK_VS_LIGER = 0.9


def model_config(family: str, size: dict):
    """The transformers config of ``family`` at ``size`` (built from it, nothing downloaded)."""
    import transformers

    s = size
    if family in ENCODERS:
        from memkern.profile import hf_config

        model_type, task, vocab = ENCODERS[family]
        image = (dict(image_size=128, patch_size=8, num_labels=10)
                 if task == "image-classification"
                 else dict(vocab_size=vocab or s["vocab"], max_position_embeddings=s["seq"] + 2,
                           num_labels=2))
        return hf_config(model_type, dict(hidden_size=s["width"], num_hidden_layers=s["layers"],
                                          num_attention_heads=s["heads"],
                                          intermediate_size=s["mlp"], **image))
    common_cfg = dict(hidden_size=s["width"], num_hidden_layers=s["layers"],
                      num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                      intermediate_size=s["mlp"], vocab_size=s["vocab"],
                      max_position_embeddings=s["seq"], bos_token_id=0, eos_token_id=0)
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=s["width"], n_layer=s["layers"], n_head=s["heads"],
                                       n_inner=s["mlp"], vocab_size=s["vocab"],
                                       n_positions=s["seq"], bos_token_id=0, eos_token_id=0,
                                       attn_implementation="sdpa")
    if family == "gemma2":
        return transformers.Gemma2Config(**common_cfg, head_dim=s["width"] // s["heads"],
                                         final_logit_softcapping=30.0,
                                         attn_logit_softcapping=50.0, attn_implementation="eager")
    cls = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}[family]
    return getattr(transformers, cls + "Config")(**common_cfg, attn_implementation="sdpa")


def build(family: str, size: dict, device: torch.device):
    import transformers

    if family == "dit":
        from diffusers import DiTTransformer2DModel

        model = DiTTransformer2DModel(num_attention_heads=size["heads"],
                                      attention_head_dim=size["width"] // size["heads"],
                                      in_channels=4, num_layers=size["layers"], sample_size=32,
                                      patch_size=2, num_embeds_ada_norm=1000)
    elif family in ENCODERS:
        from memkern.profile.workloads import model_class

        cfg = model_config(family, size)
        model = model_class(cfg, ENCODERS[family][1])(cfg)
    else:
        model = transformers.AutoModelForCausalLM.from_config(model_config(family, size))
    return model.to(device=device, dtype=getattr(torch, size["dtype"])).train()


def make_batch(family: str, size: dict, device: torch.device) -> dict:
    """The keyword arguments of one training call of ``family``'s model."""
    from memkern.profile.workloads import task_batch

    b, t = size["batch"], size["seq"]
    if family == "dit":
        batch = dict(hidden_states=torch.randn(b, 4, 32, 32), timestep=torch.randint(0, 1000, (b,)),
                     class_labels=torch.randint(0, 1000, (b,)))
    elif family in ENCODERS:
        batch = task_batch(model_config(family, size), ENCODERS[family][1], b, t)
    else:
        ids = torch.randint(1, size["vocab"], (b, t))
        batch = dict(input_ids=ids, labels=ids)
    dtype = getattr(torch, size["dtype"])  # images and latents in the parameters' dtype
    return {k: v.to(device, dtype if v.is_floating_point() else v.dtype) for k, v in batch.items()}


def loss_of(model, batch: dict) -> torch.Tensor:
    out = model(**batch)
    return out.loss if getattr(out, "loss", None) is not None else out.sample.float().pow(2).mean()


PATCHES = {"plain": None, "memkern": {}, "memkern-full": {"recompute": "full"},
           "memkern-sdpa": {"attention": False}}
"""memkern-sdpa (encoders only): ``patch(model, attention=False)``, the attention probabilities
kept as SDPA keeps them: memkern / memkern-sdpa is what recomputing them costs and saves."""


def planned_peak(family: str, name: str, size: dict, device: torch.device) -> float:
    """What memkern.profile's planner says this script will measure for configuration
    ``name`` (parameters + optimizer state + the step's peak above its start), in bytes."""
    from memkern.profile import hf_workload, plan_training_step

    plan = plan_training_step(hf_workload(
        model_config(family, size), batch=size["batch"], seq=size["seq"],
        dtype=getattr(torch, size["dtype"]), patch=PATCHES[name],
        optimizer="adamw-fused" if device.type == "cuda" else "adamw",
        task=ENCODERS[family][1] if family in ENCODERS else "causal-lm"),
        device="cuda" if device.type == "cuda" else "cpu")
    return plan.held["parameters"] + plan.held["optimizer state"] + plan.step_peak_above_start


def make_configuration(name: str, base, family: str, device: torch.device):
    model = copy.deepcopy(base)
    if PATCHES.get(name) is not None:
        mk.patch(model, **PATCHES[name])
    elif name == "liger":
        from liger_kernel import transformers as liger

        getattr(liger, LIGER_FN[family])(model=model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4,
                            **({"fused": True} if device.type == "cuda" else {"foreach": True}))
    return model, opt


def make_steps(model, opt, batch):
    """(forward + backward, the whole training step)."""
    def forward_backward():
        loss = loss_of(model, batch)
        loss.backward()
        return loss.detach()

    def step():
        loss = forward_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return forward_backward, step


def state_bytes(model, opt=None) -> int:
    """Bytes held between steps: parameters and optimizer state, each storage once."""
    seen, total = set(), 0
    tensors = list(model.parameters()) + ([] if opt is None else [
        v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)])
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def measure(family: str, names: list[str], size: dict, device: torch.device, reps: int) -> dict:
    torch.manual_seed(0)
    base = build(family, size, device)
    batch = make_batch(family, size, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    runs = {}
    for name in names:
        model, opt = make_configuration(name, base, family, device)
        forward_backward, step = make_steps(model, opt, batch)
        saved = saved_bytes(lambda model=model: loss_of(model, batch))
        first_loss = float(step())  # also creates the optimizer state
        sync()
        gc.collect()  # garbage freed during a measurement would lower its peak
        fwd_bwd = allocation_stats(forward_backward, device=device)
        opt.zero_grad(set_to_none=True)
        gc.collect()
        stats = allocation_stats(step, device=device)
        runs[name] = dict(step=step, held=state_bytes(model, opt), step_peak=stats.peak,
                          fwd_bwd_peak=state_bytes(model) + fwd_bwd.peak, saved=saved,
                          first_loss=first_loss, times=[], cpu_times=[])
    del base
    for _ in range(reps):  # alternate the configurations step by step
        for r in runs.values():
            sync()
            start, cpu_start = time.perf_counter(), time.process_time()
            r["step"]()
            sync()
            r["times"].append(time.perf_counter() - start)
            r["cpu_times"].append(time.process_time() - cpu_start)
    out = {}
    for name, r in runs.items():
        out[name] = {"peak_bytes": r["held"] + r["step_peak"], "held_bytes": r["held"],
                     "forward_backward_peak_bytes": r["fwd_bwd_peak"],
                     "step_peak_bytes": r["step_peak"], "first_loss": r["first_loss"],
                     "saved_bytes": r["saved"],
                     "median_step_seconds": statistics.median(r["times"]),
                     "all_step_seconds": r["times"],
                     "median_step_cpu_seconds": statistics.median(r["cpu_times"]),
                     "all_step_cpu_seconds": r["cpu_times"]}
    return out


def rope_share(size: dict, device: torch.device, reps: int, plain: dict) -> dict:
    """What fusing RoPE could save on the Llama model: its saved bytes and time per step."""
    from transformers.models.llama import modeling_llama

    torch.manual_seed(0)
    model = build("llama", size, device)
    dtype = getattr(torch, size["dtype"])
    b, t, h, kv = size["batch"], size["seq"], size["heads"], size["kv_heads"]
    d = size["width"] // h
    q = torch.randn(b, h, t, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(b, kv, t, d, device=device, dtype=dtype, requires_grad=True)
    pos = torch.arange(t, device=device)[None].expand(b, t)
    cos, sin = model.model.rotary_emb(q, pos)

    def rope_fwd_bwd():
        qe, ke = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
        torch.autograd.backward((qe, ke), (torch.ones_like(qe), torch.ones_like(ke)))

    ids = torch.randint(1, size["vocab"], (b, t), device=device)
    rope_saved = saved_bytes(lambda: modeling_llama.apply_rotary_pos_emb(q, k, cos, sin))
    model_saved = saved_bytes(lambda: model(input_ids=ids, labels=ids).loss)
    per_call = common.median_seconds(rope_fwd_bwd, reps=reps, device=device)
    per_call_cpu = common.median_seconds(rope_fwd_bwd, reps=reps, device=device,
                                         clock=time.process_time)
    out = {"saved_bytes_per_layer": rope_saved, "layers": size["layers"],
           "model_saved_bytes": model_saved,
           "saved_share": rope_saved * size["layers"] / model_saved,
           "fwd_bwd_seconds_per_layer": per_call,
           "time_share_of_plain_step": per_call * size["layers"] / plain["median_step_seconds"]}
    if device.type == "cpu":
        out["fwd_bwd_cpu_seconds_per_layer"] = per_call_cpu
        out["cpu_time_share_of_plain_step"] = (per_call_cpu * size["layers"]
                                               / plain["median_step_cpu_seconds"])
    return out


def liger_available(family: str) -> str | None:
    """None if Liger-Kernel can run this family here, else why not."""
    if family not in LIGER_FN:
        return f"Liger-Kernel has no {family} patch"
    try:
        from liger_kernel import transformers as liger  # noqa: F401
    except Exception as e:  # it imports triton GPU code: any failure means 'not here'
        return f"liger_kernel does not import here ({type(e).__name__}: {e})"
    if not torch.cuda.is_available():
        return "Liger-Kernel's kernels need a GPU"
    return None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", choices=list(SIZES), default=None)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--save", metavar="PATH", default=None)
    ap.add_argument("--only", default=None, help=argparse.SUPPRESS)  # a subprocess: 'family:conf'
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    size_name = args.size or ("160m" if device.type == "cuda" else "cpu")
    size = SIZES[size_name]
    if args.only:
        family, name = args.only.split(":")
        print("RESULT " + json.dumps(measure(family, [name], size, device, args.reps)))
        return

    families = [f for f in args.families.split(",") if f]
    results = {"device": str(device), "size": size_name, "shape": size, "families": {}}
    for family in families:
        print(f"--- {family}", flush=True)
        names = (["plain", "memkern", "memkern-full"]
                 + (["memkern-sdpa"] if family in ENCODERS else []))
        fam = measure(family, names, size, device, args.reps)
        why = liger_available(family)
        if why is None:
            cmd = [sys.executable, os.path.abspath(__file__), "--device", args.device, "--size",
                   size_name, "--reps", str(args.reps), "--only", f"{family}:liger"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
            if done.returncode == 0 and line:
                fam.update(json.loads(line[-1][len("RESULT "):]))
            else:
                why = f"the Liger run failed: {done.stderr.strip().splitlines()[-1:]}"
        if why is not None:
            print(f"liger skipped: {why}")
            fam["liger_skipped"] = why
        plain = fam["plain"]
        for name, r in fam.items():
            if not isinstance(r, dict):
                continue
            r["peak_vs_plain"] = r["peak_bytes"] / plain["peak_bytes"]
            r["forward_backward_peak_vs_plain"] = (r["forward_backward_peak_bytes"]
                                                   / plain["forward_backward_peak_bytes"])
            r["saved_vs_plain"] = r["saved_bytes"] / plain["saved_bytes"]
            r["time_vs_plain"] = r["median_step_seconds"] / plain["median_step_seconds"]
            r["cpu_time_vs_plain"] = r["median_step_cpu_seconds"] / plain["median_step_cpu_seconds"]
            if "liger" in fam:
                r["peak_vs_liger"] = r["peak_bytes"] / fam["liger"]["peak_bytes"]
            planned = ""
            if name in PATCHES and family != "dit":
                r["planned_peak_bytes"] = planned_peak(family, name, size, device)
                planned = f" (planned {r['planned_peak_bytes'] / 2**20:.1f})"
            print(f"{name:>13}: step peak {r['peak_bytes'] / 2**20:7.1f} MiB{planned} "
                  f"({r['peak_vs_plain']:.2f}x plain)  "
                  f"fwd+bwd peak {r['forward_backward_peak_bytes'] / 2**20:7.1f} MiB "
                  f"({r['forward_backward_peak_vs_plain']:.2f}x)  "
                  f"saved {r['saved_vs_plain']:.3f}x  "
                  f"step {1e3 * r['median_step_seconds']:8.1f} ms ({r['time_vs_plain']:.2f}x "
                  f"plain; process CPU time {r['cpu_time_vs_plain']:.2f}x)  "
                  f"first loss {r['first_loss']:.4f}",
                  flush=True)
        results["families"][family] = fam
    if "llama" in results["families"]:
        results["rope"] = rope_share(size, device, max(args.reps, 5),
                                     results["families"]["llama"]["plain"])
        print("rope:", results["rope"])
    target = TARGET_CPU_PEAK if device.type == "cpu" else TARGET_GPU_PEAK_VS_LIGER
    results["target"] = (f"forward + backward peak <= {target}x plain's" if device.type == "cpu"
                         else f"peak <= {target}x Liger's at <= 1.0x plain's time")
    print("target:", results["target"])
    out = args.save or os.path.join(os.path.dirname(__file__), "results", f"{device.type}-hf.json")
    common.save(out, results)


if __name__ == "__main__":
    main()
