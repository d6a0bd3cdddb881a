"""Saved-for-backward bytes by module: what a training forward of one of ``bench_hf.py``'s models
leaves for backward, plain and patched, each storage once (parameters excluded), attributed to
the innermost module running when it was saved (layer indices kept).

    python benchmarks/saved_by_module.py --family dit [--size small] \
        [--variants plain,memkern,memkern-full]

Prints, per variant, the total and each module's share (MiB), largest first.
"""
from __future__ import annotations

import argparse
import collections
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_hf  # noqa: E402
import memkern as mk  # noqa: E402

VARIANTS = {"plain": None, "memkern": {}, "memkern-full": {"recompute": "full"}}


def saved_by_module(model: torch.nn.Module, batch: dict) -> collections.Counter:
    """Bytes saved for backward by ``bench_hf.loss_of(model, batch)``, by module name."""
    stack = ["<model>"]

    def left(module, args, output) -> None:  # (a hook returning a value replaces the output)
        stack.pop()

    handles = []
    for name, mod in model.named_modules():
        handles.append(mod.register_forward_pre_hook(
            lambda m, a, n=name: stack.append(n or "<model>")))
        handles.append(mod.register_forward_hook(left, always_call=True))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, by = set(), collections.Counter()

    def pack(t):
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if storage.data_ptr() not in params and key not in seen:
            seen.add(key)
            by[stack[-1]] += storage.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            bench_hf.loss_of(model, batch)
    finally:
        for h in handles:
            h.remove()
    return by


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", required=True)
    parser.add_argument("--size", default="small", choices=list(bench_hf.SIZES))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    size, cpu = bench_hf.SIZES[args.size], torch.device("cpu")
    torch.manual_seed(0)
    base = bench_hf.build(args.family, size, cpu)
    batch = bench_hf.make_batch(args.family, size, cpu)
    for variant in args.variants.split(","):
        model = copy.deepcopy(base)
        if VARIANTS[variant] is not None:
            mk.patch(model, **VARIANTS[variant])
        by = saved_by_module(model, batch)
        print(f"{variant}: {sum(by.values()) / 2**20:.2f} MiB saved for backward")
        for name, n in by.most_common():
            print(f"  {n / 2**20:7.2f}  {name}")


if __name__ == "__main__":
    main()
